"""Attention back-ends, applied to :class:`ernie5.model.attention.Attention` from outside.

:class:`FastAttention` keeps the model's attention (same parameters, same function) and replaces
its two steps:

* ``project``: on CPU, the split of the packed q/k/v projection, QK-norm, RoPE and the heads-first
  layout in one kernel pass (``qk_norm_rope``).
* ``attend``, by what the call needs:

  - bf16 training on CPU (keys up to :data:`FP32_TRAIN_ATTN_MAX_KEYS`): the fused attention kernel
    (``cpu_attention.cpp``, exact softmax over whole key rows with fp32 weights) where the CPU has
    AVX512-BF16, else PyTorch's flash forward in bf16 with an fp32 backward;
  - a decoding step (a few query rows) on CPU: ``attend_rows`` over the KV cache read in place;
  - bf16 inference on CPU (keys up to :data:`FUSED_INFER_MAX_KEYS`): the fused kernel's forward;
  - fp32 inference on CPU: ``attend_f32`` (keys transposed once per kv head);
  - block masks on CUDA: compiled ``flex_attention``;
  - everything else: PyTorch's SDPA, without its cuDNN back-end for inference on CUDA (cuDNN
    builds an execution plan for every new shape, and a decoding step's key length grows by one).

The model's :meth:`~ernie5.model.attention.Attention.attend` (SDPA, or eager flex under a block
mask) is the reference every back-end is tested against (``tests/kernels``, ``tests/fast``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ernie5.kernels import kernels, ops
from ernie5.model.attention import Attention, flex_attention
from ernie5.model.mask import AttnMask

FP32_TRAIN_ATTN_MAX_KEYS = 512
"""On CPU, bf16 attention that will be differentiated runs the fused kernel (or an fp32 backward) up
to this many keys: both keep whole key rows."""

FUSED_INFER_MAX_KEYS = 2048
"""On CPU, bf16 attention without gradients runs the fused kernel's forward up to this many keys
(whole key rows; the nano ``max_seq_len``)."""

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_SDPA_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_COMPILED_FLEX: list = []


def _compiled_flex():
    """``flex_attention`` compiled once per process (what makes it fast on CUDA)."""
    if not _COMPILED_FLEX:
        from torch.nn.attention.flex_attention import flex_attention as flex

        _COMPILED_FLEX.append(torch.compile(flex, dynamic=False))
    return _COMPILED_FLEX[0]


class _BF16FlashFP32Backward(torch.autograd.Function):
    """CPU flash attention: bf16 forward, fp32 backward.

    PyTorch's CPU flash attention is faster in bf16 than in fp32 forward, but its backward is
    slower in bf16 at short sequences with a small head dim. So the forward runs in bf16 (saving
    the log-sum-exp) and the backward recomputes in fp32 from the exactly upcast bf16 inputs and
    the bf16 output.
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
    """CPU fused attention (``cpu_attention.cpp``): bf16 in and out, fp32 math.

    Whole key rows with an exact softmax; ``Q K^T`` and ``dO V^T`` multiply bf16 exactly (AMX or
    AVX512-BF16) and add in fp32, every product with ``P`` or ``dS`` is an fp32 FMA, so, unlike
    PyTorch's bf16 flash forward, ``P`` is never rounded to bf16. Causal rows and masked key spans
    are skipped.
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


def attend(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, mask: AttnMask) -> torch.Tensor:
    """Attention by the fastest back-end that takes the call (see the module docstring)."""
    if mask.block_mask is not None:
        if q_BHTD.is_cuda:
            return _compiled_flex()(q_BHTD, k_BKTD, v_BKTD, block_mask=mask.block_mask, enable_gqa=True)
        return flex_attention(q_BHTD, k_BKTD, v_BKTD, mask.block_mask)
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
    no_cudnn = q_BHTD.is_cuda and not torch.is_grad_enabled()
    with sdpa_kernel(_SDPA_NO_CUDNN) if no_cudnn else contextlib.nullcontext():
        return F.scaled_dot_product_attention(
            q_BHTD, k_BKTD, v_BKTD, attn_mask=mask.dense_B1TS, is_causal=mask.is_causal, enable_gqa=True
        )


class FastAttention(Attention):
    """The model's attention with the fused projection step and the back-ends of :func:`attend`."""

    def project(self, qkv_BTND, cos_BTP, sin_BTP):  # noqa: D102
        norm_w = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        if not ops.fusable(qkv_BTND, *norm_w):
            return super().project(qkv_BTND, cos_BTP, sin_BTP)
        q_w, k_w = norm_w or (None, None)
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        return ops.qk_norm_rope(qkv_BTND, q_w, k_w, cos_BTP, sin_BTP, self.n_heads, self.n_kv_heads, eps)

    def attend(self, q_BHTD, k_BKSD, v_BKSD, mask):  # noqa: D102
        return attend(q_BHTD, k_BKSD, v_BKSD, mask)
