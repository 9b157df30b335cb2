"""The text head's cross-entropy, fused and chunked: :class:`FastTextHead`.

Same function as :meth:`ernie5.model.head.TextHead.linear_cross_entropy` (fp32 logits and
``F.cross_entropy``), computed as one GEMM for the logits in the compute dtype and then, per chunk
of rows, the fp32 log-sum-exp, the NLL and the logit gradient ``w_i / sum(w) * (softmax - onehot)``
written back over the logits; the backward is two GEMMs (``dH = G W``, ``dW = G^T H``) scaled by
the incoming gradient. The fp32 softmax never exists for the whole batch at once. On CPU each
chunk is one pass of the ``ce_rows`` kernel; :func:`_chunked_nll_eager` is its PyTorch form.

The gradient is computed during the forward, so the fused path is taken only when a gradient will
be needed (grad mode on and the inputs require grad); otherwise only the NLL rows are computed.

References:
  * Liger-Kernel fused linear cross-entropy (arXiv 2410.10989) and Apple's Cut Cross-Entropy
    (arXiv 2411.09009): compute the loss gradient chunk-wise instead of materialising fp32 logits.

Deviations:
  1. Unlike Cut Cross-Entropy, the logits of one batch are materialised once in the compute dtype;
     only the fp32 softmax work is chunked. At this vocabulary size one large GEMM is faster on
     CPU than per-chunk GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ernie5.kernels import kernels, ops
from ernie5.model.head import TextHead, row_weights
from ernie5.model.inputs import IGNORE

CHUNK_ROWS = 128
"""Rows per fp32 softmax chunk (128 x 4096 fp32 = 2 MB, within one core's L2)."""


def _chunked_nll(logits_NV: torch.Tensor, targets_N: torch.Tensor, grad_scale_N: torch.Tensor | None):
    """fp32 NLL per row; with ``grad_scale_N``, overwrite the logits with ``scale * dCE/dlogits``.
    On CPU one fused kernel pass per row; :func:`_chunked_nll_eager` otherwise."""
    if logits_NV.is_contiguous() and ops.fusable(logits_NV):
        scale = grad_scale_N.float().contiguous() if grad_scale_N is not None else torch.empty(0)
        return kernels().ce_rows(logits_NV, targets_N.long().contiguous(), scale)
    return _chunked_nll_eager(logits_NV, targets_N, grad_scale_N)


def _chunked_nll_eager(logits_NV: torch.Tensor, targets_N: torch.Tensor, grad_scale_N: torch.Tensor | None):
    """:func:`_chunked_nll` in PyTorch ops, ``CHUNK_ROWS`` rows of fp32 softmax at a time."""
    n = logits_NV.shape[0]
    nll_N = torch.zeros(n, dtype=torch.float32, device=logits_NV.device)
    tgt_N = targets_N.clamp_min(0)
    valid_N = targets_N != IGNORE
    for s in range(0, n, CHUNK_ROWS):
        e = min(n, s + CHUNK_ROWS)
        lf = logits_NV[s:e].float()
        picked = lf.gather(1, tgt_N[s:e, None]).squeeze(1)
        mx = lf.amax(dim=-1, keepdim=True)
        p = lf.sub_(mx).exp_()  # one exp pass serves the log-sum-exp and the softmax
        total = p.sum(dim=-1, keepdim=True)
        lse = (mx + total.log()).squeeze(1)
        nll_N[s:e] = torch.where(valid_N[s:e], lse - picked, 0.0)
        if grad_scale_N is not None:
            scale = grad_scale_N[s:e, None]
            p.mul_(scale / total)
            rows = torch.arange(e - s, device=p.device)
            p[rows, tgt_N[s:e]] -= scale.squeeze(1)
            logits_NV[s:e].copy_(p)
    return nll_N


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, weight_VD, targets_N, w_N):  # noqa: D102
        den = w_N.sum().clamp_min(1.0)
        g_NV = F.linear(h_ND, weight_VD)  # becomes the logit gradient in place
        nll_N = _chunked_nll(g_NV, targets_N, w_N / den)
        loss = (nll_N * w_N).sum() / den
        ctx.save_for_backward(h_ND, weight_VD, g_NV)
        ctx.mark_non_differentiable(nll_N)
        return loss, nll_N

    @staticmethod
    def backward(ctx, d_loss, _d_nll):  # noqa: D102
        h_ND, weight_VD, g_NV = ctx.saved_tensors
        dt = g_NV.dtype  # under autocast the logits are bf16 while h and W stay fp32
        scale = d_loss.to(dt)
        d_h = d_w = None
        if ctx.needs_input_grad[0]:
            d_h = (g_NV @ weight_VD.to(dt)).mul_(scale).to(h_ND.dtype)
        if ctx.needs_input_grad[1]:
            d_w = (g_NV.t() @ h_ND.to(dt)).mul_(scale).to(weight_VD.dtype)
        return d_h, d_w, None, None


def linear_cross_entropy(
    h_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, weights_N: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean NLL of ``h @ W^T`` against ``targets`` and the per-row NLL (fp32)."""
    w_N = row_weights(targets_N, weights_N)
    if torch.is_grad_enabled() and (h_ND.requires_grad or weight_VD.requires_grad):
        return _FusedLinearCE.apply(h_ND, weight_VD, targets_N, w_N)
    with torch.no_grad():
        nll_N = _chunked_nll(F.linear(h_ND, weight_VD), targets_N, None)
    return (nll_N * w_N).sum() / w_N.sum().clamp_min(1.0), nll_N


class FastTextHead(TextHead):
    """:class:`~ernie5.model.head.TextHead` with the fused loss and the few-row decoding product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return ops.linear(x, self.weight)

    def linear_cross_entropy(  # noqa: D102
        self, h_ND: torch.Tensor, targets_N: torch.Tensor, weights_N: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return linear_cross_entropy(h_ND, self.weight, targets_N, weights_N)
