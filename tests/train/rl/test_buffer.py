"""The replay buffer's ordering invariant and bias: U-RB and sync train exactly D_t at step t, APRIL
trains whatever finished first, under a long-tailed response-length distribution."""

from __future__ import annotations

import random

import pytest
import torch

from train.rl.buffer import ReplayBuffer, Rollout

Q, G = 4, 3


def _length(query: int, sample: int) -> int:
    """A long-tailed length: most responses short, one query in five very long."""
    rng = random.Random(f"{query}/{sample}")
    return 40 + rng.randrange(20) if query % 5 == 3 else 1 + rng.randrange(4)


def _launch(q: int) -> list[Rollout]:
    return [Rollout(q, s) for s in range(G)]


def _advance(rollouts: list[Rollout], budget: int, round_: int) -> tuple[int, int]:
    steps = tokens = 0
    for r in rollouts:
        n = min(budget, _length(r.query, r.sample) - len(r.tokens))
        r.tokens += [7] * n
        r.logp += [-0.5] * n
        r.versions += [round_] * n
        r.routing = {0: torch.zeros(len(r.tokens), 2, dtype=torch.int16)}
        r.done = len(r.tokens) == _length(r.query, r.sample)
        steps, tokens = max(steps, n), tokens + n
    return steps, tokens


@pytest.mark.parametrize("mode", ["urb", "sync"])
def test_trained_groups_are_the_data_order_whatever_the_lengths(mode):
    buf = ReplayBuffer(mode, Q, G, lookahead=3, chunk=4)
    for t in range(6):
        batch, stats = buf.next_batch(_launch, _advance)
        assert [g[0].query for g in batch] == list(range(t * Q, (t + 1) * Q))
        assert all(len(g) == G and all(r.done for r in g) for g in batch)
        assert all(len(r.tokens) == _length(r.query, r.sample) for g in batch for r in g)
        assert stats.tokens <= stats.slots


def test_april_over_represents_short_queries_and_urb_does_not():
    def trained(mode: str) -> list[int]:
        buf = ReplayBuffer(mode, Q, G, lookahead=2, over_provision=2.0, chunk=4)
        return [g[0].query for _ in range(8) for g in buf.next_batch(_launch, _advance)[0]]

    long_share = {m: sum(q % 5 == 3 for q in trained(m)) / (8 * Q) for m in ("urb", "april")}
    data_share = sum(q % 5 == 3 for q in range(8 * Q)) / (8 * Q)
    assert long_share["urb"] == data_share
    assert long_share["april"] < data_share


def test_urb_keeps_the_slots_fuller_than_sync():
    util = {}
    for mode in ("urb", "sync"):
        buf = ReplayBuffer(mode, Q, G, lookahead=3, chunk=4)
        tokens = slots = 0
        for _ in range(6):
            _, st = buf.next_batch(_launch, _advance)
            tokens, slots = tokens + st.tokens, slots + st.slots
        util[mode] = tokens / slots
    assert util["urb"] > util["sync"]


def test_state_round_trip_continues_identically():
    a = ReplayBuffer("urb", Q, G, lookahead=3, chunk=4)
    a.next_batch(_launch, _advance)
    state, tensors = a.state()
    b = ReplayBuffer("urb", Q, G, lookahead=3, chunk=4)
    b.load_state(state, tensors)
    for _ in range(3):
        ga, _ = a.next_batch(_launch, _advance)
        gb, _ = b.next_batch(_launch, _advance)
        assert [[r.to_json() for r in g] for g in ga] == [[r.to_json() for r in g] for g in gb]


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="rollout scheduler 'fifo'"):
        ReplayBuffer("fifo", Q, G)  # type: ignore[arg-type]
