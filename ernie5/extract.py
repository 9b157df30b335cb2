"""Physically slicing an elastic sub-model out of its supernet, and importance calibration.

:func:`extract_subnet` builds a standalone model holding only the kept layers and, in each MoE
layer, only the kept routed experts with their router rows and aux-free bias entries. Its config
says ``n_layers = |layers|``, ``moe.n_experts = |experts|`` and ``moe.top_k = subnet.top_k``, so its
plain forward equals the parent's masked forward (a softmax over the kept router logits is exactly
the masked softmax; a sigmoid score does not depend on the other experts at all).

:func:`compute_importance` measures, on calibration batches, each layer's block influence
(``1 - cos(h_in, h_out)`` averaged over tokens, ShortGPT) and each routed expert's share of routed
pairs; ``layers=importance`` / ``experts=importance`` deploy selections use them.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §3.3 and §6.4.2 (sub-models deployed directly).
  * ShortGPT (arXiv 2403.03853) block influence.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from ernie5.model.config import ModelConfig
from ernie5.model.elastic import Importance, Subnet
from ernie5.model.model import Ernie5Model
from ernie5.model.moe import MoE


def subnet_config(cfg: ModelConfig, subnet: Subnet) -> ModelConfig:
    """Config of the standalone model that ``subnet`` extracts to."""
    widths = {len(e) for i, e in enumerate(subnet.experts) if e is not None and i in subnet.layers}
    if len(widths) > 1:
        raise ValueError(
            f"cannot extract a subnet whose layers keep different expert counts: {sorted(widths)}"
        )
    n_experts = widths.pop() if widths else cfg.moe.n_experts
    n_dense = sum(1 for i in subnet.layers if not cfg.is_moe_layer(i))
    return replace(
        cfg,
        n_layers=len(subnet.layers),
        n_dense_layers=n_dense,
        moe=replace(cfg.moe, n_experts=n_experts, top_k=subnet.top_k),
    )


@torch.no_grad()
def extract_subnet(model: Ernie5Model, subnet: Subnet) -> Ernie5Model:
    """A new model holding only ``subnet``'s layers and experts (weights copied)."""
    cfg = subnet_config(model.cfg, subnet)
    with torch.device("meta"):
        child = Ernie5Model(cfg)
    child = child.to_empty(device=model.tok_emb.weight.device).to(model.tok_emb.weight.dtype)
    child.tok_emb.load_state_dict(model.tok_emb.state_dict())
    child.norm.load_state_dict(model.norm.state_dict())
    if not cfg.tie_embeddings:
        child.head.load_state_dict(model.head.state_dict())
    else:
        child.head.weight = child.tok_emb.weight
    child.mtp.load_state_dict(model.mtp.state_dict())
    if model.vision is not None:
        child.vision.load_state_dict(model.vision.state_dict())
    if model.audio is not None:
        child.audio.load_state_dict(model.audio.state_dict())
    for new_i, old_i in enumerate(subnet.layers):
        src, dst = model.layers[old_i], child.layers[new_i]
        kept = subnet.experts[old_i]
        state = copy.copy(src.state_dict())
        if isinstance(src.ffn, MoE) and kept is not None:
            idx = torch.tensor(kept, device=src.ffn.w13.device)
            state["ffn.router.weight"] = src.ffn.router.weight[idx]
            state["ffn.router_bias"] = src.ffn.router_bias[idx]
            state["ffn.w13"] = src.ffn.w13[idx]
            state["ffn.w2"] = src.ffn.w2[idx]
        dst.load_state_dict(state)
    child.inv_freq.copy_(model.inv_freq)
    return child


def extraction_meta(subnet: Subnet, parent_cfg: ModelConfig) -> dict:
    """What an extracted checkpoint records about its origin."""
    return {
        "spec": subnet.name,
        "parent_layers": list(subnet.layers),
        "parent_experts": [list(e) if e is not None else None for e in subnet.experts],
        "parent_n_layers": parent_cfg.n_layers,
        "parent_n_experts": parent_cfg.moe.n_experts,
        "top_k": subnet.top_k,
    }


@torch.no_grad()
def compute_importance(model: Ernie5Model, batches: list[torch.Tensor]) -> Importance:
    """Block influence per layer and routing frequency per expert on calibration token batches."""
    cfg = model.cfg
    n = cfg.n_layers
    influence = [0.0] * n
    freq = [
        torch.zeros(cfg.moe.n_experts, dtype=torch.float64) if cfg.is_moe_layer(i) else None for i in range(n)
    ]
    hooks = []
    inputs: dict[int, torch.Tensor] = {}

    def pre(i):
        def fn(_mod, args):
            inputs[i] = args[0].detach()

        return fn

    def post(i):
        def fn(_mod, _args, output):
            h_out = output[0]
            cos = torch.nn.functional.cosine_similarity(inputs[i].float(), h_out.float(), dim=-1)
            influence[i] += float((1 - cos).mean())

        return fn

    for i, block in enumerate(model.layers):
        hooks.append(block.register_forward_pre_hook(pre(i)))
        hooks.append(block.register_forward_hook(post(i)))
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            out = model(ids, return_logits=False)
            for i, r in out.routing.items():
                freq[i] += r.counts_E.double()
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    nb = max(1, len(batches))
    return Importance(
        layer_influence=tuple(v / nb for v in influence),
        expert_frequency=tuple(
            tuple((f / f.sum().clamp_min(1)).tolist()) if f is not None else None for f in freq
        ),
    )
