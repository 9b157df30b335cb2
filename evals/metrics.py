"""Metrics as pure functions: per-example scores, aggregates with standard errors, and paired tests.

No I/O, no models, no global state; every random function takes an explicit ``seed``.

* per example: :func:`exact_match`, :func:`choice_accuracy` (``acc`` / ``acc_norm``);
* aggregate: :func:`mean_stderr`, :func:`bits_per_byte`, :func:`corpus_bits_per_byte`,
  :func:`corpus_error_rate` (WER/CER from per-utterance :func:`word_errors` / :func:`char_errors`),
  :func:`bootstrap_stderr`;
* comparing two runs on the same examples (aligned by example id): :func:`paired_bootstrap`,
  :func:`mcnemar`.

References:
  - lm-eval ``acc_norm``: argmax of the log-likelihood divided by the byte length of the choice text.
  - Paired bootstrap: Koehn (2004), "Statistical Significance Tests for Machine Translation Evaluation";
    the p-value here uses the null-centred bootstrap distribution (Efron & Tibshirani 1993, 16.4).
  - WER/CER: Levenshtein alignment by jiwer (``process_words`` / ``process_characters``); the corpus
    rate is total edits over total reference words (characters), as in Seed-TTS-eval and jiwer's own
    corpus mode, not a mean of per-utterance rates.
  - McNemar (1947); exact binomial test on the discordant pairs when there are fewer than 25,
    chi-square with continuity correction (Edwards 1948) otherwise.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

T = TypeVar("T")

MCNEMAR_EXACT_BELOW = 25
"""Discordant-pair count under which :func:`mcnemar` uses the exact binomial test."""

_SPACES = re.compile(r"\s+")


def normalize_answer(text: str) -> str:
    """Lower-case, collapse whitespace, strip, and drop trailing periods: ``" True. "`` -> ``"true"``.

    Other punctuation is kept on purpose: BBH answers such as ``"(B)"`` or ``"] )"`` are punctuation.
    """
    return _SPACES.sub(" ", text).strip().rstrip(".").strip().lower()


def exact_match(prediction: str, reference: str, *, normalize: bool = True) -> float:
    """1.0 if the prediction equals the reference (after :func:`normalize_answer` by default), else 0.0."""
    if normalize:
        prediction, reference = normalize_answer(prediction), normalize_answer(reference)
    return float(prediction == reference)


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value; the first one wins ties (as ``numpy.argmax``)."""
    if not values:
        raise ValueError("argmax of an empty sequence")
    return max(range(len(values)), key=lambda i: (values[i], -i))


def choice_accuracy(logprobs: Sequence[float], gold: int, lengths: Sequence[int] | None = None) -> float:
    """Multiple-choice accuracy: 1.0 if the gold choice has the highest score.

    Args:
        logprobs: log P(choice | context) for each choice.
        gold: index of the correct choice.
        lengths: if given, scores are ``logprob / length`` (``acc_norm``; lm-eval uses the byte length
            of the choice text).
    """
    if lengths is not None:
        if len(lengths) != len(logprobs):
            raise ValueError(f"{len(lengths)} lengths for {len(logprobs)} choices")
        logprobs = [lp / max(n, 1) for lp, n in zip(logprobs, lengths)]
    return float(argmax(logprobs) == gold)


def mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, stderr)`` with stderr = sample standard deviation (ddof=1) / sqrt(n); NaN stderr if n < 2."""
    if len(values) == 0:
        raise ValueError("mean_stderr of no values")
    x = np.asarray(values, dtype=np.float64)
    if len(x) < 2:
        return float(x[0]), float("nan")
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x)))


def bits_per_byte(total_nll_nats: float, total_bytes: int) -> float:
    """Corpus bits per byte: total negative log-likelihood (nats) / ln 2 / total UTF-8 bytes."""
    if total_bytes <= 0:
        raise ValueError(f"total_bytes={total_bytes} must be positive")
    return total_nll_nats / math.log(2) / total_bytes


def corpus_bits_per_byte(items: Sequence[tuple[float, int]]) -> float:
    """:func:`bits_per_byte` over per-document ``(nll_nats, n_bytes)`` pairs (sums, not a mean of ratios)."""
    return bits_per_byte(sum(nll for nll, _ in items), sum(n for _, n in items))


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """``(substitutions + deletions + insertions, reference words)`` of one utterance (both sides
    already normalised; an empty hypothesis deletes every word)."""
    import jiwer

    ref = reference.split()
    if not ref:
        raise ValueError("word_errors: the reference has no words")
    if not hypothesis.split():
        return len(ref), len(ref)
    o = jiwer.process_words(" ".join(ref), " ".join(hypothesis.split()))
    return o.substitutions + o.deletions + o.insertions, len(ref)


def char_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """``(character edits, reference characters)`` of one utterance, spaces included (jiwer's CER)."""
    import jiwer

    ref = " ".join(reference.split())
    if not ref:
        raise ValueError("char_errors: the reference is empty")
    hyp = " ".join(hypothesis.split())
    if not hyp:
        return len(ref), len(ref)
    o = jiwer.process_characters(ref, hyp)
    return o.substitutions + o.deletions + o.insertions, len(ref)


def corpus_error_rate(items: Sequence[tuple[int, int]]) -> float:
    """Corpus WER/CER: total edits over total reference units of per-utterance ``(edits, n)`` pairs."""
    total = sum(n for _, n in items)
    return sum(e for e, _ in items) / total if total else 0.0


def bootstrap_stderr(fn: Callable[[list[T]], float], items: Sequence[T], seed: int, n: int = 1000) -> float:
    """Standard deviation of ``fn`` over ``n`` resamples (with replacement) of ``items``.

    Used for corpus-level metrics (bits per byte, corpus WER) that are not means of per-example values.
    Deterministic for a given ``seed``. NaN if there are fewer than 2 items.
    """
    if len(items) < 2:
        return float("nan")
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, len(items), size=(n, len(items)))
    stats = [fn([items[i] for i in row]) for row in indices]
    return float(np.std(stats, ddof=1))


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], seed: int, n: int = 10_000, ci: float = 0.95
) -> tuple[float, float, float, float]:
    """Paired bootstrap of ``mean(a) - mean(b)`` where ``a[i]`` and ``b[i]`` score the same example.

    Returns:
        ``(delta, ci_low, ci_high, p_value)``: the observed difference, the percentile confidence
        interval at level ``ci``, and a two-sided p-value for "no difference": the share of resampled
        differences, re-centred on 0, at least as far from 0 as the observed one (with +1 smoothing, so
        never exactly 0).
    """
    if len(a) != len(b):
        raise ValueError(f"paired_bootstrap needs aligned samples, got {len(a)} and {len(b)}")
    if len(a) == 0:
        raise ValueError("paired_bootstrap of no samples")
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    delta = float(diff.mean())
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(n, len(diff)))].mean(axis=1)
    alpha = (1.0 - ci) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    extreme = np.count_nonzero(np.abs(means - delta) >= abs(delta) - 1e-12)
    return delta, float(low), float(high), float((extreme + 1) / (n + 1))


def _binomial_two_sided(k: int, n: int) -> float:
    """Exact two-sided p-value of k successes in n fair coin flips (doubling the smaller tail)."""
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return min(1.0, 2.0 * tail)


def mcnemar(a_correct: Sequence[bool | float], b_correct: Sequence[bool | float]) -> float:
    """Two-sided McNemar p-value for paired correctness (1/0 per example) of systems A and B.

    Only discordant pairs count: ``n01`` (A right, B wrong) and ``n10`` (A wrong, B right). With fewer
    than :data:`MCNEMAR_EXACT_BELOW` of them the exact binomial test is used, otherwise the chi-square
    statistic ``max(|n01 - n10| - 1, 0)^2 / (n01 + n10)`` with one degree of freedom. 1.0 if none disagree.
    """
    if len(a_correct) != len(b_correct):
        raise ValueError(f"mcnemar needs aligned samples, got {len(a_correct)} and {len(b_correct)}")
    n01 = sum(1 for x, y in zip(a_correct, b_correct) if x and not y)
    n10 = sum(1 for x, y in zip(a_correct, b_correct) if y and not x)
    discordant = n01 + n10
    if discordant == 0:
        return 1.0
    if discordant < MCNEMAR_EXACT_BELOW:
        return _binomial_two_sided(n01, discordant)
    chi2 = max(abs(n01 - n10) - 1, 0) ** 2 / discordant
    return math.erfc(math.sqrt(chi2 / 2.0))  # survival function of chi-square with 1 dof
