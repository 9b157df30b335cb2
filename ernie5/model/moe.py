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

Step 4 is written here as the naive loop, one SwiGLU call per expert on the rows routed to it: the
reference that every fast expert path (:mod:`ernie5.fast.moe`) is tested against.
:meth:`MoE.route` (steps 1-3, 5) and :meth:`MoE.experts` (step 4) are what a fast path replaces.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.1, §3.2, §6.4.1: one router and one expert
    pool for all modalities; aux-loss-free balancing with bias speed 1e-4 -> 1e-5; no token dropping.
  * DeepSeek-V3 (arXiv 2412.19437) §2.1.2 and Wang et al. 2024 (arXiv 2408.15664): selection-only
    bias ``b_i += gamma * sign(mean_load - load_i)``; sequence-wise balance loss.
  * ST-MoE (arXiv 2202.08906): router z-loss. DeepSeekMoE (arXiv 2401.06066): shared experts.
  * ERNIE 4.5 router (transformers ``ernie4_5_moe``): softmax + correction bias for selection,
    renormalised top-k gates.
  * Rollout Routing Replay, R3 (Ma et al. 2025, arXiv 2510.11370) and the ERNIE 5.0 report §5.4:
    an RL learner recomputes the rollout's log-probs with the expert selections the inference
    engine made, so the train/inference routing mismatch disappears.

Deviations:
  1. The report does not disclose the score function, gate normalisation or shared-expert count;
     all three are config options (defaults: softmax, renormalised, 0 shared at the nano shape).
  2. The bias update is applied by the trainer once per optimizer step from the summed loads of the
     step's micro-batches, counting only experts the subnet left available (masked experts neither
     count towards the mean nor move their bias).
  3. Aux and z losses are optional safety nets (off by default); the report uses neither.
  4. Routing replay (R3): ``forced_ids_NA`` (``(N, A)`` int64, ``A`` the top-k in force; rows of
     -1 are routed normally) replaces step 3's top-k in the rows it fills; the gates are still
     the CURRENT scores at those ids (subnet mask, renormalisation and ``route_scale`` as usual),
     so the router keeps its gradient, and ``counts_E`` and the balance loss count the forced
     selection. The bias plays no part in a forced row. A forced id out of range, repeated in
     its row, or masked out by the subnet is a ``ValueError``. Without replay nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ernie5.model.config import MoEConfig


@dataclass
class RouterOutput:
    """What routing decided for ``N`` tokens with ``A`` active experts each."""

    expert_ids_NA: torch.Tensor
    gates_NA: torch.Tensor
    counts_E: torch.Tensor
    """Routed (token, slot) pairs per expert, int64, over the full expert dimension."""
    aux_loss: torch.Tensor | None = None
    z_loss: torch.Tensor | None = None


