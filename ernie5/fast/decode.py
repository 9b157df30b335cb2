"""The fused decoding step: a whole pre-norm block in one kernel call.

A decoding step runs each layer on a few token rows, where some 60 Python-level calls per layer
cost more than the arithmetic. :class:`FastBlock` runs such a step as one ``decode_layer`` call
(``cpu_decode.cpp``): the same kernels as the module path in the same order, so the same result.
:class:`FastErnie5Model` decides once per forward whether the step qualifies (a KV cache, at most
:data:`~ernie5.kernels.ops.ROWS_MAX` token rows, nothing to differentiate, no autocast, on CPU in
bf16 or fp32 with the decoding kernels built, a dense or no mask, and a shape the kernels take)
and tells the blocks through the layer context; each block then checks its own layer (weights in
the step's dtype, experts the kernel takes, the ``gather`` expert path, no routing replay) and
otherwise runs its modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from ernie5.fast.moe import FastMoE
from ernie5.kernels import kernels, ops
from ernie5.model.attention import LayerContext
from ernie5.model.block import Block
from ernie5.model.kv_cache import KVCache
from ernie5.model.model import Ernie5Model
from ernie5.model.moe import MoE, RouterOutput

_EMPTY = torch.empty(0)


@dataclass
class StepContext(LayerContext):
    """A layer context that says whether this forward is a fused decoding step."""

    fused_decode: bool = False


def _fused_plan(block: Block) -> tuple[list, tuple]:
    """``([(owner dict, name, object, in x's dtype?) ...], decode_layer's weight arguments)``: every
    submodule, parameter and buffer the arguments come from, with the ``_modules``,
    ``_parameters`` or ``_buffers`` dict that holds it (where assignment and ``.to()`` put new
    ones)."""
    owned: list = []

    def sub(module: nn.Module, name: str) -> nn.Module | None:
        child = module._modules.get(name)
        owned.append((module._modules, name, child, False))
        return child

    def param(module: nn.Module | None, name: str = "weight") -> torch.Tensor:
        if module is None:
            return _EMPTY
        p = module._parameters[name]
        owned.append((module._parameters, name, p, True))
        return p

    def buffer(module: nn.Module, name: str) -> torch.Tensor:
        b = module._buffers[name]
        owned.append((module._buffers, name, b, False))  # any float dtype: the kernel reads it as fp32
        return b

    def eps(norm: nn.RMSNorm) -> float:
        return norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps  # dtype: checked

    attn, ffn, attn_norm, ffn_norm = (sub(block, n) for n in ("attn", "ffn", "attn_norm", "ffn_norm"))
    q_norm, k_norm = sub(attn, "q_norm"), sub(attn, "k_norm")
    moe = isinstance(ffn, MoE)
    shared = sub(ffn, "shared") if moe else ffn
    if moe:
        c = ffn.cfg
        routed = (
            param(sub(ffn, "router")),
            buffer(ffn, "router_bias"),
            c.score_func == "sigmoid",
            c.norm_topk,
            c.route_scale,
        )
        experts = (param(ffn, "w13"), param(ffn, "w2"))
    else:
        routed, experts = (_EMPTY, _EMPTY, False, False, 1.0), (_EMPTY, _EMPTY)
    args = (
        param(attn_norm),
        eps(attn_norm),
        param(sub(attn, "wqkv")),
        param(q_norm),
        param(k_norm),
        eps(q_norm) if q_norm is not None else 0.0,
        param(sub(attn, "wo")),
        param(ffn_norm),
        eps(ffn_norm),
        *routed,
        *experts,
        param(sub(shared, "w13") if shared is not None else None),
        param(sub(shared, "w2") if shared is not None else None),
        attn.n_heads,
        attn.n_kv_heads,
    )
    return owned, args


class FastBlock(Block):
    """The model's block, whose decoding steps run as one ``decode_layer`` kernel call.

    A fused step of a block without hooks is taken straight from ``__call__``: the module call
    machinery (hook checks, two more Python frames) costs a noticeable share of a small model's
    decoding step. With hooks registered, the call goes through ``nn.Module.__call__`` as usual and
    :meth:`forward` takes the same fused step, so hooks see it.
    """

    _plan: tuple | None = None

    def __call__(self, x_BTD, ctx, layer, top_k=None, expert_mask_E=None, forced_ids_BTA=None):
        if forced_ids_BTA is not None:  # routing replay: the kernel routes by itself
            return super().__call__(x_BTD, ctx, layer, top_k, expert_mask_E, forced_ids_BTA)
        if ctx.__class__ is StepContext and ctx.fused_decode and not self._hooked():
            step = self._decode_step(x_BTD, ctx, layer, top_k, expert_mask_E)
            if step is not None:
                return step
        return super().__call__(x_BTD, ctx, layer, top_k, expert_mask_E)

    def _hooked(self) -> bool:
        """The hook test of ``nn.Module._call_impl``: whether a call must go through it."""
        return bool(
            self._forward_hooks
            or self._forward_pre_hooks
            or self._backward_hooks
            or self._backward_pre_hooks
            or module_hooks._global_forward_hooks
            or module_hooks._global_forward_pre_hooks
            or module_hooks._global_backward_hooks
            or module_hooks._global_backward_pre_hooks
        )

    def forward(self, x_BTD, ctx, layer, top_k=None, expert_mask_E=None, forced_ids_BTA=None):  # noqa: D102
        if forced_ids_BTA is not None:  # routing replay: the module path
            return super().forward(x_BTD, ctx, layer, top_k, expert_mask_E, forced_ids_BTA)
        if isinstance(ctx, StepContext) and ctx.fused_decode:
            step = self._decode_step(x_BTD, ctx, layer, top_k, expert_mask_E)
            if step is not None:
                return step
        return super().forward(x_BTD, ctx, layer, top_k, expert_mask_E)

    def _decode_step(
        self,
        x_BTD: torch.Tensor,
        ctx: StepContext,
        layer: int,
        top_k: int | None,
        expert_mask_E: torch.Tensor | None,
    ) -> tuple[torch.Tensor, RouterOutput | None] | None:
        """:meth:`forward` in one kernel call, or None where this layer cannot take it."""
        ffn = self.ffn
        moe = isinstance(ffn, MoE)
        if moe:
            k = top_k or ffn.cfg.top_k
            x_ND = x_BTD.view(-1, x_BTD.shape[-1])
            if type(ffn) is not FastMoE or ffn.expert_path(x_ND, k, x_BTD.dtype) != "gather":
                return None  # the module path would not take the gather path this step
        else:
            k = 1
        weights = self._weights(x_BTD.dtype)
        if weights is None:
            return None
        mask, cache = ctx.mask, ctx.cache
        out = kernels().decode_layer(
            x_BTD.contiguous(),
            ctx.cos_BTP,
            ctx.sin_BTP,
            cache.k[layer],
            cache.v[layer],
            cache.length,
            mask.dense_B1TS if mask.dense_B1TS is not None else ops.NO_MASK,
            mask.is_causal,
            expert_mask_E if expert_mask_E is not None else ops.NO_MASK,
            k,
            *weights,
        )
        if not moe:
            return out[0], None
        return out[0], RouterOutput(out[1], out[2], out[3])

    def _weights(self, dtype: torch.dtype) -> tuple | None:
        """The layer's half of ``decode_layer``'s arguments (weights, eps, routing settings, head
        counts), or None where the kernel does not take the layer in ``dtype``.

        Built once and kept with the submodules, parameters and buffers it was built from; every
        call checks, by dictionary lookups, that those are still the layer's and its parameters in
        ``dtype`` (``.to()`` keeps parameter objects and changes their data; assigning a new
        module, parameter or buffer rebuilds)."""
        plan = self._plan
        if plan is not None:
            for owner, name, t, typed in plan[0]:
                if owner.get(name) is not t or (typed and t.dtype != dtype):
                    break
            else:
                return plan[1]
        owned, args = _fused_plan(self)
        shapes_ok = not isinstance(self.ffn, MoE) or self.ffn.cfg.d_expert % 16 == 0
        ok = shapes_ok and all(not typed or (t.is_cpu and t.dtype == dtype) for _, _, t, typed in owned)
        self._plan = (owned, args if ok else None)
        return self._plan[1]


class FastErnie5Model(Ernie5Model):
    """The model, whose forwards tell the blocks when they are fused decoding steps."""

    def context(self, positions_3BT, doc_ids_BT, block_ids_BT, cache):  # noqa: D102
        ctx = super().context(positions_3BT, doc_ids_BT, block_ids_BT, cache)
        fused = self._fused_decode_ok(doc_ids_BT, cache, ctx)
        return StepContext(ctx.cos_BTP, ctx.sin_BTP, ctx.mask, ctx.cache, fused)

    def _fused_decode_ok(self, doc_ids_BT: torch.Tensor, cache: KVCache | None, ctx: LayerContext) -> bool:
        """Whether this forward is a decoding step that :class:`FastBlock` can run (the cheap
        conditions first)."""
        b, t = doc_ids_BT.shape
        if cache is None or b * t > ops.ROWS_MAX or torch.is_grad_enabled() or not doc_ids_BT.is_cpu:
            return False
        cfg, kern = self.cfg, kernels()
        return (
            kern is not None
            and ctx.mask.block_mask is None
            and self.tok_emb.weight.dtype in ops.FUSED_DTYPES
            and not torch.is_autocast_enabled("cpu")
            and cfg.d_model % 16 == 0
            and cfg.dim_head % 16 == 0
            and cfg.dim_head <= 128
            and cfg.d_ff % 16 == 0
            and kern.rows_kernels_available()
            and kern.router_linear_available()
        )
