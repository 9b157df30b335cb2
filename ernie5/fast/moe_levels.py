"""The ``sorted`` expert path: (token, slot) pairs sorted by expert into padded levels.

Each projection of a level runs as ONE batched GEMM over ``(E, C, D)`` rows with the weight as the
left operand (``W @ X^T``), which lets oneDNN reuse the weight without repacking it per call.
Level 1 covers the first ``C_1`` rows of every expert, level 2 the next rows of the experts that
have more, and so on (at most :data:`MAX_LEVELS` levels, chosen by a cost model:
:func:`plan_levels`). No row is dropped. Padded row counts are multiples of 16 and subset expert
counts multiples of 4, so GEMM shapes recur across steps and oneDNN reuses its JIT kernels.

On CPU the index work, the gathers into the levels, the gated activation and the combine back
are fused kernels (``ernie5.kernels``); in bf16 with AVX512-BF16 the six GEMMs are instead the
kernels of ``cpu_expert_gemm.cpp``, which compute only each expert's routed rows, so the plan is
a single level as deep as the busiest expert. In fp32 without gradients (evaluation, prefill) the
whole expert forward is one kernel over exactly the routed rows (``cpu_infer_f32.cpp``). The
eager lines are the fallback; :func:`ernie5.model.moe.experts_loop` is the reference of all of
them (``tests/fast/test_moe.py``).

References:
  * MegaBlocks (arXiv 2211.15841): dropless MoE as block-sparse / grouped products.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ernie5.fast.grad_squares import GradSquares
from ernie5.kernels import kernels, ops
from ernie5.model.moe import RouterOutput

MAX_LEVELS = 3
"""Most padded batched GEMM levels one dispatch plan may use."""

# Cost model of a padded level, in units of one padded (expert, row) slot, fitted to the
# batched-GEMM timings of `ernie5 bench moe` (bf16, d_model 256, d_expert 256): the six GEMMs of a
# level's forward + backward cost about as much per expert (streaming its weights and writing its
# weight gradient, whatever the row count) as ~75 padded rows of that expert. A level over a subset
# of the experts also gathers their weights and scatters their gradients (~65 rows each), and
# every level adds a fixed dozen of small ops (~250 rows).
COST_PER_EXPERT = 75
COST_PER_GATHERED_EXPERT = 65
COST_PER_LEVEL = 250


def _round_rows(rows: int) -> int:
    """Padded GEMM row counts: exact up to 8, then multiples of 16.

    oneDNN JIT-compiles a kernel per new GEMM shape; with exact capacities every training step
    brought new shapes, and generating those kernels cost a large share of a step. Quantised
    shapes recur, so its primitive cache hits; multiples of 16 suit the AVX-512 tiles.
    """
    if rows <= 8:
        return rows
    return -(-rows // 16) * 16


def _round_experts(n: int) -> int:
    """Expert counts of subset levels are rounded up to a multiple of 4 (same reason as rows)."""
    return -(-n // 4) * 4


def plan_levels(counts: list[int]) -> list[tuple[int, bool]]:
    """Nested padded levels that cover every routed pair, cheapest under the cost model above.

    Level ``j`` holds rows ``[T_{j-1}, T_j)`` of every expert with more than ``T_{j-1}`` rows,
    with ``T_0 = 0`` and ``T_m >= max(counts)``. Returns ``[(T_j, uses_all_experts), ...]``: a
    level either runs the whole expert tensor (idle experts compute pad rows, nothing is gathered)
    or gathers just its experts (padded to a multiple of 4). Exhaustive over at most
    :data:`MAX_LEVELS` levels and the distinct rounded capacities, so a balanced layer gets one
    level and a skewed one (early training, narrow subnets) two or three.
    """
    n_exp = len(counts)
    loads = sorted(c for c in counts if c > 0)
    if not loads:
        return []

    @functools.cache
    def best(t: int, depth: int) -> tuple[float, tuple[tuple[int, bool], ...]]:
        n = len(loads) - bisect.bisect_right(loads, t)
        if n == 0:
            return 0.0, ()
        caps = sorted({_round_rows(c - t) for c in loads[-n:]})
        if depth == MAX_LEVELS - 1:
            caps = caps[-1:]
        n_sub = min(_round_experts(n), n_exp)
        options = []
        for c in caps:
            rest_cost, rest = best(t + c, depth + 1)
            full = n_exp * (COST_PER_EXPERT + c)
            sub = n_sub * (COST_PER_EXPERT + COST_PER_GATHERED_EXPERT + c)
            options.append((COST_PER_LEVEL + min(full, sub) + rest_cost, ((t + c, full <= sub),) + rest))
        return min(options)

    return list(best(0, 0)[1])


@dataclass
class _Level:
    """One padded batched GEMM: ``experts`` (None = all) x ``cap`` rows each."""

    experts: torch.Tensor | None
    cap: int
    tok_EC: torch.Tensor
    """Token row of each slot; pad slots point at the zero row ``N``."""
    pair_EC: torch.Tensor
    """Index into the flattened (token, slot) gates; pad slots point at the dummy entry ``N*A``."""
    valid_E: torch.Tensor | None = None
    """Routed rows of each of the level's experts (the rest of its ``cap`` slots are padding), for
    the expert GEMMs that skip padding; None where the level runs through ``torch.bmm``."""

    def weights(self, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This level's expert weights (gathered for a subset level)."""
        if self.experts is None:
            return w13_EFD, w2_EDF
        return w13_EFD[self.experts], w2_EDF[self.experts]


