"""Mixture-of-experts FFN with modality-agnostic routing and auxiliary-loss-free balancing.

One router and one pool of fine-grained routed experts serve every token, whatever its modality:
the router sees only the hidden state, and no modality id enters routing anywhere. Optional
shared experts run on every token.

Steps of one forward (token-choice, dropless):
  1. ``logits = x @ W_router^T`` in fp32 (under autocast too); experts excluded by the subnet get
     ``-inf`` (softmax) or a zero score (sigmoid) *before* anything else, so the weights
     renormalise over what is left.
  2. Scores are softmax or sigmoid of the logits. Selection uses ``scores + bias``, where ``bias`` is
     the aux-free balancing buffer; the gate values use the un-biased scores.
  3. Top-k on the selection scores; gates are the selected scores, renormalised to sum to one
     (``norm_topk``) and multiplied by ``route_scale``.
  4. Expert compute: every (token, slot) pair is processed by its expert; nothing is dropped.
  5. Routing statistics (tokens per expert) and optional balance / z losses are returned with the
     output; the layer logs nothing and never updates its own bias (the trainer calls
     :func:`update_router_bias`).
On CPU, step 1 (fp32 sums of the bf16 products, without fp32 copies), steps 2-3 with the counts,
the dispatch into padded levels and the SwiGLU activation each run as one fused kernel
(:mod:`ernie5.kernels`; the eager code below is the fallback and the parity reference); runs with
a balance or z loss keep the eager steps 2-3, which they need.

Expert compute paths (identical semantics, chosen by ``dispatch``):
  * ``loop``: the naive reference, one SwiGLU call per expert on the rows routed to it.
  * ``sorted``: pairs are sorted by expert into padded ``(E, C, D)`` levels and each projection
    runs as ONE batched GEMM per level with the weight as the left operand (``W @ X^T``), which
    lets oneDNN reuse the weight without repacking it per call. Level 1 covers the first ``C_1``
    rows of every expert, level 2 the next rows of the experts that have more, and so on (at most
    three levels, chosen by a measured cost model: :func:`plan_levels`). No row is dropped.
    Padded row counts are multiples of 16 and subset expert counts multiples of
    4, so GEMM shapes recur across steps and oneDNN reuses its JIT kernels. In bf16 on a CPU with
    AVX512-BF16 the six GEMMs are instead the kernels of ``ernie5/kernels/cpu_expert_gemm.cpp``,
    which compute only each expert's routed rows: padding then costs memory, not arithmetic, so
    the plan is a single level as deep as the busiest expert (:func:`plan_dispatch`). In fp32
    without gradients (evaluation, prefill) on a CPU with AVX-512, the whole expert forward is one
    kernel over exactly the routed rows (``cpu_infer_f32.cpp``), with no level search and no
    gathered weights: a nano 1 x 512 prefill went 3.8k -> 5.9k tok/s.
  * ``grouped``: pairs are sorted by expert and each projection runs as ONE grouped GEMM over the
    ragged per-expert groups (``torch._grouped_mm`` with cumulative row offsets; autograd gives the
    backward): no padding, no host synchronisation, a fixed handful of kernels. What ``auto``
    runs in bf16 on a CUDA device (:func:`batch_dispatch` has the measurements).
  * ``gather``: for a handful of pairs (decoding) the selected experts' weights are gathered and
    multiplied per pair; used automatically at inference when ``n_pairs <= 16``.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.1, §3.2, §6.4.1: one router and one expert
    pool for all modalities; aux-loss-free balancing with bias speed 1e-4 -> 1e-5; no token dropping.
  * DeepSeek-V3 (arXiv 2412.19437) §2.1.2 and Wang et al. 2024 (arXiv 2408.15664): selection-only
    bias ``b_i += gamma * sign(mean_load - load_i)``; sequence-wise balance loss.
  * ST-MoE (arXiv 2202.08906): router z-loss. DeepSeekMoE (arXiv 2401.06066): shared experts.
  * ERNIE 4.5 router (transformers ``ernie4_5_moe``): softmax + correction bias for selection,
    renormalised top-k gates.

Deviations:
  1. The report does not disclose the score function, gate normalisation or shared-expert count;
     all three are config options (defaults: softmax, renormalised, 0 shared at the nano shape).
  2. The bias update is applied by the trainer once per optimizer step from the summed loads of the
     step's micro-batches, counting only experts the subnet left available (masked experts neither
     count towards the mean nor move their bias).
  3. Aux and z losses are optional safety nets (off by default); the report uses neither.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ernie5.kernels import kernels, ops
from ernie5.model.config import MoEConfig
from ernie5.model.linear import Linear

GATHER_MAX_PAIRS = 16
"""At inference, at most this many (token, slot) pairs use the weight-gather path."""
MAX_LEVELS = 3
"""Most padded batched GEMM levels one dispatch plan may use."""

# Cost model of a padded level, in units of one padded (expert, row) slot, fitted to the
# batched-GEMM timings of `ernie5 bench moe` on this CPU (bf16, d_model 256, d_expert 256): the six
# GEMMs of a level's forward + backward cost about 45 us per expert (streaming its weights and
# writing its weight gradient, whatever the row count) plus 0.6 us per padded row of that expert,
# so an expert in a level costs as much as ~75 padded rows. A level over a subset of the experts
# also gathers their weights and scatters their gradients (~65 rows each), and every level adds a
# fixed dozen of small ops (~250 rows).
COST_PER_EXPERT = 75
COST_PER_GATHERED_EXPERT = 65
COST_PER_LEVEL = 250


@dataclass
class RouterOutput:
    """What routing decided for ``N`` tokens with ``A`` active experts each."""

    expert_ids_NA: torch.Tensor
    gates_NA: torch.Tensor
    counts_E: torch.Tensor
    """Routed (token, slot) pairs per expert, int64, over the full expert dimension."""
    aux_loss: torch.Tensor | None
    z_loss: torch.Tensor | None


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Reference SwiGLU expert: ``w13 (2F, D)``, ``w2 (D, F)``; ``x (N, D) -> (N, D)``."""
    g, u = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, w2)


