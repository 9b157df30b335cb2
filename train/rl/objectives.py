"""Pure advantage, ratio, mask and loss functions of the RL post-training stage.

Tensors in, tensors out: no globals, no I/O, no optimizer or model. Shape suffixes: B responses (rows
of a batch), G responses per query (group), T response tokens, Q queries in the success-rate table.
Log-probs are per-token log-probs of the sampled tokens, ``(B, T)`` float; ``mask_BT`` is True on valid
response tokens. Three policies (algorithms.md §6.1): ``logp_infer`` from the inference engine at
generation time, ``logp_old`` recomputed by the training engine at the rollout weights, ``logp_new``
from the policy being optimised (the only input that carries a gradient). Losses are to be minimised
(``loss = -J``).

The actor loss of the paper (MISC with WPSM and AHRL hints) is assembled as:
  1. ``reward_BG`` -> :func:`dynamic_sampling_keep` finds groups with all-equal rewards (DAPO: the
     trainer drops them and samples more groups to refill the batch).
  2. :func:`group_advantages` gives one advantage per response.
  3. :func:`update_success_ema` and :func:`wpsm_mask` mark well-learned positive-advantage responses;
     their sequence weight becomes ``1 - alpha * masked``.
  4. :func:`hint_loss_mask` removes AHRL hint tokens from ``mask_BT``.
  5. :func:`misc_loss`: token-level IcePop mismatch weight x sequence-level GSPO clip (Eq. 3).

The comparison arms take the same inputs and the same sequence weight: :func:`grpo_icepop_loss` (Eq. 1:
token IcePop x token clip), :func:`gspo_icepop_loss` (Eq. 2: sequence IcePop x sequence clip), and the
mismatch-blind baselines :func:`grpo_loss` (DAPO token-mean, asymmetric clip) and :func:`gspo_loss`.
:func:`kl_to_reference` is the optional KL to the starting policy (k1 / k3 estimators) any of them may add.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §4.2 Eqs. 1-4 (GRPO-IcePop, GSPO-IcePop, MISC, WPSM)
    and §4.3 Eq. 5 (AHRL hint schedule).
  * GRPO: DeepSeekMath (arXiv 2402.03300). DAPO (arXiv 2503.14476): token-mean aggregation,
    clip-higher, dynamic sampling. GSPO (arXiv 2507.18071) and verl ``compute_policy_loss_gspo``
    (GSPO-token form). IcePop (Ring-1T, arXiv 2510.18855): ``M(k; a, b) = k if a <= k <= b else 0``.

Deviations:
  1. Group std is the sample std (Bessel, ``unbiased=True``), as in verl and TRL; a group of one
     response, or whose rewards are all equal, gets advantage exactly 0 instead of ``0 / eps``.
  2. No KL term by default (DAPO and the report's Eq. 3 have none); :func:`kl_to_reference` is added by
     the trainer only when asked (``objective.kl_coef > 0``), as verl's ``use_kl_loss``.
  3. MISC is written in the GSPO-token form (algorithms.md §6.4-6.5): the value of every token's ratio is
     ``s_i`` but its gradient goes through that token's own log-prob only, so the IcePop weight of a
     mismatched token removes that token's gradient instead of rescaling the whole sequence. The
     detached ``log s_i`` is clamped at ``max_log_ratio = 10`` (algorithms.md §6.9) to keep ``exp`` finite.
  4. Aggregation: sequence-mean of token-means (Eq. 3); ``|y_i|`` counts all valid tokens, including
     those IcePop drops; the sequence mean runs over rows with at least one valid token, so a fully
     masked (padding) row neither contributes nor dilutes the loss.
  5. Defaults the report does not give: IcePop ``alpha, beta = 0.5, 5``; GSPO/MISC clip
     ``3e-4 / 4e-4``; GRPO clip ``0.2 / 0.2`` (pass ``clip_high=0.28`` for DAPO clip-higher); WPSM
     ``tau = 0.75``, ``eta`` = 20th percentile of positive responses' mean entropies in the batch; a
     response is "positive" when its advantage is > 0 (a reward > 0 is not: with graded rewards a
     below-mean response has reward > 0 and a negative advantage); AHRL ``p_init = 0.5``, hints only
     while ``pass_init < 0.5``.
  7. GSPO-IcePop's sequence mismatch ratio is length-normalised, ``rho_i = exp(mean_j log rho_ij)`` (the
     report's extraction is ambiguous; the geometric mean keeps one bound meaningful at every length,
     as GSPO's ``s_i``). Its ``mismatch_masked_frac`` counts the valid tokens of the masked sequences, so
     that it reads in the same unit as the token-level arms'.
  8. GRPO-IcePop aggregates as Eq. 1 (sequence-mean of token-means); the mismatch-blind GRPO baseline
     keeps DAPO's token-mean.
  6. WPSM's success rate is an EMA over iterations (``decay = 0`` gives the report's per-iteration
     ``acc_x^t`` computed from the current rollouts).
"""