@dataclass
class Dispatch:
    """Where every routed (token, slot) pair goes: the padded levels and the inverse map."""

    levels: list[_Level]
    slot_of_pair: torch.Tensor
    """``(N * A,)``: each pair's slot in the concatenation of the levels' ``rows x cap`` slots."""


def plan_dispatch(r: RouterOutput, n_tokens: int, skip_padding: bool = False) -> Dispatch:
    """Sort (token, slot) pairs by expert into the padded levels of :func:`plan_levels`.

    With ``skip_padding`` (the expert GEMMs of ``cpu_expert_gemm.cpp``, which compute only each
    expert's routed rows) padding costs memory but no arithmetic, so the plan is one level over all
    experts, as deep as the busiest one, and the level carries each expert's row count.
    Pure index arithmetic, no autograd; one pass of the fused CPU kernel where available.
    """
    counts = r.counts_E.tolist()
    if skip_padding and max(counts, default=0) > 0:
        plan = [(_round_rows(max(counts)), True)]
    else:
        plan = plan_levels(counts)
    if not ops.fusable(r.gates_NA):
        return _dispatch_eager(r, n_tokens, plan)
    n_exp = len(counts)
    los = [0] + [hi for hi, _ in plan[:-1]]
    rows = [
        n_exp if full else min(_round_experts(sum(c > lo for c in counts)), n_exp)
        for (_, full), lo in zip(plan, los)
    ]
    out = kernels().dispatch_levels(
        r.expert_ids_NA.reshape(-1).contiguous(),
        r.counts_E.contiguous(),
        n_tokens,
        [hi for hi, _ in plan],
        rows,
        [full for _, full in plan],
    )
    levels = [
        _Level(None if full else out[3 * i], hi - lo, out[3 * i + 1], out[3 * i + 2])
        for i, ((hi, full), lo) in enumerate(zip(plan, los))
    ]
    if skip_padding and levels:
        levels[0].valid_E = r.counts_E.to(torch.long).contiguous()
    return Dispatch(levels, out[-1])


