"""Autograd wrappers of the fused CPU kernels, and the tests of when they apply (:func:`fusable`).

The fast paths of :mod:`ernie5.fast` call these; the eager counterparts are the model's own code
(``nn.RMSNorm``, :meth:`ernie5.model.attention.Attention.project`, the MoE router), which runs
whenever a test here says no and is the reference of ``tests/kernels``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ernie5.kernels import kernels

FUSED_DTYPES = (torch.bfloat16, torch.float32)


def fusable(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels can take these tensors: all on CPU, one dtype (bf16 or fp32)."""
    dtype = tensors[0].dtype
    if dtype not in FUSED_DTYPES:
        return False
    for t in tensors:  # a plain loop: this runs dozens of times per decoded token
        if not t.is_cpu or t.dtype != dtype:
            return False
    return kernels() is not None


class _NoGradCtx:
    """What a kernel wrapper's ``forward`` gets for ``ctx`` when nothing needs a gradient: it keeps
    nothing, so the forward runs without ``Function.apply``'s graph bookkeeping (paid dozens of
    times per decoded token)."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:  # noqa: D102
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:  # noqa: D102
        pass


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will record an op on these: grad mode on and one of them requiring a gradient."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


NO_MASK = torch.empty(0, dtype=torch.bool)
"""The empty boolean tensor the kernels take for "no mask" (attention keys, available experts)."""

ROWS_MAX = 4
"""At most this many token rows (a decoding step of up to 4 sequences) run :func:`linear`'s kernel."""


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias). A few rows that need no gradient (decoding) run
    ``linear_rows`` of ``cpu_decode.cpp``, which reads the weight in place with fp32 sums (PyTorch's
    bf16 linear has a large fixed cost per call at one row)."""
    k = x.shape[-1]
    if (
        0 < x.numel() <= ROWS_MAX * k
        and k % 16 == 0
        and not needs_grad(x, weight)
        and fusable(x, weight)
        and kernels().rows_kernels_available()
    ):
        y = kernels().linear_rows(x.reshape(-1, k).contiguous(), weight.contiguous())
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def experts_rows_fusable(x_ND: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> bool:
    """Whether ``expert_rows`` (the decoding experts of ``cpu_decode.cpp``) can take these: no
    gradient needed, :func:`fusable`, ``d_model`` and ``d_expert`` multiples of 16."""
    return (
        not needs_grad(x_ND, w13_EFD, w2_EDF)
        and x_ND.shape[1] % 16 == 0
        and w2_EDF.shape[2] % 16 == 0
        and fusable(x_ND, w13_EFD, w2_EDF)
        and kernels().rows_kernels_available()
    )


def _attention_layout_ok(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor) -> bool:
    """What the attention kernels need of the shapes: a head dim that is a multiple of 16, query
    heads a multiple of the kv heads, and keys and values of one layout with a contiguous head dim
    (KV-cache views)."""
    return (
        q_BHTD.shape[3] % 16 == 0
        and k_BKSD.shape == v_BKSD.shape
        and k_BKSD.stride() == v_BKSD.stride()
        and k_BKSD.stride(3) == 1
        and q_BHTD.shape[1] % k_BKSD.shape[1] == 0
    )


def attend_rows_fusable(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor) -> bool:
    """Whether ``attend_rows`` (few-query attention of ``cpu_decode.cpp``) can take these: at most
    :data:`ROWS_MAX` query rows (``B * Tq``), no gradient needed, :func:`fusable`, a head dim up to
    128 and :func:`_attention_layout_ok`."""
    b, _, t, dh = q_BHTD.shape
    return (
        b * t <= ROWS_MAX
        and dh <= 128
        and _attention_layout_ok(q_BHTD, k_BKSD, v_BKSD)
        and not needs_grad(q_BHTD, k_BKSD, v_BKSD)
        and fusable(q_BHTD, k_BKSD, v_BKSD)
        and kernels().rows_kernels_available()
    )


def attend_rows(
    q_BHTD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    allowed_B1TS: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """SDPA (scale ``1/sqrt(Dh)``, grouped-query heads) of a few query rows over keys read in place:
    fp32 scores and softmax, one rounding per output. ``allowed_B1TS`` is the boolean mask (True =
    may attend; None = every key); ``causal`` aligns the queries with the last keys. Returns ``(B,
    H, Tq, Dh)`` laid out as ``(B, Tq, H, Dh)``, so ``.transpose(1, 2).reshape(...)`` is free."""
    mask = allowed_B1TS.contiguous() if allowed_B1TS is not None else NO_MASK
    return kernels().attend_rows(q_BHTD, k_BKSD, v_BKSD, mask, causal)


def _apply(fn: type[torch.autograd.Function], *args):
    """``fn.apply(*args)``, or where no tensor argument needs a gradient, its forward alone."""
    if needs_grad(*(a for a in args if isinstance(a, torch.Tensor))):
        return fn.apply(*args)
    return fn.forward(_NoGradCtx(), *args)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):  # noqa: D102
        x = x.contiguous()
        y, rstd = kernels().rms_norm_fwd(x, weight.contiguous(), eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, weight, rstd = ctx.saved_tensors
        dx, dw = kernels().rms_norm_bwd(dy.contiguous(), x, weight.contiguous(), rstd)
        return dx, dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` in one pass (fp32 math)."""
    return _apply(_RMSNorm, x, weight, eps)