from __future__ import annotations

import torch
from torch import Tensor

MAX_LOG_RATIO = 10.0


def _row_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of ``x_BT`` over the valid tokens of each row, 0 for a row with none. Returns ``(B,)``."""
    m = mask_BT.to(x_BT.dtype)
    return (x_BT * m).sum(-1) / m.sum(-1).clamp_min(1.0)


def group_advantages(reward_BG: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO group-normalised advantages: ``A_bg = (r_bg - mean_g r_b) / (std_g r_b + eps)``.

    Args:
        reward_BG: ``(B, G)`` float rewards, one row per query, G responses each.
        eps: added to the std.

    Returns:
        ``(B, G)`` advantages. ``std`` is the sample std (Bessel-corrected, Deviation 1); rows whose
        rewards are all equal (including ``G == 1``) get exactly 0.
    """
    if not reward_BG.is_floating_point():
        reward_BG = reward_BG.float()
    mean_B1 = reward_BG.mean(-1, keepdim=True)
    n_per_group = reward_BG.shape[-1]
    std_B1 = reward_BG.std(-1, keepdim=True) if n_per_group > 1 else torch.zeros_like(mean_B1)
    adv_BG = (reward_BG - mean_B1) / (std_B1 + eps)
    constant_B1 = reward_BG.amax(-1, keepdim=True) == reward_BG.amin(-1, keepdim=True)
    return adv_BG.masked_fill(constant_B1, 0.0)


def dynamic_sampling_keep(reward_BG: Tensor) -> Tensor:
    """DAPO dynamic sampling: keep a group unless its rewards are all equal (all 0 / all 1 accuracy).

    Args:
        reward_BG: ``(B, G)`` rewards.

    Returns:
        ``(B,)`` bool, True for groups with a non-zero advantage signal.
    """
    return reward_BG.amax(-1) != reward_BG.amin(-1)


def token_ratio(logp_new_BT: Tensor, logp_old_BT: Tensor) -> Tensor:
    """Per-token policy ratio ``r_bt = exp(logp_new - logp_old)``, ``(B, T)``; grad through ``logp_new``."""
    return torch.exp(logp_new_BT - logp_old_BT.detach())