def router_logits(x_ND: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """Step 1: fp32 router logits ``(N, E)``, under autocast too."""
    with torch.autocast(x_ND.device.type, enabled=False):
        return F.linear(x_ND.float(), weight_ED.float())


def select_experts(
    logits_NE: torch.Tensor,
    bias_E: torch.Tensor,
    cfg: MoEConfig,
    top_k: int,
    expert_mask_E: torch.Tensor | None,
    seq_len: int,
    forced_ids_NA: torch.Tensor | None = None,
) -> RouterOutput:
    """Steps 2, 3 and 5: token-choice top-k from fp32 logits. ``seq_len`` groups rows into
    sequences for the balance loss. ``forced_ids_NA`` (routing replay, deviation 4): ``(N, top_k)``
    expert ids that replace the selection in every row that is not all -1."""
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
    if forced_ids_NA is not None:
        expert_ids_NA = _replay(expert_ids_NA, forced_ids_NA, expert_mask_E, logits_NE.shape[-1])
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
        n_seq = logits_NE.shape[0] // seq_len
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


def _replay(
    ids_NA: torch.Tensor, forced_NA: torch.Tensor, expert_mask_E: torch.Tensor | None, n_experts: int
) -> torch.Tensor:
    """``ids_NA`` with every row of ``forced_NA`` that is not all -1 put in its place (checked)."""
    if forced_NA.shape != ids_NA.shape:
        raise ValueError(
            f"routing replay: forced expert ids have shape {tuple(forced_NA.shape)}, "
            f"expected {tuple(ids_NA.shape)} (rows, top_k)"
        )
    forced_NA = forced_NA.to(device=ids_NA.device, dtype=ids_NA.dtype)
    neg_NA = forced_NA < 0
    row_N = ~neg_NA.all(dim=-1)
    if bool((neg_NA.any(dim=-1) & row_N).any()):
        raise ValueError("routing replay: a row of forced expert ids mixes -1 with expert ids")
    if bool((forced_NA >= n_experts).any()):
        raise ValueError(f"routing replay: forced expert id >= n_experts={n_experts}")
    sorted_NA = forced_NA.sort(dim=-1).values
    if bool(((sorted_NA[:, 1:] == sorted_NA[:, :-1]) & row_N[:, None]).any()):
        raise ValueError("routing replay: a row of forced expert ids repeats an expert")
    if expert_mask_E is not None:
        masked_NA = ~expert_mask_E[forced_NA.clamp_min(0)] & row_N[:, None]
        if bool(masked_NA.any()):
            bad = sorted(set(forced_NA[masked_NA].tolist()))
            raise ValueError(f"routing replay: forced experts {bad} are masked out by the subnet")
    return torch.where(row_N[:, None], forced_NA, ids_NA)


def swiglu(x_ND: torch.Tensor, w13_FD: torch.Tensor, w2_DF: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: ``w13 (2F, D)``, ``w2 (D, F)``; ``x (N, D) -> (N, D)``."""
    g, u = F.linear(x_ND, w13_FD).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, w2_DF)


def experts_loop(
    x_ND: torch.Tensor, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, r: RouterOutput
) -> torch.Tensor:
    """Step 4, the reference: one SwiGLU call per expert on the rows routed to it, gated, summed."""
    y_ND = torch.zeros_like(x_ND)
    for e in torch.nonzero(r.counts_E).flatten().tolist():
        tok, slot = torch.where(r.expert_ids_NA == e)
        out = swiglu(x_ND[tok], w13_EFD[e], w2_EDF[e])
        y_ND.index_add_(0, tok, (out * r.gates_NA[tok, slot, None].to(out.dtype)).to(y_ND.dtype))
    return y_ND


class SwiGLU(nn.Module):
    """Dense SwiGLU FFN (dense layers, shared experts, the MTP block)."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

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

    def route(
        self,
        x_ND: torch.Tensor,
        top_k: int,
        expert_mask_E: torch.Tensor | None,
        seq_len: int,
        forced_ids_NA: torch.Tensor | None = None,
    ) -> RouterOutput:
        """Steps 1-3 and 5 for ``N`` token rows grouped in sequences of ``seq_len``;
        ``forced_ids_NA`` replays a selection (deviation 4)."""
        logits_NE = router_logits(x_ND, self.router.weight)
        return select_experts(
            logits_NE, self.router_bias, self.cfg, top_k, expert_mask_E, seq_len, forced_ids_NA
        )

    def experts(self, x_ND: torch.Tensor, r: RouterOutput) -> torch.Tensor:
        """Step 4: the gated sum of every token's routed experts, ``(N, D)``."""
        return experts_loop(x_ND, self.w13, self.w2, r)

    def forward(
        self,
        x_BTD: torch.Tensor,
        top_k: int | None = None,
        expert_mask_E: torch.Tensor | None = None,
        forced_ids_BTA: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RouterOutput]:
        """Mix routed experts for every token.

        Args:
            x_BTD: hidden states.
            top_k: active experts per token (``None`` = the configured default).
            expert_mask_E: bool mask of the routed experts available (``None`` = all).
            forced_ids_BTA: routing replay (deviation 4): ``(B, T, top_k)`` int64 expert ids that
                replace the selection, -1 rows routed normally (``None`` = route every token).

        Returns:
            ``(y_BTD, router_output)``.
        """
        b, t, d = x_BTD.shape
        x_ND = x_BTD.reshape(b * t, d)
        k = top_k or self.cfg.top_k
        if forced_ids_BTA is None:
            r = self.route(x_ND, k, expert_mask_E, t)
        else:
            if tuple(forced_ids_BTA.shape) != (b, t, k):
                raise ValueError(
                    f"routing replay: expert ids have shape {tuple(forced_ids_BTA.shape)}, "
                    f"expected (B, T, top_k) = {(b, t, k)}"
                )
            r = self.route(x_ND, k, expert_mask_E, t, forced_ids_BTA.reshape(b * t, k))
        y_BTD = self.experts(x_ND, r).view(b, t, d)
        if self.shared is not None:
            y_BTD = y_BTD + self.shared(x_BTD)
        return y_BTD, r


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
