"""Which rollouts an RL iteration trains on: the Unbiased Replay Buffer, APRIL, and synchronous RL.

Queries form one ordered stream; query ``q`` belongs to iteration group ``D_{q // Q}`` (``Q`` queries per
step, ``G`` responses each). An *engine* advances rollouts in rounds (``advance(rollouts, budget)``:
at most ``budget`` decode steps for every unfinished rollout given, resuming partial responses with the
current weights and keeping the behaviour log-probs of the tokens already sampled). The three schedulers
differ only in which rollouts are in flight and when an iteration's batch is ready:

* ``sync``: iteration t launches D_t and generates until its longest response ends, then trains on D_t.
  The decode slots of responses that ended early idle until then.
* ``urb`` (ERNIE 5.0 U-RB): D_t .. D_{t+lookahead-1} are in flight; rounds of ``chunk`` steps run over all
  of them, and iteration t trains on **exactly D_t** as soon as all of D_t has finished. Responses of later
  groups keep running ahead (filling the slots that D_t's short responses freed) and are resumed, under
  newer weights, in later rounds. The trained sequence of groups is the data order, whatever the lengths.
* ``april`` (APRIL): ``over_provision x Q`` queries are in flight; after each round the first ``Q`` groups
  to have finished are trained on (ties by stream order), the rest stay in the buffer and are resumed
  first. Short, easy queries finish first, so the trained batches over-represent them.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §4.1 and Fig. 5 (U-RB against APRIL).
  * APRIL, Zhou et al. 2025 (arXiv 2509.18521): over-provisioned rollouts, abort and recycle partials.

Deviations:
  1. One process generates and trains in turn (no separate inference pool): "in flight" means a rollout
     the engine advances in its rounds; a round's decode slots are rows x steps, and the learner's idle
     time is the generation time between two updates.
  2. A partial response is resumed by re-encoding its prompt and tokens with the current weights (the
     behaviour log-probs of the earlier tokens are kept, tagged with the policy version that sampled them),
     which is what an inference engine does after a weight update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Mode = Literal["urb", "april", "sync"]


@dataclass
class Rollout:
    """One response to one query, possibly unfinished."""

    query: int
    """Stream index of the query (its group is ``query // Q``)."""
    sample: int
    """Which of the query's ``G`` responses."""
    hint: list[int] = field(default_factory=list)
    """AHRL hint ids appended to the prompt at launch (prompt, not response: no loss)."""
    tokens: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    """Behaviour log-prob of each token when it was sampled."""
    versions: list[int] = field(default_factory=list)
    """Policy version (iteration) that sampled each token."""
    done: bool = False
    truncated: bool = False
    """Stopped by the token budget rather than by EOS or a stop string."""
    finished_round: int = -1
    routing: dict[int, torch.Tensor] = field(default_factory=dict)
    """MoE layer -> ``(n_fed, A)`` expert ids of every position the engine fed (prompt, hint and all tokens
    but the last), from the latest forward over each position."""

    def to_json(self) -> dict:
        """Everything but ``routing`` (saved as tensors)."""
        return {
            "query": self.query,
            "sample": self.sample,
            "hint": self.hint,
            "tokens": self.tokens,
            "logp": self.logp,
            "versions": self.versions,
            "done": self.done,
            "truncated": self.truncated,
            "finished_round": self.finished_round,
        }

    @classmethod
    def from_json(cls, d: dict, routing: dict[int, torch.Tensor]) -> Rollout:
        return cls(**d, routing=routing)


@dataclass
class BatchStats:
    """What producing one iteration's batch cost."""

    rounds: int = 0
    decode_steps: int = 0
    """Engine decode steps (the inference engine's clock)."""
    slots: int = 0
    """Rows x decode steps of every round."""
    tokens: int = 0
    """Tokens sampled in those rounds (the useful share of the slots)."""

    @property
    def slot_utilisation(self) -> float:
        return self.tokens / self.slots if self.slots else 1.0


Advance = Callable[[list[Rollout], int, int], tuple[int, int]]
"""``advance(rollouts, budget, round) -> (decode_steps, tokens_sampled)``: extend the unfinished rollouts."""


class ReplayBuffer:
    """The rollouts in flight and the rule that picks each iteration's batch (see the module docstring)."""

    def __init__(
        self,
        mode: Mode,
        queries_per_step: int,
        group_size: int,
        *,
        lookahead: int = 2,
        over_provision: float = 2.0,
        chunk: int = 8,
        full_budget: int = 1 << 30,
    ) -> None:
        if mode not in ("urb", "april", "sync"):
            raise ValueError(f"rollout scheduler {mode!r}: expected urb, april or sync")
        self.mode = mode
        self.Q, self.G = queries_per_step, group_size
        self.lookahead, self.over, self.chunk = lookahead, over_provision, chunk
        self.full_budget = full_budget
        self.inflight: dict[int, list[Rollout]] = {}
        self.next_query = 0
        self.round = 0
        self.step = 0

    # ------------------------------------------------------------------ state
    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """JSON state and routing tensors (for a checkpoint)."""
        rollouts, tensors = [], {}
        for q in sorted(self.inflight):
            for r in self.inflight[q]:
                rollouts.append(r.to_json())
                for layer, ids in r.routing.items():
                    tensors[f"routing/{r.query}/{r.sample}/{layer}"] = ids
        return {
            "next_query": self.next_query,
            "round": self.round,
            "step": self.step,
            "rollouts": rollouts,
        }, tensors

    def load_state(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.next_query, self.round, self.step = state["next_query"], state["round"], state["step"]
        self.inflight = {}
        for d in state["rollouts"]:
            prefix = f"routing/{d['query']}/{d['sample']}/"
            routing = {int(k[len(prefix) :]): v for k, v in tensors.items() if k.startswith(prefix)}
            self.inflight.setdefault(d["query"], []).append(Rollout.from_json(d, routing))

    # ------------------------------------------------------------------ batches
    def _launch(self, upto: int, launch: Callable[[int], list[Rollout]]) -> None:
        while self.next_query < upto:
            self.inflight[self.next_query] = launch(self.next_query)
            self.next_query += 1

    def _finished(self, q: int) -> bool:
        return all(r.done for r in self.inflight[q])

    def _run_round(self, queries: list[int], budget: int, advance: Advance, stats: BatchStats) -> None:
        todo = [r for q in queries for r in self.inflight[q] if not r.done]
        if not todo:
            return
        steps, tokens = advance(todo, budget, self.round)
        for r in todo:
            if r.done and r.finished_round < 0:
                r.finished_round = self.round
        self.round += 1
        stats.rounds += 1
        stats.decode_steps += steps
        stats.slots += steps * len(todo)
        stats.tokens += tokens

    def next_batch(
        self, launch: Callable[[int], list[Rollout]], advance: Advance
    ) -> tuple[list[list[Rollout]], BatchStats]:
        """The next iteration's batch (one list of ``G`` finished rollouts per query, in stream order for
        ``urb``/``sync``, in finishing order for ``april``) and what producing it cost."""
        stats = BatchStats()
        t, Q = self.step, self.Q
        if self.mode == "sync":
            self._launch((t + 1) * Q, launch)
            group = list(range(t * Q, (t + 1) * Q))
            while not all(self._finished(q) for q in group):
                self._run_round(group, self.full_budget, advance, stats)
            picked = group
        elif self.mode == "urb":
            self._launch((t + self.lookahead) * Q, launch)
            group = list(range(t * Q, (t + 1) * Q))
            while not all(self._finished(q) for q in group):
                self._run_round(sorted(self.inflight), self.chunk, advance, stats)
            picked = group
        else:
            target = math.ceil(self.over * Q)
            while True:
                self._launch(self.next_query + max(0, target - len(self.inflight)), launch)
                ready = [q for q in self.inflight if self._finished(q)]
                if len(ready) >= Q:
                    ready.sort(key=lambda q: (max(r.finished_round for r in self.inflight[q]), q))
                    picked = sorted(ready[:Q])
                    break
                self._run_round(sorted(self.inflight), self.chunk, advance, stats)
        batch = [self.inflight.pop(q) for q in picked]
        self.step += 1
        return batch, stats


class OutputRollouts:
    """What the rollouts of one output (text, image, speech: :mod:`train.rl.rollout_text` and its
    siblings) share: each query's prompt, built once by :meth:`make_prompt` from the query
    ``query_of`` gives, and the rounds of the output's ``engine``."""

    engine: Any

    def __init__(self, query_of: Callable[[int], Any]) -> None:
        self.query_of = query_of
        self._prompts: dict[int, Any] = {}

    def make_prompt(self, query: Any) -> Any:
        """The engine's prompt for ``query``."""
        raise NotImplementedError

    def prompt(self, r: Rollout) -> Any:
        """The prompt of ``r``'s query (built once per query).

        Built outside inference mode even when the engine asks for it while sampling: the learner
        differentiates through the prompt's media features (an fp32 learner feeds the cached pixels
        to the vision encoder as they are, and autograd cannot save an inference tensor)."""
        if r.query not in self._prompts:
            with torch.inference_mode(False), torch.no_grad():
                self._prompts[r.query] = self.make_prompt(self.query_of(r.query))
        return self._prompts[r.query]

    def forget(self, queries) -> None:
        """Drop the prompts of ``queries`` (all of them for None)."""
        if queries is None:
            self._prompts.clear()
        for q in queries or ():
            self._prompts.pop(q, None)

    def advance(self, rollouts: list[Rollout], budget: int, round_: int, subnet, version: int):
        """One round of the engine over ``rollouts``."""
        return self.engine.advance(rollouts, budget, round_, subnet, version)