def sequence_ratio(logp_new_BT: Tensor, logp_old_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """GSPO length-normalised sequence ratio ``s_b = exp(mean_{t valid}(logp_new - logp_old))``.

    Args:
        logp_new_BT, logp_old_BT: ``(B, T)`` per-token log-probs.
        mask_BT: ``(B, T)`` bool, valid response tokens.

    Returns:
        ``(B,)``; a row with no valid token gets ``s = 1``.
    """
    return torch.exp(_row_mean(logp_new_BT - logp_old_BT.detach(), mask_BT))


def icepop_mask(
    logp_train_BT: Tensor, logp_infer_BT: Tensor, mask_BT: Tensor, low: float = 0.5, high: float = 5.0
) -> tuple[Tensor, Tensor]:
    """IcePop token mismatch mask: keep tokens with ``low <= rho_bt <= high``, ``rho = pi_train / pi_infer``.

    Args:
        logp_train_BT: ``(B, T)`` training-engine log-probs at the rollout weights (``logp_old``).
        logp_infer_BT: ``(B, T)`` inference-engine log-probs stored at generation time.
        mask_BT: ``(B, T)`` bool, valid response tokens.
        low, high: inclusive bounds ``alpha, beta`` on the ratio.

    Returns:
        ``keep_BT`` (bool, False on invalid tokens) and ``masked_frac`` (0-d float): the fraction of valid
        tokens dropped for mismatch (0 when there are no valid tokens). The IcePop weight
        ``M(rho) = rho * keep`` is what :func:`misc_loss` multiplies in.
    """
    rho_BT = torch.exp(logp_train_BT.detach() - logp_infer_BT.detach())
    keep_BT = mask_BT & (rho_BT >= low) & (rho_BT <= high)
    n_valid = mask_BT.sum()
    masked_frac = (n_valid - keep_BT.sum()).float() / n_valid.clamp_min(1).float()
    return keep_BT, masked_frac


def _seq_mean(term_B: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of per-sequence terms over rows with at least one valid token (Deviation 4)."""
    has_tokens_B = mask_BT.any(-1)
    return (term_B * has_tokens_B).sum() / has_tokens_B.sum().clamp_min(1)


def _weighted(term_B: Tensor, seq_weight_B: Tensor | None) -> Tensor:
    """``term_B`` times the (detached) per-sequence weight, when one is given."""
    return term_B if seq_weight_B is None else term_B * seq_weight_B.detach()


def _icepop_weight(
    logp_train_BT: Tensor, logp_infer_BT: Tensor, mask_BT: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """The token IcePop weight ``M(rho_bt) = rho_bt * keep_bt`` (no grad) and the dropped fraction."""
    keep_BT, masked_frac = icepop_mask(logp_train_BT, logp_infer_BT, mask_BT, low, high)
    return torch.exp(logp_train_BT.detach() - logp_infer_BT.detach()) * keep_BT, masked_frac


def _clipped(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic objective ``min(ratio A, clip(ratio, 1 - lo, 1 + hi) A)`` (``adv`` detached,
    broadcast against ``ratio``) and where its clipped branch is active (bool, same shape)."""
    adv = adv.detach()
    unclipped = adv * ratio
    clipped = adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.minimum(unclipped, clipped), clipped < unclipped


def misc_loss(
    logp_new_BT: Tensor,
    logp_old_BT: Tensor,
    logp_infer_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    seq_weight_B: Tensor | None = None,
    max_log_ratio: float = MAX_LOG_RATIO,
) -> tuple[Tensor, dict[str, Tensor]]:
    """MISC (Mixed-IcePop, report Eq. 3): token-level IcePop mismatch weight x sequence-level GSPO clip.

    ``J = 1/G sum_i w_i/|y_i| sum_j M(rho_ij) * min(s_ij A_i, clip(s_ij, 1 - clip_low, 1 + clip_high) A_i)``
    with ``rho_ij = exp(logp_old - logp_infer)``, ``M(rho) = rho if icepop_low <= rho <= icepop_high else
    0`` (no grad), ``s_ij = exp(sg(log s_i) + logp_new_ij - sg(logp_new_ij))`` (GSPO-token form, value
    ``s_i``; Deviation 3) and ``w_i = seq_weight_B`` (WPSM ``1 - alpha * masked``; default 1).

    Args:
        logp_new_BT: ``(B, T)`` current-policy log-probs (with grad).
        logp_old_BT: ``(B, T)`` training-engine log-probs at the rollout weights.
        logp_infer_BT: ``(B, T)`` inference-engine log-probs of the rollout.
        adv_B: ``(B,)`` sequence advantages.
        mask_BT: ``(B, T)`` bool, loss-bearing response tokens (hint tokens already removed).
        clip_low, clip_high: sequence ratio trust region ``[1 - clip_low, 1 + clip_high]``.
        icepop_low, icepop_high: IcePop bounds ``alpha, beta``.
        seq_weight_B: optional ``(B,)`` per-sequence weight.
        max_log_ratio: clamp on the detached ``log s_i``.

    Returns:
        Scalar loss ``-J`` and stats (detached 0-d tensors): ``clip_frac`` (fraction of sequences with a
        valid token whose clipped branch is active), ``mismatch_masked_frac`` (from :func:`icepop_mask`).
    """
    weight_BT, mismatch_frac = _icepop_weight(logp_old_BT, logp_infer_BT, mask_BT, icepop_low, icepop_high)
    log_s_B = _row_mean(logp_new_BT.detach() - logp_old_BT.detach(), mask_BT).clamp(max=max_log_ratio)
    log_s_BT = log_s_B[:, None] + logp_new_BT - logp_new_BT.detach()
    s_BT = torch.exp(log_s_BT)
    obj_BT, _ = _clipped(s_BT, adv_B[:, None], clip_low, clip_high)
    term_B = _weighted(_row_mean(weight_BT * obj_BT, mask_BT), seq_weight_B)
    loss = -_seq_mean(term_B, mask_BT)
    s_B = log_s_B.exp()
    _, is_clipped_B = _clipped(s_B, adv_B, clip_low, clip_high)
    stats = {
        "clip_frac": _seq_mean(is_clipped_B.float(), mask_BT).detach(),
        "mismatch_masked_frac": mismatch_frac.detach(),
    }
    return loss, stats


def grpo_loss(
    logp_new_BT: Tensor,
    logp_old_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    seq_weight_B: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO-clip with group advantages (GRPO / DAPO baseline), token-mean over valid tokens.

    ``loss = -sum_{b,t valid} w_b min(r_bt A_b, clip(r_bt, 1 - clip_low, 1 + clip_high) A_b) / n_valid``
    with ``r = exp(logp_new - logp_old)`` and ``w_b = seq_weight_B`` (default 1); no KL (Deviation 2).

    Args:
        logp_new_BT, logp_old_BT: ``(B, T)`` log-probs; only ``logp_new`` carries a gradient.
        adv_B: ``(B,)`` advantages, broadcast over tokens.
        mask_BT: ``(B, T)`` bool, loss-bearing tokens.
        clip_low, clip_high: token trust region (``clip_high = 0.28`` for DAPO clip-higher).
        seq_weight_B: optional ``(B,)`` per-sequence weight (WPSM), on every token of its row.

    Returns:
        Scalar loss (0 with no valid token) and ``{"clip_frac"}``: fraction of valid tokens whose clipped
        branch is active.
    """
    obj_BT, is_clipped_BT = _clipped(
        token_ratio(logp_new_BT, logp_old_BT), adv_B[:, None], clip_low, clip_high
    )
    m = mask_BT.to(obj_BT.dtype)
    n_valid = m.sum().clamp_min(1.0)
    w_BT = m if seq_weight_B is None else m * seq_weight_B.detach()[:, None]
    loss = -(obj_BT * w_BT).sum() / n_valid
    clip_frac = (is_clipped_BT & mask_BT).sum() / n_valid
    return loss, {"clip_frac": clip_frac.detach()}


def gspo_loss(
    logp_new_BT: Tensor,
    logp_old_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    seq_weight_B: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO baseline (sequence clip): ``loss = -mean_b w_b min(s_b A_b, clip(s_b, 1 - lo, 1 + hi) A_b)``.

    ``s_b`` is :func:`sequence_ratio`, ``w_b = seq_weight_B`` (default 1); the mean runs over rows with a
    valid token (Deviation 4).

    Returns:
        Scalar loss and ``{"clip_frac"}``: fraction of sequences whose clipped branch is active.
    """
    s_B = sequence_ratio(logp_new_BT, logp_old_BT, mask_BT)
    obj_B, is_clipped_B = _clipped(s_B, adv_B, clip_low, clip_high)
    loss = -_seq_mean(_weighted(obj_B, seq_weight_B), mask_BT)
    clip_frac = _seq_mean(is_clipped_B.float(), mask_BT)
    return loss, {"clip_frac": clip_frac.detach()}


def grpo_icepop_loss(
    logp_new_BT: Tensor,
    logp_old_BT: Tensor,
    logp_infer_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    seq_weight_B: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO-IcePop (report Eq. 1): token IcePop mismatch weight x token policy-ratio clip.

    ``J = 1/G sum_i w_i/|y_i| sum_j M(rho_ij) min(r_ij A_i, clip(r_ij, 1 - clip_low, 1 + clip_high) A_i)``
    with ``r_ij = exp(logp_new - logp_old)``, ``rho_ij = exp(logp_old - logp_infer)`` and ``M`` as in
    :func:`misc_loss`; sequence-mean of token-means (Deviation 8).

    Returns:
        Scalar loss ``-J`` and stats ``clip_frac`` (fraction of valid tokens whose clipped branch is
        active) and ``mismatch_masked_frac`` (:func:`icepop_mask`).
    """
    weight_BT, mismatch_frac = _icepop_weight(logp_old_BT, logp_infer_BT, mask_BT, icepop_low, icepop_high)
    obj_BT, is_clipped_BT = _clipped(
        token_ratio(logp_new_BT, logp_old_BT), adv_B[:, None], clip_low, clip_high
    )
    term_B = _weighted(_row_mean(weight_BT * obj_BT, mask_BT), seq_weight_B)
    loss = -_seq_mean(term_B, mask_BT)
    n_valid = mask_BT.sum().clamp_min(1)
    clip_frac = (is_clipped_BT & mask_BT).sum() / n_valid
    return loss, {"clip_frac": clip_frac.detach(), "mismatch_masked_frac": mismatch_frac.detach()}


def gspo_icepop_loss(
    logp_new_BT: Tensor,
    logp_old_BT: Tensor,
    logp_infer_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    seq_weight_B: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-IcePop (report Eq. 2): sequence IcePop mismatch weight x sequence policy-ratio clip.

    ``J = 1/G sum_i w_i M(rho_i) min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)`` with
    ``s_i`` from :func:`sequence_ratio` and the sequence mismatch ratio ``rho_i = exp(mean_j (logp_old -
    logp_infer))`` (Deviation 7): a mismatched sequence loses its whole gradient, the mechanism the
    report blames for this arm's entropy collapse.

    Returns:
        Scalar loss ``-J`` and stats ``clip_frac`` (fraction of sequences whose clipped branch is active)
        and ``mismatch_masked_frac`` (valid tokens in masked sequences over all valid tokens).
    """
    rho_B = torch.exp(_row_mean(logp_old_BT.detach() - logp_infer_BT.detach(), mask_BT))
    keep_B = (rho_B >= icepop_low) & (rho_B <= icepop_high)
    s_B = sequence_ratio(logp_new_BT, logp_old_BT, mask_BT)
    obj_B, is_clipped_B = _clipped(s_B, adv_B, clip_low, clip_high)
    term_B = _weighted(rho_B * keep_B * obj_B, seq_weight_B)
    loss = -_seq_mean(term_B, mask_BT)
    n_tok_B = mask_BT.sum(-1)
    masked_frac = (n_tok_B * ~keep_B).sum().float() / n_tok_B.sum().clamp_min(1).float()
    clip_frac = _seq_mean(is_clipped_B.float(), mask_BT)
    return loss, {"clip_frac": clip_frac.detach(), "mismatch_masked_frac": masked_frac.detach()}


def kl_to_reference(
    logp_new_BT: Tensor, logp_ref_BT: Tensor, mask_BT: Tensor, estimator: str = "k3"
) -> Tensor:
    """Per-token estimate of ``KL(pi_theta || pi_ref)`` on the sampled tokens, averaged as the losses are
    (sequence-mean of token-means); to be added to a loss as ``kl_coef * kl``.

    ``k1 = log pi_theta - log pi_ref`` (unbiased, high variance, can be negative per token);
    ``k3 = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1`` (Schulman's low-variance estimator, >= 0; the
    GRPO paper's and verl's ``low_var_kl``). The log-ratio in ``k3`` is clamped to ``[-20, 20]`` as verl does.

    Args:
        logp_new_BT: ``(B, T)`` current-policy log-probs (with grad).
        logp_ref_BT: ``(B, T)`` log-probs of the same tokens under the starting policy (no grad).
        mask_BT: ``(B, T)`` bool, loss-bearing tokens.
        estimator: ``"k1"`` or ``"k3"``.

    Returns:
        0-d tensor (0 with no valid token).
    """
    log_ratio_BT = logp_new_BT - logp_ref_BT.detach()  # log pi_theta / pi_ref
    if estimator == "k1":
        kl_BT = log_ratio_BT
    elif estimator == "k3":
        neg_BT = (-log_ratio_BT).clamp(-20.0, 20.0)  # log pi_ref / pi_theta
        kl_BT = torch.exp(neg_BT) - neg_BT - 1.0
    else:
        raise ValueError(f"kl estimator {estimator!r}: expected k1 or k3")
    return _seq_mean(_row_mean(kl_BT, mask_BT), mask_BT)


def update_success_ema(ema_Q: Tensor, query_idx_B: Tensor, success_B: Tensor, decay: float) -> Tensor:
    """EMA of each query's success rate over RL iterations; returns a new ``(Q,)`` tensor.

    For every query ``q`` present in the batch, ``acc_q`` is the mean of ``success_B`` over its
    responses and ``ema_q <- decay * ema_q + (1 - decay) * acc_q``; absent queries keep their value.
    ``decay = 0`` gives the per-iteration success rate of the report (``acc_x^t``).

    Args:
        ema_Q: ``(Q,)`` float current EMA (initialise with 0).
        query_idx_B: ``(B,)`` long query index of each response.
        success_B: ``(B,)`` success per response (bool or 0/1 float).
        decay: in ``[0, 1]``.
    """
    sums_Q = torch.zeros_like(ema_Q).index_add_(0, query_idx_B, success_B.to(ema_Q.dtype))
    counts_Q = torch.zeros_like(ema_Q).index_add_(
        0, query_idx_B, torch.ones_like(success_B, dtype=ema_Q.dtype)
    )
    seen_Q = counts_Q > 0
    acc_Q = sums_Q / counts_Q.clamp_min(1.0)
    return torch.where(seen_Q, decay * ema_Q + (1 - decay) * acc_Q, ema_Q)


def wpsm_mask(
    success_ema_Q: Tensor,
    query_idx_B: Tensor,
    adv_B: Tensor,
    entropy_B: Tensor,
    threshold: float = 0.75,
    entropy_quantile: float = 0.2,
    entropy_threshold: float | None = None,
) -> Tensor:
    """Well-learned Positive Sample Mask (report Eq. 4): which responses WPSM removes.

    Response ``b`` is masked iff ``success_ema[query_idx_b] > threshold`` and ``adv_b > 0`` (a positive
    sample: better than its group, Deviation 5) and ``entropy_b < eta``, where ``eta = entropy_threshold``
    if given, else the ``entropy_quantile`` quantile (linear interpolation) of ``entropy_B`` over the
    positive responses of the batch. The loss weight is ``1 - alpha * masked`` (``alpha = 1`` in the
    report's strongest form).

    Args:
        success_ema_Q: ``(Q,)`` per-query success rate (:func:`update_success_ema`).
        query_idx_B: ``(B,)`` long query index of each response.
        adv_B: ``(B,)`` group advantages (:func:`group_advantages`).
        entropy_B: ``(B,)`` mean token entropy of each response under the current policy.

    Returns:
        ``(B,)`` bool, True for masked (well-learned positive) responses.
    """
    positive_B = adv_B > 0
    if entropy_threshold is None:
        if not positive_B.any():
            return torch.zeros_like(positive_B)
        eta = torch.quantile(entropy_B[positive_B].float(), entropy_quantile)
    else:
        eta = torch.tensor(entropy_threshold)
    well_learned_B = success_ema_Q[query_idx_B] > threshold
    return well_learned_B & positive_B & (entropy_B < eta)


def ahrl_hint_fraction(
    pass_rate: Tensor,
    max_fraction: float = 0.5,
    *,
    step: int,
    gamma: float,
    pass_cutoff: float = 0.5,
    pass_floor: float = 0.0,
) -> Tensor:
    """AHRL hint fraction (report Eq. 5): ``p = max_fraction * exp(-gamma * step * max(pass, pass_floor))``.

    ``pass_rate`` is the SFT model's pass@k on each query; queries with ``pass_rate >= pass_cutoff`` get
    no hint. With ``pass_floor = 0`` a never-solved query keeps ``max_fraction`` forever (the report's
    formula); ``pass_floor = 1 / k`` makes it decay too. A query with pass 0.5 halves its hint after
    ``T / 4`` of ``T`` iterations when ``gamma = ln 2 / (0.125 T)``.

    Returns:
        Tensor of the shape of ``pass_rate``: the fraction of the reference *think* tokens to prepend.
    """
    pass_rate = torch.as_tensor(pass_rate, dtype=torch.float32)
    frac = max_fraction * torch.exp(-gamma * step * pass_rate.clamp_min(pass_floor))
    return torch.where(pass_rate < pass_cutoff, frac, torch.zeros_like(frac))


def hint_loss_mask(hint_len_B: Tensor, T: int) -> Tensor:
    """Loss mask that excludes hint tokens: ``(B, T)`` bool, True at positions ``t >= hint_len_b``.

    The hint occupies the first ``hint_len_b`` positions of row ``b``; they are prompt (no loss, no
    ratio). AND it with the validity mask before a loss.
    """
    return torch.arange(T, device=hint_len_B.device)[None, :] >= hint_len_B[:, None]
