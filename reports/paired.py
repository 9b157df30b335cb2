"""Paired tests of one metric between two runs on the same examples, and a multiple-test correction.

* Per-example values that are all 0/1 (``acc``, ``exact_match``) are tested with McNemar's test;
  the interval on the difference still comes from the paired bootstrap.
* Other per-example values are tested with the paired bootstrap of the mean difference
  (:func:`evals.metrics.paired_bootstrap`).
* Corpus metrics, whose per-example values are ``[numerator, denominator]`` (bits per byte:
  ``[nll_nats, n_bytes]``), are tested with a paired bootstrap of the corpus value
  ``scale * sum(num) / sum(den)``, resampling examples jointly for both runs.
* A night compares many (subnet, task, metric) cells; with 40 cells at p < 0.05 two would be
  flagged by chance alone. P-values are therefore Holm-adjusted over all cells of a comparison,
  which keeps the chance of any false alarm at ``alpha``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from reports.contract import metrics

ALPHA = 0.05
BOOTSTRAP_ITERS = 10_000
CORPUS_SCALE = {"bits_per_byte": 1.0 / math.log(2)}
"""Factor applied to ``sum(num) / sum(den)`` of a corpus metric (nats -> bits)."""


def is_binary(values: Sequence[float]) -> bool:
    """Whether every value is 0 or 1 (an accuracy-type metric)."""
    return len(values) > 0 and all(v in (0.0, 1.0) for v in values)


def corpus_bootstrap(
    new: Sequence[Sequence[float]],
    base: Sequence[Sequence[float]],
    scale: float,
    seed: int,
    n: int = BOOTSTRAP_ITERS,
    ci: float = 0.95,
) -> tuple[float, float, float, float]:
    """Paired bootstrap of ``corpus(new) - corpus(base)``, ``corpus = scale * sum(num) / sum(den)``.

    Returns:
        ``(delta, ci_low, ci_high, p_value)`` with the conventions of
        :func:`evals.metrics.paired_bootstrap` (null-centred, +1-smoothed p-value).
    """
    if len(new) != len(base) or not new:
        raise ValueError(f"corpus_bootstrap needs aligned, non-empty samples ({len(new)} vs {len(base)})")
    a, b = np.asarray(new, dtype=np.float64), np.asarray(base, dtype=np.float64)
    delta = scale * (a[:, 0].sum() / a[:, 1].sum() - b[:, 0].sum() / b[:, 1].sum())
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n, len(a)))
    stats = scale * (a[idx, 0].sum(1) / a[idx, 1].sum(1) - b[idx, 0].sum(1) / b[idx, 1].sum(1))
    alpha = (1.0 - ci) / 2.0
    low, high = np.quantile(stats, [alpha, 1.0 - alpha])
    extreme = np.count_nonzero(np.abs(stats - delta) >= abs(delta) - 1e-12)
    return float(delta), float(low), float(high), float((extreme + 1) / (n + 1))


def paired_test(
    new: Sequence[float | Sequence[float]],
    base: Sequence[float | Sequence[float]],
    metric: str,
    seed: int = 0,
    n: int = BOOTSTRAP_ITERS,
) -> dict[str, float | str]:
    """Test ``new`` against ``base`` on aligned per-example values of ``metric``.

    Args:
        new: per-example values of the new run (floats, or ``[num, den]`` for corpus metrics).
        base: the baseline's values for the same examples, in the same order.
        metric: the metric's name (selects the corpus scale).
        seed: bootstrap seed.
        n: bootstrap resamples.

    Returns:
        ``{"delta", "ci_low", "ci_high", "p_value", "method"}``; delta is ``new - base`` in the
        metric's units, method one of ``mcnemar``, ``bootstrap``, ``corpus-bootstrap``.
    """
    if new and isinstance(new[0], list | tuple):
        delta, low, high, p = corpus_bootstrap(new, base, CORPUS_SCALE.get(metric, 1.0), seed, n)  # type: ignore[arg-type]
        return {"delta": delta, "ci_low": low, "ci_high": high, "p_value": p, "method": "corpus-bootstrap"}
    a, b = [float(x) for x in new], [float(x) for x in base]  # type: ignore[arg-type]
    delta, low, high, p = metrics.paired_bootstrap(a, b, seed=seed, n=n)
    if is_binary(a) and is_binary(b):
        return {
            "delta": delta,
            "ci_low": low,
            "ci_high": high,
            "p_value": metrics.mcnemar(a, b),
            "method": "mcnemar",
        }
    return {"delta": delta, "ci_low": low, "ci_high": high, "p_value": p, "method": "bootstrap"}


def unpaired_test(new: float, new_se: float, base: float, base_se: float) -> dict[str, float | str]:
    """Two-sided z-test from the runs' stderrs, for cells without aligned samples."""
    delta = new - base
    se = math.sqrt(new_se**2 + base_se**2)
    if math.isnan(se) or se == 0:
        p = 1.0 if delta == 0 else math.nan
        return {
            "delta": delta,
            "ci_low": math.nan,
            "ci_high": math.nan,
            "p_value": p,
            "method": "z (unpaired)",
        }
    half = 1.959964 * se
    p = math.erfc(abs(delta) / se / math.sqrt(2.0))
    return {
        "delta": delta,
        "ci_low": delta - half,
        "ci_high": delta + half,
        "p_value": p,
        "method": "z (unpaired)",
    }


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (NaN stays NaN and is not counted)."""
    p = np.asarray(p_values, dtype=np.float64)
    valid = np.flatnonzero(~np.isnan(p))
    order = valid[np.argsort(p[valid], kind="stable")]
    m = len(order)
    adjusted = np.full(len(p), np.nan)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()


def verdict(delta: float, p_adjusted: float, higher_is_better: bool, alpha: float = ALPHA) -> str:
    """``regression``, ``improvement`` or ``no change`` (``n/a`` without a p-value)."""
    if math.isnan(p_adjusted):
        return "n/a"
    if p_adjusted >= alpha or delta == 0:
        return "no change"
    better = delta > 0 if higher_is_better else delta < 0
    return "improvement" if better else "regression"