def route(
    x_ND: torch.Tensor,
    weight_ED: torch.Tensor,
    bias_E: torch.Tensor,
    cfg: MoEConfig,
    top_k: int,
    expert_mask_E: torch.Tensor | None,
    seq_len: int,
) -> RouterOutput:
    """Token-choice top-k routing. ``seq_len`` groups rows into sequences for the balance loss."""
    with torch.autocast(x_ND.device.type, enabled=False):  # fp32 logits under autocast too
        if ops.router_fusable(x_ND, weight_ED):
            logits_NE = ops.router_logits(x_ND, weight_ED)
        else:
            logits_NE = F.linear(x_ND.float(), weight_ED.float())
    needs_scores = torch.is_grad_enabled() and (cfg.aux_loss_coef > 0 or cfg.z_loss_coef > 0)
    if not needs_scores and ops.fusable(logits_NE):  # steps 2-3 and the counts in one pass
        ids, gates, counts = ops.route_topk(
            logits_NE,
            bias_E,
            expert_mask_E,
            top_k,
            cfg.score_func == "sigmoid",
            cfg.norm_topk,
            cfg.route_scale,
        )
        return RouterOutput(ids, gates, counts, None, None)
    if cfg.score_func == "softmax":
        if expert_mask_E is not None:
            logits_NE = logits_NE.masked_fill(~expert_mask_E, float("-inf"))
        scores_NE = logits_NE.softmax(dim=-1)
    else:
        scores_NE = logits_NE.sigmoid()
        if expert_mask_E is not None:
            scores_NE = scores_NE.masked_fill(~expert_mask_E, 0.0)
    select_NE = scores_NE.detach() + bias_E
    if expert_mask_E is not None:
        select_NE = select_NE.masked_fill(~expert_mask_E, float("-inf"))
    expert_ids_NA = select_NE.topk(top_k, dim=-1, sorted=False).indices
    gates_NA = scores_NE.gather(-1, expert_ids_NA)
    if cfg.norm_topk:
        gates_NA = gates_NA / gates_NA.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    if cfg.route_scale != 1.0:
        gates_NA = gates_NA * cfg.route_scale
    # Not bincount: on CUDA it reads the ids' range back to the host, a sync per layer and token.
    flat_ids = expert_ids_NA.reshape(-1)
    counts_E = torch.zeros(logits_NE.shape[-1], dtype=torch.long, device=flat_ids.device)
    counts_E.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))

    aux_loss = z_loss = None
    if cfg.aux_loss_coef > 0 and torch.is_grad_enabled():
        # DeepSeek-V3 sequence-wise balance loss: alpha * sum_i f_i * P_i, averaged over sequences.
        n_seq = x_ND.shape[0] // seq_len
        n_avail = int(expert_mask_E.sum()) if expert_mask_E is not None else logits_NE.shape[-1]
        norm_NE = scores_NE / scores_NE.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        p_SE = norm_NE.view(n_seq, seq_len, -1).mean(dim=1)
        hits_NE = torch.zeros_like(scores_NE).scatter_(-1, expert_ids_NA, 1.0)
        f_SE = hits_NE.view(n_seq, seq_len, -1).sum(dim=1) * (n_avail / (top_k * seq_len))
        aux_loss = cfg.aux_loss_coef * (f_SE * p_SE).sum(dim=-1).mean()
    if cfg.z_loss_coef > 0 and torch.is_grad_enabled():
        finite_NE = logits_NE.masked_fill(~torch.isfinite(logits_NE), float("-inf"))
        z_loss = cfg.z_loss_coef * torch.logsumexp(finite_NE, dim=-1).square().mean()
    return RouterOutput(expert_ids_NA, gates_NA, counts_E, aux_loss, z_loss)


