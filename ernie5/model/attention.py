"""Grouped-query attention with optional QK-norm, Uni-RoPE and a KV cache."""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ernie5.kernels import kernels, ops
from ernie5.model.config import ModelConfig
from ernie5.model.kv_cache import KVCache
from ernie5.model.linear import Linear
from ernie5.model.mask import AttnMask
from ernie5.model.norm import RMSNorm
from ernie5.model.rope import apply_rope


def _flex_attention(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    if q.is_cuda:
        fn = _compiled_flex()
        return fn(q, k, v, block_mask=block_mask, enable_gqa=True)
    with warnings.catch_warnings():  # eager flex materialises scores; fine for CPU checks
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


_COMPILED = None


def _compiled_flex():
    global _COMPILED
    if _COMPILED is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


FP32_TRAIN_ATTN_MAX_KEYS = 512
"""On CPU, bf16 attention that will be differentiated runs the fused kernel (or an fp32 backward) up
to this many keys: both keep whole key rows."""

FUSED_INFER_MAX_KEYS = 2048
"""On CPU, bf16 attention without gradients runs the fused kernel's forward up to this many keys
(whole key rows; measured to the nano ``max_seq_len``): causal, head dim 32, one query per key,
0.72 ms against SDPA's 2.32 at 512 keys and 10.4 against 20.9 at 2048 (Zen 4, 2 threads), and
closer to a float64 reference (the softmax weights stay fp32)."""

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _BF16FlashFP32Backward(torch.autograd.Function):
    """CPU flash attention: bf16 forward, fp32 backward.

    PyTorch's CPU flash attention is faster in bf16 than in fp32 forward, but its backward is
    slower in bf16 at short sequences with head_dim 32 (nano shape, B=8 x T=256, per layer:
    forward 1.4 ms bf16 vs 2.6 ms fp32; backward 11.8 vs 5.9 ms). So the forward runs in bf16
    (saving the log-sum-exp) and the backward recomputes in fp32 from the exactly upcast bf16
    inputs and the bf16 output.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask: AttnMask):  # noqa: D102
        o, lse = _flash(q, k, v, 0.0, mask.is_causal, attn_mask=mask.additive_B1TS(q.dtype))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask = mask
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        q, k, v, o, lse = ctx.saved_tensors
        mask = ctx.mask
        f = [t.float() for t in (do, q, k, v, o)]
        bias = mask.additive_B1TS(torch.float32)
        dq, dk, dv = _flash_backward(*f, lse, 0.0, mask.is_causal, attn_mask=bias)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class _FusedAttention(torch.autograd.Function):
    """CPU fused attention (:mod:`ernie5.kernels`, ``cpu_attention.cpp``): bf16 in and out, fp32 math.

    Whole key rows with an exact softmax; ``Q K^T`` and ``dO V^T`` multiply bf16 exactly (AMX or
    AVX512-BF16) and add in fp32, every product with ``P`` or ``dS`` is an fp32 FMA, so, unlike
    PyTorch's bf16 flash forward, ``P`` is never rounded to bf16 (forward error <= 0.5 bf16 ulp
    against a float64 reference, vs up to 33 ulp). Causal rows and masked key spans are skipped.
    Nano shape per layer (B=8, H=8, K=2, T=256, head dim 32), forward + backward: 8.4 -> 4.0 ms
    causal, 9.5 -> 3.5 ms with document masks, against :class:`_BF16FlashFP32Backward`.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask: AttnMask):  # noqa: D102
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = kernels().attn_fwd(q, k, v, mask.is_causal, _fp32_bias(mask), True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask = mask
        return o

    @staticmethod
    def backward(ctx, do):  # noqa: D102
        q, k, v, o, lse = ctx.saved_tensors
        mask = ctx.mask
        dq, dk, dv = kernels().attn_bwd(
            do.contiguous(), q, k, v, o, lse, mask.is_causal, _fp32_bias(mask), True
        )
        return dq, dk, dv, None


def _fp32_bias(mask: AttnMask) -> torch.Tensor:
    bias = mask.additive_B1TS(torch.float32)
    return bias if bias is not None else torch.empty(0)


def _fused_attention_fits(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, mask: AttnMask) -> bool:
    """Whether :class:`_FusedAttention` takes this call (shapes, and a build with the kernel)."""
    d, (h, t), (kv, s) = q_BHTD.shape[3], q_BHTD.shape[1:3], k_BKTD.shape[1:3]
    if d % 16 or not 16 <= d <= 128 or h % kv or (mask.is_causal and t != s):
        return False
    mod = kernels()
    return mod is not None and mod.attention_available()


def _sdpa(q_BHTD, k_BKTD, v_BKTD, mask: AttnMask) -> torch.Tensor:
    """SDPA; short bf16 training attention on CPU runs :class:`_FusedAttention` where the kernels
    have it (a CPU with AVX512-BF16), else :class:`_BF16FlashFP32Backward`; a decoding step's few
    query rows on CPU run :func:`ernie5.kernels.ops.attend_rows` (PyTorch's SDPA costs ~35 us a call
    there, for one query against a hundred keys); other bf16 inference on CPU runs the fused
    kernel's forward (:data:`FUSED_INFER_MAX_KEYS`), and fp32 inference
    :func:`ernie5.kernels.ops.attend_f32` (nano, 512 causal keys: 1.0 ms against SDPA's 2.6)."""
    needs_grad = ops.needs_grad(q_BHTD, k_BKTD, v_BKTD)
    if (
        q_BHTD.dtype == torch.bfloat16
        and q_BHTD.device.type == "cpu"
        and needs_grad
        and k_BKTD.shape[2] <= FP32_TRAIN_ATTN_MAX_KEYS
    ):
        if k_BKTD.dtype == v_BKTD.dtype == torch.bfloat16 and _fused_attention_fits(q_BHTD, k_BKTD, mask):
            return _FusedAttention.apply(q_BHTD, k_BKTD, v_BKTD, mask)
        return _BF16FlashFP32Backward.apply(q_BHTD, k_BKTD, v_BKTD, mask)
    if ops.attend_rows_fusable(q_BHTD, k_BKTD, v_BKTD):  # a decoding step: a few query rows
        return ops.attend_rows(q_BHTD, k_BKTD, v_BKTD, mask.dense_B1TS, mask.is_causal)
    if (
        q_BHTD.dtype == k_BKTD.dtype == v_BKTD.dtype == torch.bfloat16
        and q_BHTD.device.type == "cpu"
        and not needs_grad
        and k_BKTD.shape[2] <= FUSED_INFER_MAX_KEYS
        and _fused_attention_fits(q_BHTD, k_BKTD, mask)
    ):  # bf16 inference (prefill, scoring): the training kernel's forward, without its graph
        q_BHTD, k_BKTD, v_BKTD = q_BHTD.contiguous(), k_BKTD.contiguous(), v_BKTD.contiguous()
        return kernels().attn_fwd(q_BHTD, k_BKTD, v_BKTD, mask.is_causal, _fp32_bias(mask), True)[0]
    same_len = q_BHTD.shape[2] == k_BKTD.shape[2]
    if ops.attend_f32_fusable(q_BHTD, k_BKTD, v_BKTD) and (same_len or not mask.is_causal):
        # fp32 inference (prefill, scoring); the kernel's causal rule is for T == S here
        return ops.attend_f32(q_BHTD, k_BKTD, v_BKTD, mask.dense_B1TS, mask.is_causal)
    # Inference shapes change call by call (a decode step's key length grows by one), and PyTorch's
    # cuDNN backend builds an execution plan for every new shape: 3.8 ms of host time per call
    # while decoding the nano model on an H200 (torch 2.11), 78 % of the decode time.
    no_cudnn = q_BHTD.is_cuda and not torch.is_grad_enabled()
    with sdpa_kernel(_SDPA_NO_CUDNN) if no_cudnn else contextlib.nullcontext():
        return F.scaled_dot_product_attention(
            q_BHTD, k_BKTD, v_BKTD, attn_mask=mask.dense_B1TS, is_causal=mask.is_causal, enable_gqa=True
        )


_SDPA_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Attention(nn.Module):
    """Multi-head attention with ``n_kv_heads`` shared key/value heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.dim_head
        self.wqkv = Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.dim_head)
        self.wo = Linear(cfg.n_heads * cfg.dim_head, cfg.d_model)
        self.q_norm = RMSNorm(cfg.dim_head, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.dim_head, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_BTP: torch.Tensor,
        sin_BTP: torch.Tensor,
        mask: AttnMask,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        h, k, dh = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x_BTD).view(b, t, h + 2 * k, dh)
        norm_w = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        if ops.fusable(qkv, *norm_w):  # one pass: split, QK-norm, RoPE, heads-first layout
            q_w, k_w = norm_w or (None, None)
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            q_BHTD, k_BKTD, v_BKTD = ops.qk_norm_rope(qkv, q_w, k_w, cos_BTP, sin_BTP, h, k, eps)
        else:
            q_BTHD, k_BTKD, v_BTKD = qkv.split([h, k, k], dim=2)
            if self.q_norm is not None:
                q_BTHD, k_BTKD = self.q_norm(q_BTHD), self.k_norm(k_BTKD)
            q_BHTD = apply_rope(q_BTHD.transpose(1, 2), cos_BTP, sin_BTP)
            k_BKTD = apply_rope(k_BTKD.transpose(1, 2), cos_BTP, sin_BTP)
            v_BKTD = v_BTKD.transpose(1, 2)
        if cache is not None:
            k_BKTD, v_BKTD = cache.update(layer, k_BKTD, v_BKTD)
        if mask.block_mask is not None:
            o_BHTD = _flex_attention(q_BHTD, k_BKTD, v_BKTD, mask.block_mask)
        else:
            o_BHTD = _sdpa(q_BHTD, k_BKTD, v_BKTD, mask)
        return self.wo(o_BHTD.transpose(1, 2).reshape(b, t, h * dh))
