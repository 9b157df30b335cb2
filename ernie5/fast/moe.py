"""Fast MoE: the fused router and the expert paths, applied to :class:`ernie5.model.moe.MoE`.

:class:`FastMoE` keeps the model's MoE layer (same parameters, same function) and replaces
:meth:`~ernie5.model.moe.MoE.route` and :meth:`~ernie5.model.moe.MoE.experts`:

* ``route``: on CPU, the fp32 router logits from bf16 activations without fp32 copies
  (``router_logits``), and scores, biased top-k, gates and counts in one pass (``route_topk``);
  runs with a balance or z loss keep the eager scores, which they need, and so do routing replays
  (forced expert ids, the reference :func:`~ernie5.model.moe.select_experts`).
* ``experts``, one of four paths with the semantics of the reference loop:

  - ``sorted``: padded batched GEMMs (:mod:`ernie5.fast.moe_levels`); what ``auto`` trains with on
    CPU, and runs in fp32 on CUDA;
  - ``grouped``: pairs sorted by expert and each projection ONE grouped GEMM over the ragged
    per-expert groups (``torch._grouped_mm``; autograd gives the backward): no padding, no host
    synchronisation; what ``auto`` runs for bf16 on CUDA;
  - ``gather``: for a handful of pairs at inference (decoding) each pair's row through its
    expert's weights (``expert_rows`` on CPU reads them in place);
  - ``loop``: the model's reference itself.

Under autocast the activations and weights are cast to the compute dtype once and the experts run
outside autocast, so the hand-written backward of ``sorted`` sees one dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ernie5.fast.grad_squares import GradSquares
from ernie5.fast.moe_levels import experts_sorted
from ernie5.kernels import kernels, ops
from ernie5.model.moe import MoE, RouterOutput, experts_loop, router_logits, select_experts

GATHER_MAX_PAIRS = 16
"""At inference, at most this many (token, slot) pairs use the ``gather`` path."""
PATHS = ("auto", "sorted", "grouped", "gather", "loop")


def experts_gather(
    x_ND: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, r: RouterOutput
) -> torch.Tensor:
    """Few pairs (decode): each pair's token row through its expert's weights. On CPU without a
    gradient, one ``expert_rows`` kernel (``cpu_decode.cpp``) reads the weights in place; else the
    selected experts' weights are gathered (copied) and multiplied per pair."""
    if ops.experts_rows_fusable(x_ND, w13_EFD, w2_EDF):
        return kernels().expert_rows(
            x_ND.contiguous(),
            r.expert_ids_NA.contiguous(),
            r.gates_NA.float().contiguous(),
            w13_EFD.contiguous(),
            w2_EDF.contiguous(),
        )
    n, a = r.expert_ids_NA.shape
    ids = r.expert_ids_NA.reshape(-1)
    x_P1D = x_ND.repeat_interleave(a, dim=0).unsqueeze(1)
    h = torch.bmm(x_P1D, w13_EFD[ids].transpose(1, 2))
    g, u = h.chunk(2, dim=-1)
    out_P1D = torch.bmm(F.silu(g) * u, w2_EDF[ids].transpose(1, 2))
    out_NAD = out_P1D.view(n, a, -1) * r.gates_NA.unsqueeze(-1).to(out_P1D.dtype)
    return out_NAD.sum(dim=1)


def experts_grouped(
    x_ND: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, r: RouterOutput
) -> torch.Tensor:
    """Sort pairs by expert; each projection is one grouped GEMM over the ragged expert groups.

    Every tensor shape depends only on ``N * A``, never on the routed counts, so nothing waits for
    the device (the counts reach the GEMM as offsets on the device); the gate multiplies the
    activation before the down projection, the same product.
    """
    n, a = r.expert_ids_NA.shape
    order_P = torch.argsort(r.expert_ids_NA.reshape(-1), stable=True)
    tok_P = order_P // a
    offs_E = torch.cumsum(r.counts_E, 0).to(torch.int32)
    h_PF = torch._grouped_mm(x_ND.index_select(0, tok_P), w13_EFD.transpose(1, 2), offs=offs_E)
    g_PF, u_PF = h_PF.chunk(2, dim=-1)
    gate_P1 = r.gates_NA.reshape(-1).index_select(0, order_P).unsqueeze(1).to(x_ND.dtype)
    y_PD = torch._grouped_mm(F.silu(g_PF) * u_PF * gate_P1, w2_EDF.transpose(1, 2), offs=offs_E)
    return torch.zeros_like(x_ND).index_add_(0, tok_P, y_PD)