def _dispatch_eager(r: RouterOutput, n_tokens: int, plan: list[tuple[int, bool]]) -> Dispatch:
    """:func:`plan_dispatch` in PyTorch ops (the reference of the fused kernel)."""
    a = r.expert_ids_NA.shape[1]
    device = r.expert_ids_NA.device
    flat_ids = r.expert_ids_NA.reshape(-1)
    n_exp = r.counts_E.numel()
    n_pairs = flat_ids.numel()
    order = torch.argsort(flat_ids, stable=True)
    starts_E = torch.cumsum(r.counts_E, 0) - r.counts_E
    expert_P = flat_ids[order]
    rank_P = torch.arange(n_pairs, device=device) - starts_E[expert_P]

    levels = []
    slot_of_pair = torch.empty(n_pairs, dtype=torch.long, device=device)
    lo = offset = 0
    for hi, all_experts in plan:
        cap = hi - lo
        mask = (rank_P >= lo) & (rank_P < hi)
        e_local = expert_P[mask]
        experts = None
        if not all_experts:
            busy = r.counts_E > lo
            experts = torch.nonzero(busy).flatten()
            n_pad = min(_round_experts(experts.numel()), n_exp) - experts.numel()
            if n_pad > 0:  # padding experts: idle in this level (their slots all point at the zero row)
                experts = torch.cat([experts, torch.nonzero(~busy).flatten()[:n_pad]])
            remap = torch.full((n_exp,), -1, dtype=torch.long, device=device)
            remap[experts] = torch.arange(experts.numel(), device=device)
            e_local = remap[e_local]
        rows = n_exp if experts is None else experts.numel()
        slot = e_local * cap + (rank_P[mask] - lo)
        tok_EC = torch.full((rows * cap,), n_tokens, dtype=torch.long, device=device)
        pair_EC = torch.full((rows * cap,), n_pairs, dtype=torch.long, device=device)
        tok_EC[slot] = order[mask] // a
        pair_EC[slot] = order[mask]
        slot_of_pair[order[mask]] = offset + slot
        levels.append(_Level(experts, cap, tok_EC, pair_EC))
        lo, offset = hi, offset + rows * cap
    return Dispatch(levels, slot_of_pair)


def _level_rows(src_ND: torch.Tensor, src_pad: torch.Tensor | None, lv: _Level, e: int) -> torch.Tensor:
    """The token rows of level ``lv`` as ``(E, C, D)``, pad slots zero: the fused gather from
    ``src_ND``, or (``src_pad`` given: ``src_ND`` with a zero row appended) the eager one."""
    d = src_ND.shape[1]
    if src_pad is None:
        return kernels().gather_rows(src_ND, lv.tok_EC).view(e, lv.cap, d)
    return src_pad.index_select(0, lv.tok_EC).view(e, lv.cap, d)


_ALL_SLOTS = torch.empty(0, dtype=torch.long)
"""The valid slot counts that mean "every slot" to the fused SwiGLU kernels."""