class _QKNormRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, cos, sin, n_heads, n_kv_heads, eps):  # noqa: D102
        qkv = qkv.contiguous()
        b, t, _, dh = qkv.shape
        cos = cos.float().expand(b, t, dh // 2).contiguous()
        sin = sin.float().expand(b, t, dh // 2).contiguous()
        empty = qkv.new_empty(0)
        qw = q_weight.contiguous() if q_weight is not None else empty
        kw = k_weight.contiguous() if k_weight is not None else empty
        q, k, v, rstd = kernels().qk_norm_rope_fwd(qkv, qw, kw, cos, sin, n_heads, n_kv_heads, eps)
        ctx.save_for_backward(qkv, qw, kw, cos, sin, rstd)
        ctx.has_norm = q_weight is not None
        ctx.heads = (n_heads, n_kv_heads)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):  # noqa: D102
        qkv, qw, kw, cos, sin, rstd = ctx.saved_tensors
        b, t, _, dh = qkv.shape
        h, k = ctx.heads
        shapes = ((b, h, t, dh), (b, k, t, dh), (b, k, t, dh))
        grads = [g.contiguous() if g is not None else qkv.new_zeros(s) for g, s in zip((dq, dk, dv), shapes)]
        dqkv, dqw, dkw = kernels().qk_norm_rope_bwd(qkv, qw, kw, cos, sin, rstd, *grads)
        if not ctx.has_norm:
            dqw = dkw = None
        else:
            dqw, dkw = dqw.to(qw.dtype), dkw.to(kw.dtype)
        return dqkv, dqw, dkw, None, None, None, None, None


def qk_norm_rope(
    qkv_BTND: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos_BTP: torch.Tensor,
    sin_BTP: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split packed ``(B, T, H + 2K, Dh)`` projections into ``q (B, H, T, Dh)``, ``k``, ``v``
    ``(B, K, T, Dh)``, RMS-normalising q and k heads (weights ``None`` = no QK-norm) and rotating
    them by the half-split RoPE tables ``(B, T, Dh/2)``."""
    return _apply(_QKNormRoPE, qkv_BTND, q_weight, k_weight, cos_BTP, sin_BTP, n_heads, n_kv_heads, eps)


class _RouteTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, mask, k, sigmoid, norm, scale):  # noqa: D102
        logits = logits.contiguous()
        mask_t = mask.contiguous() if mask is not None else torch.empty(0, dtype=torch.bool)
        ids, gates, counts = kernels().route_topk_fwd(
            logits, bias.float().contiguous(), mask_t, k, sigmoid, norm, scale
        )
        ctx.save_for_backward(logits, mask_t, ids)
        ctx.flags = (sigmoid, norm, scale)
        ctx.mark_non_differentiable(ids, counts)
        return ids, gates, counts

    @staticmethod
    def backward(ctx, _d_ids, d_gates, _d_counts):  # noqa: D102
        logits, mask_t, ids = ctx.saved_tensors
        d_logits = kernels().route_topk_bwd(logits, mask_t, ids, d_gates.float().contiguous(), *ctx.flags)
        return d_logits, None, None, None, None, None, None


def route_topk(
    logits_NE: torch.Tensor,
    bias_E: torch.Tensor,
    mask_E: torch.Tensor | None,
    k: int,
    sigmoid: bool,
    norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router scores, biased top-k selection and gates in one pass over fp32 ``logits (N, E)``.

    Returns ``(expert_ids (N, k) int64, gates (N, k) fp32, counts (E,) int64)``; only the gates
    carry a gradient (to the logits). Unavailable experts (``mask_E`` False) are never selected
    and get no softmax mass; ties in the selection go to the lower expert index.
    """
    return _apply(_RouteTopK, logits_NE, bias_E, mask_E, k, sigmoid, norm, scale)


class _RouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):  # noqa: D102
        x, weight = x.contiguous(), weight.contiguous()
        ctx.save_for_backward(x, weight)
        return kernels().router_logits_fwd(x, weight)

    @staticmethod
    def backward(ctx, d_logits):  # noqa: D102
        x, weight = ctx.saved_tensors
        dx, dw = kernels().router_logits_bwd(d_logits.float().contiguous(), x, weight)
        return dx, dw


def expert_gemm_fusable(x_ND: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> bool:
    """Whether the padding-skipping expert GEMMs (``cpu_expert_gemm.cpp``) can take these: bf16
    on CPU, an AVX512-BF16 build, and even ``d_model`` and ``d_expert`` that are multiples of 16."""
    if x_ND.dtype != torch.bfloat16 or not fusable(x_ND, w13_EFD, w2_EDF):
        return False
    if not kernels().expert_gemm_available():
        return False
    d, f = w2_EDF.shape[1], w2_EDF.shape[2]
    return d % 16 == 0 and f % 16 == 0


def attend_f32_fusable(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor) -> bool:
    """Whether ``attend_f32`` (fp32 inference attention of ``cpu_infer_f32.cpp``) can take these:
    fp32 on CPU, no gradient needed, an AVX-512 build, at least as many keys as queries and
    :func:`_attention_layout_ok`."""
    if q_BHTD.dtype != torch.float32 or needs_grad(q_BHTD, k_BKSD, v_BKSD):
        return False
    if not fusable(q_BHTD, k_BKSD, v_BKSD) or not kernels().infer_f32_available():
        return False
    return _attention_layout_ok(q_BHTD, k_BKSD, v_BKSD) and k_BKSD.shape[2] >= q_BHTD.shape[2]


def attend_f32(
    q_BHTD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    allowed_B1TS: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """fp32 inference attention, ``(B, H, T, Dh)``: exact softmax over whole key rows, keys
    transposed once per kv head so that scores need no horizontal sums."""
    mask = allowed_B1TS.contiguous() if allowed_B1TS is not None else NO_MASK
    q_BHTD = q_BHTD.contiguous()
    return kernels().attend_f32(q_BHTD, k_BKSD, v_BKSD, mask, causal).permute(0, 2, 1, 3)


def expert_infer_fusable(x_ND: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> bool:
    """Whether the fp32 inference experts (``cpu_infer_f32.cpp``) can take these: fp32, and what the
    decoding experts need (:func:`experts_rows_fusable`: no gradient, as they have no backward;
    CPU; ``d_model`` and ``d_expert`` multiples of 16)."""
    return (
        x_ND.dtype == torch.float32
        and experts_rows_fusable(x_ND, w13_EFD, w2_EDF)
        and kernels().infer_f32_available()
    )


def router_fusable(x_ND: torch.Tensor, weight_ED: torch.Tensor) -> bool:
    """Whether :func:`router_logits` can take these: :func:`fusable`, an AVX-512F build, ``d_model`` a
    multiple of 64 and a multiple of 16 experts, at most 128."""
    if not fusable(x_ND, weight_ED) or not kernels().router_linear_available():
        return False
    (e, d) = weight_ED.shape
    return x_ND.dim() == 2 and d % 64 == 0 and e % 16 == 0 and e <= 128


def router_logits(x_ND: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """fp32 router logits ``x @ weight^T`` (fp32 products and sums), as ``F.linear(x.float(),
    weight.float())`` with its gradients (``dx`` in ``x``'s dtype, ``dw`` in ``weight``'s), without
    the fp32 copies or the fp32 GEMM library, which is slow at this skinny shape."""
    return _apply(_RouterLogits, x_ND, weight_ED)
