"""Elastic sub-models of a Hugging Face causal LM, applied by patches scoped to one forward.

The ERNIE5 forward takes a :class:`~ernie5.model.elastic.Subnet` as an argument; a Hugging Face model
does not, so :func:`elastic` patches the loaded model for the duration of a ``with`` block and
restores it on exit (nothing is copied and no weight is touched):

  * **depth**: a skipped decoder layer's ``forward`` is the identity on the residual stream (its
    input hidden states are returned as they are);
  * **top-k** and **expert dropping**: the router of an MoE layer (the ``*TopKRouter`` module of the
    Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE families in transformers 5) is given a forward that masks
    the router logits of the dropped experts to ``-inf`` before the softmax, takes the top-k over the
    kept ones and renormalises them the family's way (Mixtral: always over the top-k; Qwen2/3-MoE and
    OLMoE: over the top-k when ``norm_topk_prob`` is set, else the softmax over the kept experts).

A layer whose router keeps all experts and the family's top-k is not patched, so ``Subnet.full``
runs the unmodified model exactly. Expert loads are counted by forward hooks on the routers (the
top-k indices they return) over the positions the caller marks as real.

:class:`HFShape` describes a model with the fields :func:`ernie5.subnets.spec.resolve` reads
(``n_layers``, ``moe.n_experts``, ``moe.top_k``, ``is_moe_layer``), so the ERNIE5 spec strings
(``full``, ``k1``, ``d0.75``, ``w0.5``, ...) resolve unchanged. A dense model (no router) gets one
pseudo-expert and top-k 1: only depth cuts change it.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §3.3 (elastic depth, width, sparsity).
  * transformers 5 ``modeling_mixtral.py``, ``modeling_qwen2_moe.py``, ``modeling_qwen3_moe.py``,
    ``modeling_olmoe.py`` (``*TopKRouter``, ``*SparseMoeBlock``).

Deviations:
  1. Dropped experts leave the renormalisation over the kept experts only (the masked softmax);
     ERNIE5 masks its router the same way, but a family without ``norm_topk_prob`` then gives its
     kept top-k more weight than the full model's softmax over all experts would.
  2. Qwen2-MoE's shared expert is never dropped (it is not routed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ernie5.model.elastic import Subnet

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
"""The MoE families whose routers :func:`elastic` patches (checked by tests/evals/test_hf_model.py)."""


@dataclass(frozen=True)
class MoeShape:
    """The routed-expert dimensions :func:`ernie5.subnets.spec.resolve` reads."""

    n_experts: int
    top_k: int


@dataclass(frozen=True)
class HFShape:
    """A Hugging Face model's elastic dimensions, duck-typed as the ``ModelConfig`` fields specs use."""

    model_type: str
    n_layers: int
    moe: MoeShape
    moe_layers: tuple[int, ...]
    max_seq_len: int

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` has a router."""
        return i in self.moe_layers


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (``model.model.layers`` for the supported families)."""
    base = getattr(model, "model", None) or getattr(model, model.base_model_prefix, None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers at model.layers (unsupported)")
    return layers


def router_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's top-k router module, or None for a dense layer."""
    for mod in layer.modules():
        if type(mod).__name__.endswith("TopKRouter") and hasattr(mod, "top_k") and hasattr(mod, "weight"):
            return mod
    return None


def experts_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The layer's routed-experts module (3-D ``gate_up_proj`` / ``down_proj`` weights), if any."""
    for mod in layer.modules():
        if type(mod).__name__.endswith("Experts") and hasattr(mod, "gate_up_proj"):
            return mod
    return None


def shape_of(model: torch.nn.Module, max_len: int = 4096) -> HFShape:
    """The elastic shape of ``model``; ``max_len`` caps the scoring window."""
    layers = decoder_layers(model)
    routers = [router_of(layer) for layer in layers]
    moe = [i for i, r in enumerate(routers) if r is not None]
    if moe:
        n_experts = {int(routers[i].weight.shape[0]) for i in moe}
        top_k = {int(routers[i].top_k) for i in moe}
        if len(n_experts) > 1 or len(top_k) > 1:
            raise ValueError("MoE layers with different expert counts or top-k are not supported")
        shape = MoeShape(n_experts.pop(), top_k.pop())
    elif model.config.model_type in MOE_FAMILIES:
        raise ValueError(
            f"{model.config.model_type}: no *TopKRouter module (the elastic patches need transformers 5)"
        )
    else:
        shape = MoeShape(1, 1)
    window = int(getattr(model.config, "max_position_embeddings", max_len) or max_len)
    return HFShape(model.config.model_type, len(layers), shape, tuple(moe), min(window, max_len))


def _identity(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return hidden_states


def masked_router_forward(router: torch.nn.Module, kept: torch.Tensor | None, top_k: int) -> Callable:
    """A forward for ``router`` over the experts ``kept`` marks (None: all) with ``top_k``, renormalised
    as the family does (see the module docstring)."""
    always_norm = not hasattr(router, "norm_topk_prob")  # Mixtral renormalises over the top-k always

    def forward(hidden_states: torch.Tensor):
        hs = hidden_states.reshape(-1, router.weight.shape[1])
        logits = F.linear(hs, router.weight)
        masked = logits if kept is None else logits.masked_fill(~kept.to(logits.device), float("-inf"))
        probs = torch.softmax(masked.float(), dim=-1)
        top, idx = torch.topk(probs, top_k, dim=-1)
        if always_norm or router.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        if not always_norm:
            top = top.to(logits.dtype)
        return logits, top, idx

    return forward


class RoutingCounter:
    """Expert loads (top-k selections per expert) per layer over the positions marked real."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.real: torch.Tensor | None = None
        """Flattened ``(B*T,)`` boolean mask of the positions to count (None: all)."""
        self.counts: dict[int, torch.Tensor] = {}

    def hook(self, layer: int) -> Callable:
        """A forward hook for ``layer``'s router."""

        def fn(_mod, _args, output) -> None:
            idx = output[2]
            if self.real is not None and self.real.numel() == idx.shape[0]:
                idx = idx[self.real.to(idx.device)]
            c = torch.bincount(idx.reshape(-1).cpu(), minlength=self.n_experts)
            self.counts[layer] = self.counts.get(layer, torch.zeros_like(c)) + c

        return fn


@contextlib.contextmanager
def elastic(
    model: torch.nn.Module, subnet: Subnet, shape: HFShape, counter: RoutingCounter | None = None
) -> Iterator[None]:
    """Run ``model`` as ``subnet`` inside the block (patches restored on exit, also on error)."""
    layers = decoder_layers(model)
    kept_layers = set(subnet.layers)
    patched: list[tuple[torch.nn.Module, object]] = []  # (module, its own forward attribute or None)
    hooks = []
    try:
        for i, layer in enumerate(layers):
            if i not in kept_layers:
                patched.append((layer, layer.__dict__.get("forward")))
                layer.forward = _identity
                continue
            router = router_of(layer) if shape.is_moe_layer(i) else None
            if router is None:
                continue
            mask = subnet.expert_mask(i, shape.moe.n_experts, router.weight.device)
            if mask is not None or subnet.top_k != router.top_k:
                patched.append((router, router.__dict__.get("forward")))
                router.forward = masked_router_forward(router, mask, subnet.top_k)
            if counter is not None:
                hooks.append(router.register_forward_hook(counter.hook(i)))
        yield
    finally:
        for mod, own in reversed(patched):
            if own is None:
                del mod.forward  # the class's forward again
            else:
                mod.forward = own
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def compact_cache_indices(model: torch.nn.Module, subnet: Subnet) -> Iterator[int]:
    """Inside the block the kept decoder layers' ``layer_idx`` (their attention's key into the KV cache)
    are renumbered ``0 .. n-1`` in order, so a cache filled by the sub-model holds exactly its kept
    layers, the first of them at index 0 where Hugging Face reads the cached length (a depth cut that
    drops layer 0 would otherwise leave that slot empty); yields ``n``. Restored on exit."""
    layers = decoder_layers(model)
    kept = [i for i in range(len(layers)) if i in set(subnet.layers)]
    saved: list[tuple[torch.nn.Module, int]] = []
    try:
        for new, i in enumerate(kept):
            for mod in layers[i].modules():
                if isinstance(getattr(mod, "layer_idx", None), int):
                    saved.append((mod, mod.layer_idx))
                    mod.layer_idx = new
        yield len(kept)
    finally:
        for mod, idx in saved:
            mod.layer_idx = idx


def param_counts(model: torch.nn.Module, subnet: Subnet, shape: HFShape) -> tuple[int, int]:
    """``(total, active)`` parameters of ``subnet``: the embeddings, final norm and head, plus each kept
    layer's non-expert parameters, plus its kept experts (total) or ``top_k`` experts (active)."""
    layers = decoder_layers(model)
    in_layers = sum(p.numel() for p in layers.parameters())
    total = active = sum(p.numel() for p in model.parameters()) - in_layers
    for i in subnet.layers:
        layer = layers[i]
        own = sum(p.numel() for p in layer.parameters())
        experts = experts_of(layer) if shape.is_moe_layer(i) else None
        if experts is None:
            total += own
            active += own
            continue
        routed = sum(p.numel() for p in experts.parameters())
        per_expert = routed // shape.moe.n_experts
        total += own - routed + per_expert * subnet.n_experts_kept(i, shape.moe.n_experts)
        active += own - routed + per_expert * subnet.top_k
    return total, active
