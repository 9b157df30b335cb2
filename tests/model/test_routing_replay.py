"""Rollout Routing Replay (R3, arXiv 2510.11370): ``Ernie5Model.forward(..., routing_replay=...)``.

The RL property: a learner's full-sequence forward over prompt + response, replaying the expert ids
that the rollout's KV-cache decoding chose, uses exactly those experts and reproduces the rollout's
log-probs, even when the router's selection bias moved in between; without replay it does not.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ernie5.fast import apply_fast_paths
from ernie5.model.model import Ernie5Model
from ernie5.model.moe import MoE, select_experts
from ernie5.subnets.spec import SubnetSpec, resolve
from tests.conftest import tiny_config

B, T_PROMPT, T_RESP = 2, 5, 7


def _model(fast: bool = False, **overrides) -> Ernie5Model:
    torch.manual_seed(0)
    m = Ernie5Model(tiny_config(**overrides)).eval()
    return apply_fast_paths(m) if fast else m


def _ids(b: int = B, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))


def _replay_of(out, b: int, t: int) -> dict[int, torch.Tensor]:
    return {i: r.expert_ids_NA.view(b, t, -1).clone() for i, r in out.routing.items()}


def _moe_layers(m: Ernie5Model) -> list[MoE]:
    return [blk.ffn for blk in m.layers if isinstance(blk.ffn, MoE)]


def _perturb_bias(m: Ernie5Model, scale: float = 5e-3, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for moe in _moe_layers(m):
            moe.router_bias.add_(scale * torch.randn(moe.router_bias.shape, generator=g))


@pytest.mark.parametrize("fast", [False, True])
def test_replaying_the_chosen_ids_changes_nothing(fast):
    m = _model(fast)
    ids = _ids()
    with torch.no_grad():
        out = m(ids)
        replay = _replay_of(out, *ids.shape)
        again = m(ids, routing_replay=replay)
    for i, r in out.routing.items():
        assert torch.equal(again.routing[i].expert_ids_NA, r.expert_ids_NA)
        assert torch.equal(again.routing[i].counts_E, r.counts_E)
    if fast:  # the fused router may round gates differently from the reference select_experts
        torch.testing.assert_close(again.logits_BTV, out.logits_BTV, atol=1e-6, rtol=0)
    else:
        assert torch.equal(again.logits_BTV, out.logits_BTV)


def test_rows_of_minus_one_route_normally_and_forced_rows_are_kept():
    m = _model()
    ids = _ids()
    with torch.no_grad():
        out = m(ids)
        moved = copy.deepcopy(m)
        _perturb_bias(moved, scale=0.05)
        other = _replay_of(moved(ids), *ids.shape)  # a different selection to force
        replay = {}
        for i, forced in other.items():
            forced = forced.clone()
            forced[:, ::2] = -1  # even positions routed normally
            replay[i] = forced
        got = m(ids, routing_replay=replay)
    for i, r in got.routing.items():
        got_BTA = r.expert_ids_NA.view(*ids.shape, -1)
        assert torch.equal(got_BTA[:, 1::2], other[i][:, 1::2])  # odd: forced, in slot order
    first = min(replay)  # before any forced layer the hidden states agree: so do even rows' ids
    assert torch.equal(
        got.routing[first].expert_ids_NA.view(*ids.shape, -1)[:, ::2],
        out.routing[first].expert_ids_NA.view(*ids.shape, -1)[:, ::2],
    )


def test_forced_gates_are_the_current_scores_at_the_forced_ids():
    """softmax/sigmoid of the current logits (subnet-masked), renormalised, times route_scale; counts
    count the forced selection; the bias plays no part."""
    torch.manual_seed(3)
    for score_func, norm_topk, scale in (
        ("softmax", True, 1.0),
        ("sigmoid", True, 2.5),
        ("softmax", False, 1.0),
    ):
        cfg = tiny_config(moe=dict(score_func=score_func, norm_topk=norm_topk, route_scale=scale)).moe
        logits = torch.randn(6, 8)
        mask = torch.tensor([True] * 6 + [False] * 2)
        forced = torch.tensor([[0, 5], [-1, -1], [3, 1], [2, 4], [-1, -1], [5, 0]])
        bias = torch.randn(8)
        r = select_experts(logits, bias, cfg, 2, mask, 6, forced)
        normal = select_experts(logits, bias, cfg, 2, mask, 6)
        rows = forced[:, 0] >= 0
        assert torch.equal(r.expert_ids_NA[rows], forced[rows])
        assert torch.equal(r.expert_ids_NA[~rows], normal.expert_ids_NA[~rows])
        if score_func == "softmax":
            scores = logits.masked_fill(~mask, float("-inf")).softmax(-1)
        else:
            scores = logits.sigmoid().masked_fill(~mask, 0.0)
        g = scores.gather(-1, r.expert_ids_NA)
        if norm_topk:
            g = g / g.sum(-1, keepdim=True)
        torch.testing.assert_close(r.gates_NA, g * scale)
        assert torch.equal(r.counts_E, torch.bincount(r.expert_ids_NA.flatten(), minlength=8))


def _rollout(m: Ernie5Model, prompt: torch.Tensor, n_new: int, seed: int = 5):
    """Sample ``n_new`` tokens with a KV cache (prefill, then one token per forward); returns the
    response, each sampled token's log-prob, and per layer the ``(B, T_prompt + n_new - 1, A)``
    expert ids of every fed position."""
    b, t0 = prompt.shape
    gen = torch.Generator().manual_seed(seed)
    cache = m.new_cache(b, t0 + n_new)
    routed: dict[int, list[torch.Tensor]] = {}
    toks, logps = [], []
    with torch.no_grad():
        out = m(prompt, cache=cache)
        for step in range(n_new):
            for i, r in out.routing.items():
                routed.setdefault(i, []).append(r.expert_ids_NA.view(b, -1, r.expert_ids_NA.shape[-1]))
            logp = out.logits_BTV[:, -1].float().log_softmax(-1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)  # (B, 1)
            toks.append(tok)
            logps.append(logp.gather(-1, tok))
            if step < n_new - 1:
                out = m(tok, cache=cache)
    ids = {i: torch.cat(chunks, dim=1) for i, chunks in routed.items()}
    return torch.cat(toks, 1), torch.cat(logps, 1), ids


def _learner(m: Ernie5Model, seq: torch.Tensor, t0: int, replay=None):
    with torch.no_grad():
        out = m(seq, routing_replay=replay)
    logp = out.logits_BTV.float().log_softmax(-1)[:, t0 - 1 : -1]
    b, t = seq.shape
    return logp.gather(-1, seq[:, t0:, None])[..., 0], _replay_of(out, b, t)


@pytest.mark.parametrize("fast", [False, True])
def test_learner_replays_the_rollout_routing(fast):
    rollout_model = _model(fast)
    prompt = _ids(t=T_PROMPT, seed=2)
    resp, rollout_logp, rollout_ids = _rollout(rollout_model, prompt, T_RESP)
    seq = torch.cat([prompt, resp], 1)
    t = seq.shape[1]
    replay = {}
    for i, ids in rollout_ids.items():
        assert ids.shape[:2] == (B, t - 1)
        replay[i] = torch.cat([ids, torch.full_like(ids[:, :1], -1)], 1)  # the last token was never fed

    # The learner's weights equal the rollout's, but its selection bias moved (e.g. a balancing step).
    learner = copy.deepcopy(rollout_model)
    _perturb_bias(learner)

    logp_free, ids_free = _learner(learner, seq, T_PROMPT)
    flipped = sum(
        int((ids_free[i][:, :-1].sort(-1).values != rollout_ids[i].sort(-1).values).any(-1).sum())
        for i in replay
    )
    assert flipped > 0, "the perturbation should flip some near-tie selections"
    assert (logp_free - rollout_logp).abs().max() > 1e-5

    logp_replay, ids_replay = _learner(learner, seq, T_PROMPT, replay)
    for i in replay:
        assert torch.equal(ids_replay[i][:, :-1], rollout_ids[i])
    torch.testing.assert_close(logp_replay, rollout_logp, atol=1e-5, rtol=0)


def test_router_gets_gradient_under_replay():
    m = _model().train()
    ids = _ids()
    moved = copy.deepcopy(m)
    _perturb_bias(moved, scale=0.05)
    with torch.no_grad():
        replay = _replay_of(moved(ids), *ids.shape)
    out = m(ids, targets=ids.roll(-1, 1), routing_replay=replay)
    out.losses.text.backward()
    for i, moe in enumerate(_moe_layers(m)):
        g = moe.router.weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0, i
        assert torch.equal(out.routing[i].expert_ids_NA.view(*ids.shape, -1), replay[i])


def test_replay_under_a_subnet():
    m = _model()
    sub = resolve(SubnetSpec(width=4, top_k=1), m.cfg)
    ids = _ids()
    with torch.no_grad():
        out = m(ids, subnet=sub)
        again = m(ids, subnet=sub, routing_replay=_replay_of(out, *ids.shape))
    assert torch.equal(again.logits_BTV, out.logits_BTV)


def _one_line_error(fn, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_bad_replays_are_one_line_value_errors():
    m = _model(n_dense_layers=1)
    ids = _ids()
    b, t = ids.shape
    with torch.no_grad():
        good = _replay_of(m(ids), b, t)
    layer = min(good)

    def run(replay, **kw):
        with torch.no_grad():
            m(ids, routing_replay=replay, **kw)

    _one_line_error(lambda: run({layer: good[layer][..., :1]}), r"expected \(B, T, top_k\)")  # A != top_k
    _one_line_error(lambda: run({layer: torch.cat([good[layer]] * 2, -1)}), r"expected \(B, T, top_k\)")
    _one_line_error(lambda: run({layer: good[layer][:, :-1]}), r"expected \(B, T, top_k\)")  # T
    _one_line_error(lambda: run({0: good[layer]}), "not MoE layers")  # a dense layer
    _one_line_error(lambda: run({99: good[layer]}), "not MoE layers")
    mixed = good[layer].clone()
    mixed[0, 0, 0] = -1
    _one_line_error(lambda: run({layer: mixed}), "mixes -1")
    big = good[layer].clone()
    big[0, 0, 0] = 8
    _one_line_error(lambda: run({layer: big}), "n_experts")
    dup = good[layer].clone()
    dup[0, 0, 1] = dup[0, 0, 0]
    _one_line_error(lambda: run({layer: dup}), "repeats")

    sub = resolve(SubnetSpec(width=4, top_k=2), m.cfg)
    masked = next(e for e in range(8) if e not in sub.experts[layer])
    kept = sub.experts[layer]
    forced = torch.tensor([kept[0], kept[1]]).expand(b, t, 2).clone()
    run({layer: forced}, subnet=sub)  # available experts: fine
    forced[1, 3, 1] = masked
    _one_line_error(lambda: run({layer: forced}, subnet=sub), "masked out by the subnet")
    skipped = resolve(SubnetSpec(depth=2), m.cfg)
    gone = next(i for i in range(1, 4) if i not in skipped.layers)
    _one_line_error(lambda: run({gone: good[gone]}, subnet=skipped), "not MoE layers kept")