def batch_dispatch(device: torch.device | str, dtype: torch.dtype) -> str:
    """The path ``auto`` takes for more than a handful of pairs, by device and compute dtype:
    ``grouped`` for bf16 on CUDA (no padding, no host sync; ``_grouped_mm`` has no fast fp32 kernel
    there), else ``sorted`` (on CPU its bf16 GEMMs skip the padding). ``ernie5 bench moe`` times
    both against the loop."""
    if torch.device(device).type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return "grouped"
    return "sorted"


class FastMoE(MoE):
    """The model's MoE layer with the fused router and a choice of expert paths.

    ``path`` (set by :func:`ernie5.fast.apply_fast_paths`) is one of :data:`PATHS`; ``auto``
    picks by the call (:meth:`expert_path`). ``grad_squares`` receives the sums of squares of the
    expert weight gradients that the fused backward computes (None: not recorded).
    """

    path: str = "auto"
    grad_squares: GradSquares | None = None

    def route(self, x_ND, top_k, expert_mask_E, seq_len, forced_ids_NA=None):  # noqa: D102
        with torch.autocast(x_ND.device.type, enabled=False):  # fp32 logits under autocast too
            if ops.router_fusable(x_ND, self.router.weight):
                logits_NE = ops.router_logits(x_ND, self.router.weight)
            else:
                logits_NE = router_logits(x_ND, self.router.weight)
        cfg = self.cfg
        needs_scores = torch.is_grad_enabled() and (cfg.aux_loss_coef > 0 or cfg.z_loss_coef > 0)
        if needs_scores or forced_ids_NA is not None or not ops.fusable(logits_NE):
            return select_experts(
                logits_NE, self.router_bias, cfg, top_k, expert_mask_E, seq_len, forced_ids_NA
            )
        ids, gates, counts = ops.route_topk(
            logits_NE,
            self.router_bias,
            expert_mask_E,
            top_k,
            cfg.score_func == "sigmoid",
            cfg.norm_topk,
            cfg.route_scale,
        )
        return RouterOutput(ids, gates, counts)

    def expert_path(self, x_ND: torch.Tensor, k: int, dtype: torch.dtype) -> str:
        """The path :meth:`experts` takes for these rows at top-``k`` in compute ``dtype``."""
        if self.path != "auto":
            return self.path
        if not torch.is_grad_enabled() and x_ND.shape[0] * k <= GATHER_MAX_PAIRS:
            return "gather"
        return batch_dispatch(x_ND.device, dtype)

    def experts(self, x_ND, r):  # noqa: D102
        dev = x_ND.device.type
        autocast = torch.is_autocast_enabled(dev)
        dt = torch.get_autocast_dtype(dev) if autocast else x_ND.dtype  # the experts' compute dtype
        path = self.expert_path(x_ND, r.expert_ids_NA.shape[1], dt)
        fn = {
            "sorted": self._sorted,
            "grouped": experts_grouped,
            "gather": experts_gather,
            "loop": experts_loop,
        }[path]
        if not autocast:
            return fn(x_ND, self.w13, self.w2, r)
        with torch.autocast(dev, enabled=False):
            return fn(x_ND.to(dt), self.w13.to(dt), self.w2.to(dt), r)

    def _sorted(self, x_ND, w13_EFD, w2_EDF, r):
        return experts_sorted(x_ND, w13_EFD, w2_EDF, r, self.grad_squares)
