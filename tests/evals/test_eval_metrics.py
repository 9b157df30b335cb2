"""Table-driven tests of the pure metric functions."""

from __future__ import annotations

import math
import random

import pytest

from evals.metrics import (
    argmax,
    bits_per_byte,
    bootstrap_stderr,
    choice_accuracy,
    corpus_bits_per_byte,
    exact_match,
    mcnemar,
    mean_stderr,
    normalize_answer,
    paired_bootstrap,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (" True. ", "true"),
        ("Hallway", "hallway"),
        ("a  b\n c", "a b c"),
        ("(B)", "(b)"),
        ("] )", "] )"),
        ("3.5", "3.5"),
        ("", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("prediction", "reference", "normalize", "expected"),
    [
        ("True", "true", True, 1.0),
        ("True", "true", False, 0.0),
        (" hallway", "hallway", True, 1.0),
        ("(B)", "(B)", True, 1.0),
        ("(B)", "B", True, 0.0),
        ("] ]", ") ]", True, 0.0),
        ("72", "72.", True, 1.0),
        ("", "x", True, 0.0),
    ],
)
def test_exact_match(prediction, reference, normalize, expected):
    assert exact_match(prediction, reference, normalize=normalize) == expected


@pytest.mark.parametrize(
    ("logprobs", "gold", "lengths", "expected"),
    [
        ([-1.0, -2.0], 0, None, 1.0),
        ([-1.0, -2.0], 1, None, 0.0),
        ([-2.0, -8.0], 1, [1, 8], 1.0),
        ([-2.0, -8.0], 1, None, 0.0),
        ([-3.0, -3.0], 0, None, 1.0),
        ([-3.0, -3.0], 1, None, 0.0),
    ],
)
def test_choice_accuracy(logprobs, gold, lengths, expected):
    assert choice_accuracy(logprobs, gold, lengths) == expected


def test_argmax_prefers_the_first_tie_and_rejects_empty():
    assert argmax([1.0, 3.0, 3.0]) == 1
    with pytest.raises(ValueError):
        argmax([])


@pytest.mark.parametrize(
    ("values", "mean", "stderr"),
    [
        ([1.0, 0.0, 1.0, 0.0], 0.5, math.sqrt(1 / 3) / 2),
        ([2.0, 2.0, 2.0], 2.0, 0.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 3.0, math.sqrt(2.5) / math.sqrt(5)),
    ],
)
def test_mean_stderr(values, mean, stderr):
    assert mean_stderr(values) == pytest.approx((mean, stderr))


def test_mean_stderr_edge_cases():
    value, stderr = mean_stderr([0.25])
    assert value == 0.25 and math.isnan(stderr)
    with pytest.raises(ValueError):
        mean_stderr([])


@pytest.mark.parametrize(
    ("nll", "n_bytes", "expected"),
    [(math.log(2) * 100, 100, 1.0), (0.0, 10, 0.0), (math.log(2) * 150, 100, 1.5)],
)
def test_bits_per_byte(nll, n_bytes, expected):
    assert bits_per_byte(nll, n_bytes) == pytest.approx(expected)


def test_bits_per_byte_rejects_no_bytes():
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 0)


def test_corpus_bits_per_byte_is_a_ratio_of_sums_not_a_mean_of_ratios():
    ln2 = math.log(2)
    assert corpus_bits_per_byte([(ln2 * 10, 10), (ln2 * 90, 30)]) == pytest.approx(2.5)


def test_bootstrap_stderr_is_seeded_and_close_to_closed_form():
    rng = random.Random(0)
    values = [float(rng.random() < 0.3) for _ in range(400)]

    def mean(xs):
        return sum(xs) / len(xs)

    a = bootstrap_stderr(mean, values, seed=1, n=2000)
    assert a == bootstrap_stderr(mean, values, seed=1, n=2000)
    assert a != bootstrap_stderr(mean, values, seed=2, n=2000)
    assert a == pytest.approx(mean_stderr(values)[1], rel=0.1)
    assert math.isnan(bootstrap_stderr(mean, [1.0], seed=0))


def test_paired_bootstrap_finds_a_planted_difference():
    rng = random.Random(0)
    b = [rng.gauss(0.0, 1.0) for _ in range(300)]
    a = [x + 0.3 + rng.gauss(0.0, 0.2) for x in b]
    delta, low, high, p = paired_bootstrap(a, b, seed=0, n=2000)
    assert delta == pytest.approx(0.3, abs=0.05)
    assert 0.0 < low < delta < high
    assert p < 0.01
    assert (delta, low, high, p) == paired_bootstrap(a, b, seed=0, n=2000)


def test_paired_bootstrap_sees_noise_as_noise():
    rng = random.Random(1)
    a = [float(rng.random() < 0.5) for _ in range(300)]
    b = [float(rng.random() < 0.5) for _ in range(300)]
    delta, low, high, p = paired_bootstrap(a, b, seed=0, n=2000)
    assert low < 0.0 < high and p > 0.05
    assert paired_bootstrap(a, a, seed=0, n=500)[0::3] == (0.0, 1.0)


def test_paired_bootstrap_needs_aligned_samples():
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [1.0, 0.0], seed=0)


def _table(n11: int, n01: int, n10: int, n00: int) -> tuple[list[bool], list[bool]]:
    """Correctness lists for A and B from a 2x2 table (n01: A right and B wrong)."""
    a = [True] * n11 + [True] * n01 + [False] * n10 + [False] * n00
    b = [True] * n11 + [False] * n01 + [True] * n10 + [False] * n00
    return a, b


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ((10, 0, 0, 5), 1.0),  # no discordant pairs
        ((10, 5, 0, 5), 0.0625),  # exact: 2 * 0.5**5
        ((3, 1, 4, 2), 0.375),  # exact: 2 * (1 + 5) / 32
        ((0, 12, 12, 0), 1.0),  # exact, balanced
        ((50, 30, 10, 10), math.erfc(math.sqrt(9.025 / 2))),  # chi2 = (|30-10|-1)^2/40 = 9.025
        ((0, 20, 20, 0), 1.0),  # chi-square, balanced: statistic clipped at 0
    ],
)
def test_mcnemar_hand_computed_tables(table, expected):
    a, b = _table(*table)
    assert mcnemar(a, b) == pytest.approx(expected)
    assert mcnemar(b, a) == pytest.approx(expected)


def test_mcnemar_chi_square_matches_the_tabulated_value():
    a, b = _table(50, 30, 10, 10)
    assert mcnemar(a, b) == pytest.approx(0.002663, rel=1e-3)


def test_mcnemar_agrees_with_scipy_when_installed():
    stats = pytest.importorskip("scipy.stats")
    for n01, n10 in [(7, 2), (3, 9), (0, 6), (11, 13)]:
        a, b = _table(5, n01, n10, 5)
        assert mcnemar(a, b) == pytest.approx(stats.binomtest(n01, n01 + n10, 0.5).pvalue)
