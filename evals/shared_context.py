"""Context-shared log-likelihood scoring: the choices of one question pay for their context once.

A multiple-choice item asks for ``log P(choice | context)`` of every choice after one context (a
question, an image and a question, a clip, an utterance). Scored one request at a time, a 10-way
item runs its context ten times. Here requests are grouped by their context (its tokens after the
adapter's tokenisation and left cut, and the identity of its media), and each group's context runs
once:

  * **one-token continuations** (a digit, a letter, yes/no) are all read from the context's last
    position: one forward answers the whole group;
  * **longer continuations** continue the context's KV cache: the context's keys and values are
    computed once, copied to one row per continuation (:meth:`~ernie5.model.kv_cache.KVCache.select`),
    and each row runs only its own tokens after it.

Contexts are batched ``batch_size`` at a time (right padding, padding in no document), then the
multi-token continuations of those contexts ``batch_size`` rows at a time. The result equals scoring
each request on its own up to floating-point reduction order (tests/evals/test_shared_context.py
checks it against a naive per-request forward on every task family): attention is causal, so a
context's states do not depend on what follows it, and the MoE is dropless, so a token's experts do
not depend on its batch.

What changes for the tallies: a shared context's tokens are routed once, so the expert loads the
adapter reports count each context once per group, not once per choice; a request's latency is
its share of its batch of contexts and continuations.

A continuation's positions and blocks continue its context as the decoding path's do (text after a
prefix at the prefix's largest position + 1, one block per token), which is also what packing the
context and the continuation as one document gives (:func:`ernie5.sequence.segments.pack`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from ernie5.model.inputs import Inputs
from ernie5.model.kv_cache import KVCache
from ernie5.model.model import ModelOutput
from ernie5.sequence.segments import Segment, pack, text_segment
from ernie5.tokenizers.special import PAD
from evals.api import Cost


@dataclass(frozen=True)
class Choice:
    """One request to score: ``cont`` after the document ``context`` (which starts with BOS)."""

    index: int
    """The request's position in the caller's list."""
    key: Hashable
    """Equal for requests whose contexts are the same document."""
    context: list[Segment]
    cont: list[int]


@dataclass(frozen=True)
class Scored:
    """What :func:`score_choices` found for one :class:`Choice`."""

    logprob: float
    greedy: bool
    cost: Cost


RunFn = Callable[[Inputs, torch.Tensor, KVCache | None], ModelOutput]
"""``(inputs, real positions, cache) -> output``: one scoring forward of the sub-model."""


def group_by_context(choices: list[Choice]) -> list[list[Choice]]:
    """Choices grouped by context key, groups in order of first appearance."""
    groups: dict[Hashable, list[Choice]] = {}
    for c in choices:
        groups.setdefault(c.key, []).append(c)
    return list(groups.values())


def score_choices(
    choices: list[Choice],
    run: RunFn,
    new_cache: Callable[[int, int], KVCache],
    batch_size: int,
) -> dict[int, Scored]:
    """``sum log P(cont | context)`` and whether every continuation token is the argmax, per choice
    (keyed by :attr:`Choice.index`); an empty continuation scores ``0.0`` without a forward."""
    out, live = _without_empty(choices)
    groups = sorted(group_by_context(live), key=lambda g: -_length(g[0].context))
    for start in range(0, len(groups), batch_size):
        out.update(_score_groups(groups[start : start + batch_size], run, new_cache, batch_size))
    return out


def score_each(choices: list[Choice], run: RunFn, batch_size: int) -> dict[int, Scored]:
    """The same figures with nothing shared: each choice's whole document (context, then continuation)
    in its own row, ``batch_size`` rows per forward, longest first. How the adapter scored before
    contexts were shared; kept as the baseline of ``ernie5 bench harness`` and for checking."""
    out, live = _without_empty(choices)
    live.sort(key=lambda c: -(_length(c.context) + len(c.cont)))
    for start in range(0, len(live), batch_size):
        part = live[start : start + batch_size]
        t0 = time.perf_counter()
        docs = [[*c.context, text_segment(c.cont)] for c in part]
        lengths = [_length(d) for d in docs]
        inputs = pack(docs, max(lengths), n_rows=len(docs), one_per_row=True).inputs
        logp_BTV = run(inputs, inputs.doc_ids_BT >= 0, None).logits_BTV.float().log_softmax(-1)
        dt = (time.perf_counter() - t0) / len(part)
        for row, (c, length) in enumerate(zip(part, lengths, strict=True)):
            n = len(c.cont)
            tgt = inputs.ids_BT[row, length - n : length]
            lp = logp_BTV[row, length - n - 1 : length - 1]
            greedy = bool((lp.argmax(-1) == tgt).all())
            out[c.index] = Scored(float(lp.gather(-1, tgt[:, None]).sum()), greedy, Cost(dt, length - n, n))
    return out


def _score_groups(
    groups: list[list[Choice]], run: RunFn, new_cache: Callable[[int, int], KVCache], batch_size: int
) -> dict[int, Scored]:
    """One batch of contexts (one row each), then the multi-token continuations after them."""
    t0 = time.perf_counter()
    lengths = [_length(g[0].context) for g in groups]
    width = max(lengths)
    extra = max(len(c.cont) - 1 for g in groups for c in g)
    inputs = pack([g[0].context for g in groups], width, n_rows=len(groups), one_per_row=True).inputs
    real_GT = inputs.doc_ids_BT >= 0
    cache = new_cache(len(groups), width + extra) if extra else None
    ctx_out = run(inputs, real_GT, cache)
    rows_G = torch.arange(len(groups))
    last = torch.tensor(lengths) - 1
    first_GV = ctx_out.logits_BTV[rows_G, last].float().log_softmax(-1)
    # Text after a context continues at its largest position and block + 1 (as in decoding).
    next_pos_G = inputs.positions_3BT.amax(0).masked_fill(~real_GT, -1).amax(1) + 1
    next_blk_G = inputs.block_ids_BT.masked_fill(~real_GT, -1).amax(1) + 1

    found: dict[int, tuple[float, bool]] = {}
    longer: list[tuple[int, Choice]] = []
    for g, group in enumerate(groups):
        for c in group:
            lp = first_GV[g, c.cont[0]]
            found[c.index] = (float(lp), int(first_GV[g].argmax()) == c.cont[0])
            if len(c.cont) > 1:
                longer.append((g, c))
    for s in range(0, len(longer), batch_size):
        part = longer[s : s + batch_size]
        rows = torch.tensor([g for g, _ in part])
        w = max(len(c.cont) - 1 for _, c in part)
        steps_W = torch.arange(w)
        ids_RW = torch.full((len(part), w), PAD, dtype=torch.long)
        doc_RW = torch.full((len(part), w), -1, dtype=torch.long)
        for r, (_, c) in enumerate(part):
            ids_RW[r, : len(c.cont) - 1] = torch.tensor(c.cont[:-1])
            doc_RW[r, : len(c.cont) - 1] = 0
        pos_RW = next_pos_G[rows][:, None] + steps_W
        cont_in = Inputs(
            ids_RW,
            positions_3BT=pos_RW.expand(3, -1, -1).contiguous(),
            doc_ids_BT=doc_RW,
            block_ids_BT=next_blk_G[rows][:, None] + steps_W,
        )
        logp_RWV = run(cont_in, doc_RW >= 0, cache.select(rows)).logits_BTV.float().log_softmax(-1)
        for r, (_, c) in enumerate(part):
            tgt = torch.tensor(c.cont[1:])
            lp = logp_RWV[r, : len(tgt)]
            head_lp, head_greedy = found[c.index]
            tail = float(lp.gather(-1, tgt[:, None]).sum())
            found[c.index] = (head_lp + tail, head_greedy and bool((lp.argmax(-1) == tgt).all()))
    n_members = sum(len(g) for g in groups)
    dt = (time.perf_counter() - t0) / n_members
    return {
        c.index: Scored(*found[c.index], Cost(dt, n, len(c.cont)))
        for group, n in zip(groups, lengths, strict=True)
        for c in group
    }


def _without_empty(choices: list[Choice]) -> tuple[dict[int, Scored], list[Choice]]:
    """The empty continuations' results (``0.0``, no forward) and the choices left to score."""
    empty = {c.index: Scored(0.0, True, Cost(0.0, _length(c.context), 0)) for c in choices if not c.cont}
    return empty, [c for c in choices if c.cont]


def rolling_windows(toks: list[int], max_len: int) -> list[tuple[list[int], int]]:
    """A document's scoring windows: ``(tokens, n scored at its end)``, the first ``max_len + 1``
    tokens whole, then strides of half a window, each with a full window of left context where it has
    one (every token after the first window sees at least half a window)."""
    window, stride = max_len + 1, max(1, max_len // 2)
    out = [(toks[:window], min(len(toks), window) - 1)]
    done = min(len(toks), window)
    while done < len(toks):
        end = min(len(toks), done + stride)
        out.append((toks[max(0, end - window) : end], end - done))
        done = end
    return out


def _length(doc: list[Segment]) -> int:
    return sum(len(s) for s in doc)
