"""Parity of train.rl.objectives against naive per-element loop references, plus edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from train.rl import objectives as rlo


def _rand(B=4, T=7, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(B, T, generator=g) * 2 - 0.05
    logp_new = logp_old + scale * torch.randn(B, T, generator=g)
    logp_infer = logp_old + scale * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(B, generator=g)
    return logp_new, logp_old, logp_infer, mask, adv


def _naive_adv(rows, eps):
    out = []
    for row in rows:
        n = len(row)
        mean = sum(row) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (n - 1)) if n > 1 else 0.0
        out.append([0.0 if max(row) == min(row) else (r - mean) / (std + eps) for r in row])
    return out


def _naive_seq_ratio(new, old, mask):
    out = []
    for b in range(len(new)):
        vals = [new[b][t] - old[b][t] for t in range(len(new[b])) if mask[b][t]]
        out.append(math.exp(sum(vals) / len(vals)) if vals else 1.0)
    return out


def _naive_misc(new, old, infer, mask, adv, lo, hi, a, b_, w=None):
    s = _naive_seq_ratio(new, old, mask)
    terms, n_clip, n_rows = [], 0, 0
    for b in range(len(new)):
        n = sum(mask[b])
        if n == 0:
            continue
        n_rows += 1
        unc, clp = adv[b] * s[b], adv[b] * min(max(s[b], 1 - lo), 1 + hi)
        obj = min(unc, clp)
        n_clip += clp < unc
        tot = 0.0
        for t in range(len(new[b])):
            if mask[b][t]:
                rho = math.exp(old[b][t] - infer[b][t])
                tot += (rho if a <= rho <= b_ else 0.0) * obj
        terms.append(tot / n * (1.0 if w is None else w[b]))
    return -sum(terms) / n_rows, n_clip / n_rows


def test_group_advantages_parity_and_constant_rows():
    reward = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.3, 0.3, 0.3, 0.3], [0.1, 0.7, -2.0, 5.0]])
    got = rlo.group_advantages(reward, eps=1e-6)
    assert torch.allclose(got, torch.tensor(_naive_adv(reward.tolist(), 1e-6)), atol=1e-5)
    assert torch.equal(got[1], torch.zeros(4))
    assert torch.allclose(got.mean(-1), torch.zeros(3), atol=1e-6)
    assert torch.equal(rlo.group_advantages(torch.tensor([[2.0], [3.0]])), torch.zeros(2, 1))


def test_dynamic_sampling_keep():
    reward = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.4]])
    naive = [max(r) != min(r) for r in reward.tolist()]
    assert rlo.dynamic_sampling_keep(reward).tolist() == naive == [False, False, True, True]


def test_token_and_sequence_ratio_parity():
    new, old, _, mask, _ = _rand()
    r = rlo.token_ratio(new, old)
    naive = [[math.exp(a - b) for a, b in zip(rn, ro)] for rn, ro in zip(new.tolist(), old.tolist())]
    assert torch.allclose(r, torch.tensor(naive), rtol=1e-5)
    mask[2] = False
    s = rlo.sequence_ratio(new, old, mask)
    assert torch.allclose(
        s, torch.tensor(_naive_seq_ratio(new.tolist(), old.tolist(), mask.tolist())), rtol=1e-5
    )
    assert s[2] == 1.0
    assert torch.allclose(rlo.sequence_ratio(old, old, mask), torch.ones(4))


def test_icepop_mask_parity_and_bounds():
    _, old, infer, mask, _ = _rand(scale=1.0, seed=1)
    keep, frac = rlo.icepop_mask(old, infer, mask, 0.5, 5.0)
    naive, n_valid, n_drop = [], 0, 0
    for b in range(old.shape[0]):
        row = []
        for t in range(old.shape[1]):
            rho = math.exp(old[b, t].item() - infer[b, t].item())
            ok = bool(mask[b, t]) and 0.5 <= rho <= 5.0
            row.append(ok)
            n_valid += bool(mask[b, t])
            n_drop += bool(mask[b, t]) and not ok
        naive.append(row)
    assert keep.tolist() == naive
    assert frac.item() == pytest.approx(n_drop / n_valid)
    assert 0 < n_drop < n_valid  # both branches exercised
    # explicit drops just outside [low, high], keeps at the inclusive bounds
    lp_inf = torch.zeros(1, 4)
    lp_tr = torch.log(torch.tensor([[0.49, 0.5, 5.0, 5.1]]))
    k, f = rlo.icepop_mask(lp_tr, lp_inf, torch.ones(1, 4, dtype=torch.bool), 0.5, 5.0 + 1e-6)
    assert k.tolist() == [[False, True, True, False]] and f.item() == pytest.approx(0.5)
    k, f = rlo.icepop_mask(lp_tr, lp_inf, torch.zeros(1, 4, dtype=torch.bool))
    assert not k.any() and f.item() == 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_misc_loss_parity(seed):
    new, old, infer, mask, adv = _rand(seed=seed, scale=0.5)
    mask[3] = False  # a fully masked row
    w = torch.tensor([1.0, 0.0, 0.5, 1.0])
    loss, stats = rlo.misc_loss(new, old, infer, adv, mask, clip_low=0.05, clip_high=0.08, seq_weight_B=w)
    ref, clip = _naive_misc(
        new.tolist(),
        old.tolist(),
        infer.tolist(),
        mask.tolist(),
        adv.tolist(),
        0.05,
        0.08,
        0.5,
        5.0,
        w.tolist(),
    )
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(clip)
    _, frac = rlo.icepop_mask(old, infer, mask)
    assert stats["mismatch_masked_frac"] == frac


def test_misc_ratio_one_gives_minus_mean_advantage_and_clip_counted():
    _, old, _, mask, adv = _rand()
    loss, stats = rlo.misc_loss(old.clone(), old, old, adv, mask)
    assert loss.item() == pytest.approx(-adv.mean().item(), abs=1e-6)
    assert stats["clip_frac"] == 0 and stats["mismatch_masked_frac"] == 0
    # shift every token by +0.01: s = e^0.01 > 1 + 4e-4 -> clipped for A > 0 only
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5])
    new = (old + 0.01).requires_grad_()
    loss, stats = rlo.misc_loss(new, old, old, adv, mask)
    assert stats["clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    assert torch.all(new.grad[adv > 0] == 0)
    assert torch.all(new.grad[adv < 0][mask[adv < 0]] != 0)


def test_misc_gradient_only_through_logp_new_and_mismatched_tokens_zero():
    new, old, infer, mask, adv = _rand(seed=3, scale=1.0)
    new.requires_grad_()
    old.requires_grad_()
    infer.requires_grad_()
    loss, _ = rlo.misc_loss(new, old, infer, adv, mask, clip_low=10.0, clip_high=10.0)
    loss.backward()
    assert old.grad is None or torch.all(old.grad == 0)
    assert infer.grad is None or torch.all(infer.grad == 0)
    keep, _ = rlo.icepop_mask(old.detach(), infer.detach(), mask)
    assert torch.all(new.grad[~keep] == 0)
    assert torch.all(new.grad[keep] != 0)
    # GSPO-token gradient: d/dlogp_ij = -A_i * s_i * rho_ij / (|y_i| * n_rows)
    s = rlo.sequence_ratio(new.detach(), old.detach(), mask)
    rho = torch.exp(old.detach() - infer.detach())
    expect = -adv[:, None] * s[:, None] * rho * keep / mask.sum(-1, keepdim=True) / 4
    assert torch.allclose(new.grad, expect, atol=1e-6)


def test_misc_reduces_to_gspo_without_mismatch():
    new, old, _, mask, adv = _rand(seed=4, scale=0.01)
    new_a, new_b = new.clone().requires_grad_(), new.clone().requires_grad_()
    la, sa = rlo.misc_loss(new_a, old, old, adv, mask)
    lb, sb = rlo.gspo_loss(new_b, old, adv, mask)
    la.backward()
    lb.backward()
    assert la.item() == pytest.approx(lb.item(), rel=1e-5)
    assert sa["clip_frac"] == sb["clip_frac"]
    assert torch.allclose(new_a.grad, new_b.grad, atol=1e-7)


def test_grpo_loss_parity_clip_and_grad():
    new, old, _, mask, adv = _rand(seed=5, scale=0.4)
    new.requires_grad_()
    loss, stats = rlo.grpo_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    tot, n, n_clip = 0.0, 0, 0
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            if not mask[b, t]:
                continue
            r = math.exp(new[b, t].item() - old[b, t].item())
            unc, clp = adv[b].item() * r, adv[b].item() * min(max(r, 0.8), 1.28)
            tot += min(unc, clp)
            n += 1
            n_clip += clp < unc
    assert loss.item() == pytest.approx(-tot / n, rel=1e-5)
    assert stats["clip_frac"].item() == pytest.approx(n_clip / n)
    assert 0 < n_clip < n
    loss.backward()
    assert torch.all(new.grad[~mask] == 0)
    ratio_one, _ = rlo.grpo_loss(old, old, adv, mask)
    expected = -(adv[:, None] * mask).sum() / mask.sum()
    assert ratio_one.item() == pytest.approx(expected.item(), abs=1e-6)
    empty, st = rlo.grpo_loss(new, old, adv, torch.zeros_like(mask))
    assert empty.item() == 0.0 and st["clip_frac"] == 0


def test_gspo_loss_parity():
    new, old, _, mask, adv = _rand(seed=6, scale=0.05)
    mask[1] = False
    loss, stats = rlo.gspo_loss(new, old, adv, mask, clip_low=0.01, clip_high=0.02)
    s = _naive_seq_ratio(new.tolist(), old.tolist(), mask.tolist())
    objs, n_clip = [], 0
    for b in range(4):
        if not mask[b].any():
            continue
        unc, clp = adv[b].item() * s[b], adv[b].item() * min(max(s[b], 0.99), 1.02)
        objs.append(min(unc, clp))
        n_clip += clp < unc
    assert loss.item() == pytest.approx(-sum(objs) / len(objs), rel=1e-5)
    assert stats["clip_frac"].item() == pytest.approx(n_clip / len(objs))
    ratio_one, _ = rlo.gspo_loss(old, old, adv, torch.ones_like(mask))
    assert ratio_one.item() == pytest.approx(-adv.mean().item(), abs=1e-6)


def test_update_success_ema_parity():
    ema = torch.tensor([0.0, 0.5, 0.9, 0.2])
    idx = torch.tensor([0, 0, 2, 2, 2, 1])
    succ = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    got = rlo.update_success_ema(ema, idx, succ, decay=0.8)
    naive = ema.tolist()
    for q in range(4):
        vals = [s for i, s in zip(idx.tolist(), succ.tolist()) if i == q]
        if vals:
            naive[q] = 0.8 * naive[q] + 0.2 * sum(vals) / len(vals)
    assert torch.allclose(got, torch.tensor(naive))
    assert got[3] == ema[3] and ema[0] == 0.0  # unseen query kept, input not mutated
    assert torch.allclose(
        rlo.update_success_ema(ema, idx, succ.bool(), 0.0)[[0, 1, 2]], torch.tensor([0.5, 1, 2 / 3])
    )


def test_wpsm_mask_parity_and_semantics():
    ema = torch.tensor([0.9, 0.5, 0.8])
    idx = torch.tensor([0, 0, 0, 1, 1, 2, 2, 0])
    adv = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, -1.0, 1.0])
    ent = torch.tensor([0.1, 0.9, 0.05, 0.1, 0.2, 0.3, 0.01, 0.5])
    got = rlo.wpsm_mask(ema, idx, adv, ent, threshold=0.75, entropy_threshold=0.4)
    naive = [
        ema[q].item() > 0.75 and a > 0 and h < 0.4
        for q, a, h in zip(idx.tolist(), adv.tolist(), ent.tolist())
    ]
    assert got.tolist() == naive == [True, False, False, False, False, True, False, False]
    # quantile eta over positive entropies (sorted 0.1 0.1 0.2 0.3 0.5 0.9; q=0.5 -> 0.25)
    got_q = rlo.wpsm_mask(ema, idx, adv, ent, threshold=0.75, entropy_quantile=0.5)
    assert got_q.tolist() == [True, False, False, False, False, False, False, False]
    none = rlo.wpsm_mask(ema, idx, -adv.abs(), ent)
    assert not none.any()


def test_wpsm_never_masks_a_below_mean_response_of_a_graded_reward():
    """Graded rewards (tts, t2i, asr): the 0.5 response of [1, 1, 1, 1, 0.5] has reward > 0 but a
    negative advantage; it is a negative sample and must keep its gradient (it was masked before)."""
    reward_BG = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.5]])
    adv_B = rlo.group_advantages(reward_BG).reshape(-1)
    assert adv_B[4] < -1.7
    ema = torch.tensor([0.8])  # four of five successes: well learned
    got = rlo.wpsm_mask(ema, torch.zeros(5, dtype=torch.long), adv_B, torch.zeros(5), entropy_threshold=1.0)
    assert got.tolist() == [True, True, True, True, False]


def test_ahrl_hint_fraction_parity():
    pass_rate = torch.tensor([0.0, 0.1, 0.25, 0.49, 0.5, 0.9])
    T = 400
    gamma = math.log(2) / (0.125 * T)
    for step in (0, 37, 100, 400):
        got = rlo.ahrl_hint_fraction(pass_rate, 0.5, step=step, gamma=gamma, pass_floor=0.05)
        naive = [0.5 * math.exp(-gamma * step * max(p, 0.05)) if p < 0.5 else 0.0 for p in pass_rate.tolist()]
        assert torch.allclose(got, torch.tensor(naive), atol=1e-7)
    lit = rlo.ahrl_hint_fraction(pass_rate, 0.5, step=400, gamma=gamma)
    assert lit[0] == 0.5 and lit[4] == 0 and lit[5] == 0  # pass 0 never decays without a floor
    half = rlo.ahrl_hint_fraction(torch.tensor([0.5 - 1e-9]), 0.5, step=T // 4, gamma=gamma, pass_cutoff=1.0)
    assert half.item() == pytest.approx(0.25, rel=1e-4)


def test_hint_loss_mask_excludes_hint_tokens():
    hint = torch.tensor([0, 2, 5, 7])
    got = rlo.hint_loss_mask(hint, 5)
    assert got.tolist() == [[t >= h for t in range(5)] for h in hint.tolist()]
    new, old, infer, mask, adv = _rand(B=4, T=5, seed=7)
    new.requires_grad_()
    loss, _ = rlo.misc_loss(new, old, infer, adv, mask & got)
    loss.backward()
    assert torch.all(new.grad[~got] == 0)
    grpo, _ = rlo.grpo_loss(new, old, adv, mask & got)
    assert torch.autograd.grad(grpo, new)[0][~got].abs().sum() == 0


def _naive_token_terms(new, old, infer, mask, adv, lo, hi, a=None, b_=None):
    """Per row: the list of per-token clipped objectives, each times its IcePop weight when bounds given."""
    rows = []
    for b in range(len(new)):
        terms = []
        for t in range(len(new[b])):
            if not mask[b][t]:
                continue
            r = math.exp(new[b][t] - old[b][t])
            obj = min(adv[b] * r, adv[b] * min(max(r, 1 - lo), 1 + hi))
            if a is not None:
                rho = math.exp(old[b][t] - infer[b][t])
                obj *= rho if a <= rho <= b_ else 0.0
            terms.append(obj)
        rows.append(terms)
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_icepop_loss_parity(seed):
    new, old, infer, mask, adv = _rand(seed=seed, scale=0.6)
    mask[2] = False
    w = torch.tensor([1.0, 0.0, 0.5, 1.0])
    loss, stats = rlo.grpo_icepop_loss(
        new, old, infer, adv, mask, clip_low=0.2, clip_high=0.28, seq_weight_B=w
    )
    rows = _naive_token_terms(*(x.tolist() for x in (new, old, infer, mask, adv)), 0.2, 0.28, 0.5, 5.0)
    terms = [sum(r) / len(r) * w[b].item() for b, r in enumerate(rows) if r]
    assert loss.item() == pytest.approx(-sum(terms) / len(terms), rel=1e-5)
    keep, frac = rlo.icepop_mask(old, infer, mask)
    assert stats["mismatch_masked_frac"].item() == pytest.approx(frac.item())
    assert 0 < frac.item() < 1
    # no mismatch: IcePop weights 1, so it is GRPO with the sequence-mean of token-means
    same, st = rlo.grpo_icepop_loss(new, old, old, adv, mask)
    rows = _naive_token_terms(*(x.tolist() for x in (new, old, old, mask, adv)), 0.2, 0.2)
    terms = [sum(r) / len(r) for r in rows if r]
    assert (
        same.item() == pytest.approx(-sum(terms) / len(terms), rel=1e-5) and st["mismatch_masked_frac"] == 0
    )


def test_grpo_icepop_drops_the_gradient_of_mismatched_tokens_only():
    new, old, infer, mask, adv = _rand(seed=3, scale=0.8)
    new.requires_grad_()
    loss, _ = rlo.grpo_icepop_loss(new, old, infer, adv, mask)
    loss.backward()
    keep, _ = rlo.icepop_mask(old, infer, mask)
    assert torch.all(new.grad[~keep] == 0) and new.grad[keep].abs().sum() > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_icepop_loss_parity_and_sequence_mask(seed):
    new, old, infer, mask, adv = _rand(seed=seed, scale=0.05)
    infer[0] = old[0] + 1.0  # sequence 0: rho_0 = e^-1 < 0.5, masked whole
    new.requires_grad_()
    w = torch.tensor([1.0, 1.0, 0.25, 1.0])
    loss, stats = rlo.gspo_icepop_loss(
        new, old, infer, adv, mask, clip_low=0.01, clip_high=0.02, seq_weight_B=w
    )
    n, o, i, m = new.tolist(), old.tolist(), infer.tolist(), mask.tolist()
    s = _naive_seq_ratio(n, o, m)
    terms, masked_tokens = [], 0
    for b in range(4):
        vals = [o[b][t] - i[b][t] for t in range(len(o[b])) if m[b][t]]
        rho = math.exp(sum(vals) / len(vals))
        keep = 0.5 <= rho <= 5.0
        masked_tokens += 0 if keep else len(vals)
        a = adv[b].item()
        terms.append(w[b].item() * (rho if keep else 0.0) * min(a * s[b], a * min(max(s[b], 0.99), 1.02)))
    assert loss.item() == pytest.approx(-sum(terms) / 4, rel=1e-5)
    assert stats["mismatch_masked_frac"].item() == pytest.approx(masked_tokens / mask.sum().item())
    loss.backward()
    assert torch.all(new.grad[0] == 0) and new.grad[1:].abs().sum() > 0


@pytest.mark.parametrize("fn", ["grpo_loss", "gspo_loss"])
def test_the_baselines_take_the_sequence_weight(fn):
    """WPSM's weight reaches every objective: a zero weight removes its row from the loss and gradient."""
    new, old, _, mask, adv = _rand(seed=8, scale=0.3 if fn == "grpo_loss" else 1e-5)  # inside the clip
    new.requires_grad_()
    w = torch.tensor([1.0, 0.0, 1.0, 0.5])
    loss, _ = getattr(rlo, fn)(new, old, adv, mask, seq_weight_B=w)
    plain, _ = getattr(rlo, fn)(new, old, adv, mask)
    assert loss.item() != pytest.approx(plain.item())
    (grad,) = torch.autograd.grad(loss, new)
    assert torch.all(grad[1] == 0) and grad[0].abs().sum() > 0
    (grad_plain,) = torch.autograd.grad(plain, new)
    assert torch.allclose(grad[3], 0.5 * grad_plain[3]) and torch.allclose(grad[0], grad_plain[0])


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_to_reference_parity(estimator):
    new, ref, _, mask, _ = _rand(seed=9, scale=0.4)
    mask[3] = False
    new.requires_grad_()
    kl = rlo.kl_to_reference(new, ref, mask, estimator)
    rows = []
    for b in range(4):
        vals = []
        for t in range(new.shape[1]):
            if mask[b, t]:
                x = new[b, t].item() - ref[b, t].item()
                vals.append(x if estimator == "k1" else math.exp(-x) + x - 1)
        if vals:
            rows.append(sum(vals) / len(vals))
    assert kl.item() == pytest.approx(sum(rows) / len(rows), rel=1e-5)
    kl.backward()
    assert torch.all(new.grad[~mask] == 0)
    assert rlo.kl_to_reference(ref, ref, mask, estimator).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="expected k1 or k3"):
        rlo.kl_to_reference(new, ref, mask, "k2")