def experts_loop(
    x_ND: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, r: RouterOutput
) -> torch.Tensor:
    """Naive reference: one SwiGLU call per expert on the rows routed to it."""
    y_ND = torch.zeros_like(x_ND)
    for e in torch.nonzero(r.counts_E).flatten().tolist():
        tok, slot = torch.where(r.expert_ids_NA == e)
        out = swiglu(x_ND[tok], w13_EFD[e], w2_EDF[e])
        y_ND.index_add_(0, tok, out * r.gates_NA[tok, slot, None].to(out.dtype))
    return y_ND


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
    the device (the counts reach the GEMM as offsets on the device) and the gate multiplies the
    activation before the down projection, as in :class:`_GroupedSwiGLU`.
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


def _round_rows(rows: int) -> int:
    """Padded GEMM row counts: exact up to 8, then multiples of 16.

    oneDNN JIT-compiles a kernel per new GEMM shape; with exact capacities every training step
    brought new shapes, and the kernel generation (and the fresh code pages it faults in) cost
    about a quarter of a nano training step. Quantised shapes recur, so its primitive cache hits.
    On a 2-core Zen 5 (AVX512-BF16, no AMX) the six batched expert GEMMs of a nano layer cost
    9.7 / 11.3 / 13.5 / 14.5 / 17.1 ms at 64 / 80 / 96 / 112 / 128 rows (alternating medians), and
    the isolated layer (`ernie5 bench moe`, settled routing) went 23-27 -> 15.4-15.7 ms against
    multiples of 32 above 64; on a 2-core Xeon with AMX, where 80 and 112 rows ran slower than 96
    and 128, the two roundings were within 0.5 ms of each other.
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
    def forward(ctx, x_ND, gates_P, w13_EFD, w2_EDF, plan):  # noqa: D102
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
        ctx.plan, ctx.saved, ctx.fused = plan, saved, fused
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
                if len(ctx.plan.levels) == 1 and lv.experts is None:  # these are the whole gradients
                    ops.record_grad_sumsq(w13_EFD, d_w13, sq_w13)
                    ops.record_grad_sumsq(w2_EDF, d_w2, sq_w2)
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
        return dx, dg_pad[:n_pairs].to(gate_dtype), dw13, dw2, None


def experts_sorted(
    x_ND: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, r: RouterOutput
) -> torch.Tensor:
    """Sort pairs by expert, run padded batched GEMMs (capacity + overflow), combine back. In fp32
    without gradients (evaluation, prefill) on CPU, the experts run over exactly their routed rows
    instead (``cpu_infer_f32.cpp``): no padding, no level search, no gathered weights."""
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
    return _GroupedSwiGLU.apply(x_ND, r.gates_NA.reshape(-1), w13_EFD, w2_EDF, plan)


class SwiGLU(nn.Module):
    """Dense SwiGLU FFN (dense layers, shared experts, the MTP block)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w13 = Linear(d_model, 2 * d_ff)
        self.w2 = Linear(d_ff, d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        g, u = self.w13(x_BTD).chunk(2, dim=-1)
        return self.w2(F.silu(g) * u)


class MoE(nn.Module):
    """Routed experts (+ optional shared experts) behind one modality-agnostic router."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, f = cfg.n_experts, cfg.d_expert
        self.router = nn.Linear(d_model, e, bias=False)
        self.register_buffer("router_bias", torch.zeros(e, dtype=torch.float32))
        self.w13 = nn.Parameter(torch.empty(e, 2 * f, d_model))
        self.w2 = nn.Parameter(torch.empty(e, d_model, f))
        self.shared = SwiGLU(d_model, cfg.n_shared_experts * f) if cfg.n_shared_experts else None

    def forward(
        self,
        x_BTD: torch.Tensor,
        top_k: int | None = None,
        expert_mask_E: torch.Tensor | None = None,
        dispatch: str | None = None,
    ) -> tuple[torch.Tensor, RouterOutput]:
        """Mix routed experts for every token.

        Args:
            x_BTD: hidden states.
            top_k: active experts per token (``None`` = the configured default).
            expert_mask_E: bool mask of the routed experts available (``None`` = all).
            dispatch: override of ``cfg.dispatch`` (``loop`` | ``sorted`` | ``grouped`` | ``gather``).

        Returns:
            ``(y_BTD, router_output)``.
        """
        b, t, d = x_BTD.shape
        x_ND = x_BTD.reshape(b * t, d)
        k = top_k or self.cfg.top_k
        r = route(x_ND, self.router.weight, self.router_bias, self.cfg, k, expert_mask_E, t)
        dev = x_ND.device.type
        autocast = torch.is_autocast_enabled(dev)
        dt = torch.get_autocast_dtype(dev) if autocast else x_ND.dtype  # the experts' compute dtype
        path = self.expert_path(x_ND, k, dt, dispatch)
        fn = {
            "loop": experts_loop,
            "sorted": experts_sorted,
            "grouped": experts_grouped,
            "gather": experts_gather,
        }[path]
        if autocast:
            # Cast once here and run the experts outside autocast, so the hand-written backward
            # sees one dtype (autocast is not active during backward).
            with torch.autocast(dev, enabled=False):
                y_ND = fn(x_ND.to(dt), self.w13.to(dt), self.w2.to(dt), r)
        else:
            y_ND = fn(x_ND, self.w13, self.w2, r)
        y_BTD = y_ND.view(b, t, d)
        if self.shared is not None:
            y_BTD = y_BTD + self.shared(x_BTD)
        return y_BTD, r

    def expert_path(self, x_ND: torch.Tensor, k: int, dtype: torch.dtype, dispatch: str | None = None) -> str:
        """The expert path :meth:`forward` takes for these rows at top-``k`` in compute ``dtype``:
        ``dispatch``, else ``cfg.dispatch``, where ``auto`` is decided by :meth:`_auto_dispatch`."""
        path = dispatch or self.cfg.dispatch
        return self._auto_dispatch(x_ND, k, dtype) if path == "auto" else path

    def _auto_dispatch(self, x_ND: torch.Tensor, k: int, dtype: torch.dtype | None = None) -> str:
        # The gather path wins for a few pairs at inference; otherwise see `batch_dispatch`.
        if not torch.is_grad_enabled() and x_ND.shape[0] * k <= GATHER_MAX_PAIRS:
            return "gather"
        return batch_dispatch(x_ND.device, dtype or x_ND.dtype)


def batch_dispatch(device: torch.device | str, dtype: torch.dtype) -> str:
    """The expert path ``auto`` takes for more than a handful of pairs, by device and compute dtype,
    as measured by ``ernie5 bench moe`` (nano layer, forward + backward, random-init router; ms of
    ``sorted`` / ``grouped`` / ``loop``):

    * CPU, 2048 tokens (2-core Zen 4, alternating medians): bf16 20.1 / 40.6 / 322, fp32 60.0 /
      70.3 / 373: ``sorted`` (its bf16 GEMMs are the padding-skipping kernels of
      ``cpu_expert_gemm.cpp``).
    * CUDA (one H200, torch 2.11): bf16 4.54 / 2.24 / 41.2 at 2048 tokens and 6.72 / 3.13 / 60.0 at
      65536: ``grouped``. fp32 3.84 / 7.38 / 39.0 and 10.4 / 10.6 / 39.6 (``_grouped_mm`` has no
      fp32 tensor-core kernel there): ``sorted``.
    """
    if torch.device(device).type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return "grouped"
    return "sorted"


@torch.no_grad()
def update_router_bias(moe: MoE, counts_E: torch.Tensor, speed: float, avail_E: torch.Tensor) -> None:
    """Aux-loss-free balancing step: ``b_i += speed * sign(mean_load - load_i)`` over available experts.

    Args:
        moe: the layer whose ``router_bias`` moves.
        counts_E: routed pairs per expert summed over the optimizer step.
        speed: the update speed gamma.
        avail_E: bool mask of experts that were available in routing this step (masked experts
            neither count towards the mean nor move).
    """
    if speed <= 0 or not bool(avail_E.any()):
        return
    load = counts_E.float()
    mean = load[avail_E].mean()
    step = speed * torch.sign(mean - load)
    moe.router_bias.add_(torch.where(avail_E, step, torch.zeros_like(step)))
