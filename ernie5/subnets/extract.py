"""Physically slicing an elastic sub-model out of its supernet into a checkpoint of its own.

:func:`extract_subnet` builds a standalone model holding only the kept layers and, in each MoE
layer, only the kept routed experts with their router rows and aux-free bias entries. Its config
says ``n_layers = |layers|``, ``moe.n_experts = |experts|`` and ``moe.top_k = subnet.top_k``, so its
plain forward equals the parent's masked forward (a softmax over the kept router logits is exactly
the masked softmax; a sigmoid score does not depend on the other experts at all).

:func:`extract_checkpoint` is ``ernie5 extract``: resolve the spec against a checkpoint, slice, and
save the child with everything the parent ships beside its weights (the text tokenizer and every side
model: vision tokenizer, audio codec, cascaded refiner; :func:`side_models`) and a record of where it
came from, so the child runs every task its supernet runs.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §3.3 and §6.4.2 (sub-models deployed directly).
"""

from __future__ import annotations

import copy
from dataclasses import fields, replace
from pathlib import Path

import torch

from ernie5.fast import apply_fast_paths, is_fast
from ernie5.model.config import ModelConfig
from ernie5.model.elastic import Subnet
from ernie5.model.model import Ernie5Model
from ernie5.model.moe import MoE
from ernie5.store.checkpoint import Checkpoint, save_checkpoint
from ernie5.subnets.params import count_params
from ernie5.subnets.spec import load_subnet


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
    """A new model holding only ``subnet``'s layers and experts (weights copied), with fast paths
    where ``model`` has them."""
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
    return apply_fast_paths(child) if is_fast(model) else child


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


_NOT_SIDE_MODELS = ("path", "model", "cfg", "tokenizer", "meta")


def side_models(ckpt: Checkpoint) -> dict:
    """The frozen models a checkpoint ships beside its weights and tokenizer (vision tokenizer,
    refiner, audio codec, ...), by their :func:`~ernie5.store.checkpoint.save_checkpoint` keyword.

    Read from :class:`~ernie5.store.checkpoint.Checkpoint`'s fields, so a side model added there is
    carried by extraction without a change here (``save_checkpoint`` must accept it by that name)."""
    return {f.name: getattr(ckpt, f.name) for f in fields(Checkpoint) if f.name not in _NOT_SIDE_MODELS}


def extract_checkpoint(checkpoint: str | Path, subnet: str, out: str | Path, data_dir=None) -> dict:
    """Slice ``subnet`` out of ``checkpoint`` into a new checkpoint folder ``out``, with the parent's text
    tokenizer and every side model it ships (:func:`side_models`)."""
    ckpt, sub = load_subnet(checkpoint, subnet, data_dir)
    child = extract_subnet(ckpt.model, sub)
    meta = {
        "step": ckpt.meta.get("step"),
        "git_hash": ckpt.meta.get("git_hash"),
        "subnet": extraction_meta(sub, ckpt.cfg),
        "parent": str(ckpt.path),
    }
    path = save_checkpoint(out, child, tokenizer=ckpt.tokenizer, meta=meta, **side_models(ckpt))

    def size(p: Path) -> int:
        return (p / "model.safetensors").stat().st_size

    parent_params = count_params(ckpt.cfg)
    child_params = count_params(child.cfg)
    return {
        "out": str(path),
        "subnet": sub.name,
        "parent_total_params": parent_params.total_params,
        "total_params": child_params.total_params,
        "active_params": child_params.active_params,
        "parent_file_bytes": size(ckpt.path),
        "file_bytes": size(path),
    }