class _GroupedSwiGLU(torch.autograd.Function):
    """Gated SwiGLU experts over padded levels, with a hand-written backward.

    Weights are the left GEMM operand of the forward (``(E, 2F, D) @ (E, D, C)``): oneDNN then
    packs the small token operand rather than every expert's weight, which is what makes small-C
    batched GEMMs fast on CPU. The gate multiplies the activations before the down projection
    (``y = W2 (gate * a)``, the same product), so the combine is a plain sum over a token's pairs
    and the gate gradient is a reduction over the contiguous ``(E, F, C)`` activations rather than
    over the strided output. A subset level's gathered weights are kept from the forward for its backward,
    which accumulates that level's weight gradients in place (``index_add_``), so no full-size
    zero tensor is materialised per level.

    On CPU (:mod:`ernie5.kernels`) the activation ``silu(g) * u * gate`` and its backward (``d_h``
    and the gate gradient) are one fused kernel each, which keeps only ``h`` and recomputes
    ``silu`` in the backward; the gathers of token rows into the levels read the activations (or
    their gradients) directly, pad slots as zero rows, and the combine (of the outputs, and of the
    input gradients in the backward) sums each token's pairs through ``slot_of_pair`` in one pass,
    instead of a zero-filled buffer, a transposing copy and a scatter-add. In bf16 with
    AVX512-BF16 (``plan.levels[*].valid_E`` set), each level's forward is one kernel that runs every
    expert whole (its token rows read in place through ``tok_EC``, no gathered copy; up product,
    activation, down product, skipping pad slots) while its rows are in L2, and its backward
    another (five products and the activation's backward; ``d_h`` never leaves the thread's
    scratch): ``cpu_expert_gemm.cpp``. The eager lines are the fallback and the parity reference.
    """

    @staticmethod
    def forward(ctx, x_ND, gates_P, w13_EFD, w2_EDF, plan, grad_squares):  # noqa: D102
        n, d = x_ND.shape
        fused = ops.fusable(x_ND, w13_EFD, w2_EDF) and bool(plan.levels)
        g_pad = torch.cat([gates_P.to(x_ND.dtype), gates_P.new_zeros(1, dtype=x_ND.dtype)])
        if fused:
            x_ND = x_ND.contiguous()
            y_levels = []
        else:
            x_pad = torch.cat([x_ND, x_ND.new_zeros(1, d)])
            y_pad = x_ND.new_zeros(n + 1, d)
        saved = []
        for lv in plan.levels:
            w13, w2 = lv.weights(w13_EFD, w2_EDF)
            e = w13.shape[0]
            n_E = lv.valid_E
            gate_E1C = g_pad.index_select(0, lv.pair_EC).view(e, 1, lv.cap)
            acts = None
            if n_E is not None:  # fused, bf16: whole experts in one pass that skips their pad slots
                x_ECD = x_ND  # its rows are read in place through lv.tok_EC, here and in the backward
                h_EFC, gated_EFC, y_ECD = kernels().expert_ffn_fwd(
                    w13, w2, x_ND, lv.tok_EC, gate_E1C.view(e, -1), n_E
                )
                y_levels.append(y_ECD)
            else:
                x_ECD = _level_rows(x_ND, None if fused else x_pad, lv, e)
                h_EFC = torch.bmm(w13, x_ECD.transpose(1, 2))
                if fused:  # silu(g) * u * gate in one pass; the backward recomputes silu from h
                    gated_EFC = kernels().swiglu_gate_fwd(h_EFC, gate_E1C, _ALL_SLOTS)
                    y_levels.append(torch.bmm(w2, gated_EFC))  # (E, D, C)
                else:
                    g, u = h_EFC.chunk(2, dim=1)
                    silu_EFC = F.silu(g)
                    act_EFC = silu_EFC * u
                    gated_EFC = act_EFC * gate_E1C
                    acts = (silu_EFC, act_EFC)
                    y_ECD = torch.bmm(w2, gated_EFC).transpose(1, 2)
                    y_pad.index_add_(0, lv.tok_EC, y_ECD.reshape(-1, d))
            sub = None if lv.experts is None else (w13, w2)  # gathered once, reused by the backward
            saved.append((x_ECD, h_EFC, gated_EFC, gate_E1C, acts, sub))
        ctx.plan, ctx.saved, ctx.fused, ctx.grad_squares = plan, saved, fused, grad_squares
        ctx.shapes = (n, d, gates_P.numel(), gates_P.dtype)
        ctx.save_for_backward(w13_EFD, w2_EDF)
        if fused:  # the expert kernels' outputs are token rows, bmm's are (E, D, C)
            return kernels().combine_rows(y_levels, plan.slot_of_pair, n, plan.levels[0].valid_E is None)
        return y_pad[:n]

    @staticmethod
    def backward(ctx, dy_ND):  # noqa: D102
        w13_EFD, w2_EDF = ctx.saved_tensors
        n, d, n_pairs, gate_dtype = ctx.shapes
        fused = ctx.fused
        if fused:
            dy_ND = dy_ND.contiguous()
            dx_levels = []
        else:
            dy_pad = torch.cat([dy_ND, dy_ND.new_zeros(1, d)])
            dx_pad = dy_ND.new_zeros(n + 1, d)
        dg_pad = torch.zeros(n_pairs + 1, dtype=torch.float32, device=dy_ND.device)
        dw13 = dw2 = None
        for lv, (x_ECD, h_EFC, gated_EFC, gate_E1C, acts, sub) in zip(ctx.plan.levels, ctx.saved):
            w13, w2 = sub or (w13_EFD, w2_EDF)
            e = w13.shape[0]
            n_E = lv.valid_E
            if n_E is not None:  # the five products and the activation's backward, expert by expert
                d_x, d_w13, sq_w13, d_w2, sq_w2, d_gate_EC = kernels().expert_ffn_bwd(
                    w13, w2, x_ECD, lv.tok_EC, h_EFC, gated_EFC, gate_E1C.view(e, -1), dy_ND, n_E
                )
                dg_pad.index_add_(0, lv.pair_EC, d_gate_EC.view(-1))
                whole = len(ctx.plan.levels) == 1 and lv.experts is None  # these are the whole gradients
                if whole and ctx.grad_squares is not None:
                    ctx.grad_squares.record(w13_EFD, d_w13, sq_w13)
                    ctx.grad_squares.record(w2_EDF, d_w2, sq_w2)
            else:
                dy_ECD = _level_rows(dy_ND, None if fused else dy_pad, lv, e)
                d_w2 = torch.bmm(dy_ECD.transpose(1, 2), gated_EFC.transpose(1, 2))
                d_gated = torch.bmm(w2.transpose(1, 2), dy_ECD.transpose(1, 2))
                if fused:
                    d_h, d_gate_EC = kernels().swiglu_gate_bwd(d_gated, h_EFC, gate_E1C, _ALL_SLOTS)
                    dg_pad.index_add_(0, lv.pair_EC, d_gate_EC.view(-1))
                else:
                    silu_EFC, act_EFC = acts
                    d_gate_N = (d_gated * act_EFC).sum(1, dtype=torch.float32).reshape(-1)
                    dg_pad.index_add_(0, lv.pair_EC, d_gate_N)
                    d_act = d_gated.mul_(gate_E1C)
                    g, u = h_EFC.chunk(2, dim=1)
                    d_h = torch.empty_like(h_EFC)
                    d_g, d_u = d_h.chunk(2, dim=1)
                    torch.ops.aten.silu_backward(d_act * u, g, grad_input=d_g)  # d/dg [silu(g) * u]
                    torch.mul(d_act, silu_EFC, out=d_u)
                d_w13 = torch.bmm(d_h, x_ECD)
                d_x = torch.bmm(d_h.transpose(1, 2), w13)  # (E, C, D), contiguous for the combine
            if fused:
                dx_levels.append(d_x)
            else:
                dx_pad.index_add_(0, lv.tok_EC, d_x.view(-1, d))
            if lv.experts is None:
                dw13 = d_w13 if dw13 is None else dw13 + d_w13
                dw2 = d_w2 if dw2 is None else dw2 + d_w2
            else:
                if dw13 is None:
                    dw13, dw2 = torch.zeros_like(w13_EFD), torch.zeros_like(w2_EDF)
                dw13.index_add_(0, lv.experts, d_w13)
                dw2.index_add_(0, lv.experts, d_w2)
        ctx.saved = None
        if fused:
            dx = kernels().combine_rows(dx_levels, ctx.plan.slot_of_pair, n, False)
        else:
            dx = dx_pad[:n]
        return dx, dg_pad[:n_pairs].to(gate_dtype), dw13, dw2, None, None


def experts_sorted(
    x_ND: torch.Tensor,
    w13_EFD: torch.Tensor,
    w2_EDF: torch.Tensor,
    r: RouterOutput,
    grad_squares: GradSquares | None = None,
) -> torch.Tensor:
    """Sort pairs by expert, run padded batched GEMMs (capacity + overflow), combine back. In fp32
    without gradients (evaluation, prefill) on CPU, the experts run over exactly their routed rows
    instead (``cpu_infer_f32.cpp``): no padding, no level search, no gathered weights.

    ``grad_squares`` receives the sums of squares of the expert weight gradients where the fused
    backward computes them."""
    n = x_ND.shape[0]
    if ops.expert_infer_fusable(x_ND, w13_EFD, w2_EDF):
        plan = plan_dispatch(r, n, skip_padding=True)
        if not plan.levels:  # nothing routed (every expert masked)
            return torch.zeros_like(x_ND)
        lv = plan.levels[0]
        gates_P = r.gates_NA.reshape(-1).to(x_ND.dtype).contiguous()
        w13_EFD, w2_EDF, x_ND = w13_EFD.contiguous(), w2_EDF.contiguous(), x_ND.contiguous()
        return kernels().expert_ffn_infer(w13_EFD, w2_EDF, x_ND, gates_P, lv.tok_EC, lv.pair_EC, lv.valid_E)
    plan = plan_dispatch(r, n, ops.expert_gemm_fusable(x_ND, w13_EFD, w2_EDF))
    return _GroupedSwiGLU.apply(x_ND, r.gates_NA.reshape(-1), w13_EFD, w2_EDF, plan, grad_squares)
