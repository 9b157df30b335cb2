"""Paired tests, Holm adjustment and verdicts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from reports.paired import corpus_bootstrap, holm, paired_test, unpaired_test, verdict


@pytest.mark.parametrize(
    "p, expected",
    [
        ([0.01, 0.04, 0.03], [0.03, 0.06, 0.06]),
        ([0.5, 0.001], [0.5, 0.002]),
        ([0.9, 0.8], [1.0, 1.0]),  # capped at 1 and monotone: a larger p never gets a smaller adjustment
        ([math.nan, 0.02], [math.nan, 0.02]),  # NaN does not count towards m
        ([], []),
    ],
)
def test_holm(p, expected):
    got = holm(p)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert (math.isnan(g) and math.isnan(e)) or g == pytest.approx(e)


@pytest.mark.parametrize(
    "delta, p, higher, expected",
    [
        (-0.1, 0.001, True, "regression"),
        (0.1, 0.001, True, "improvement"),
        (0.1, 0.001, False, "regression"),  # WER went up
        (-0.1, 0.001, False, "improvement"),
        (-0.1, 0.2, True, "no change"),
        (0.0, 0.0, True, "no change"),
        (-0.1, math.nan, True, "n/a"),
    ],
)
def test_verdict(delta, p, higher, expected):
    assert verdict(delta, p, higher) == expected


def test_method_follows_the_values():
    rng = np.random.default_rng(0)
    acc = rng.integers(0, 2, 50).astype(float).tolist()
    assert paired_test(acc, acc, "acc")["method"] == "mcnemar"
    wer = rng.random(50).tolist()
    assert paired_test(wer, wer, "wer")["method"] == "bootstrap"
    bpb = [[float(x), 100.0] for x in rng.random(50) * 100]
    assert paired_test(bpb, bpb, "bits_per_byte")["method"] == "corpus-bootstrap"


def test_identical_samples_show_no_change():
    acc = [1.0, 0.0, 1.0, 1.0] * 10
    out = paired_test(acc, acc, "acc")
    assert out["delta"] == 0.0 and out["p_value"] == 1.0


def test_corpus_bootstrap_value_and_planted_shift():
    rng = np.random.default_rng(1)
    n_bytes = rng.integers(100, 300, 200).astype(float)
    nll = n_bytes * math.log(2) * 2.0 * (0.8 + 0.4 * rng.random(200))
    base = np.stack([nll, n_bytes], 1).tolist()
    worse = np.stack([nll * 1.1, n_bytes], 1).tolist()
    delta, low, high, p = corpus_bootstrap(worse, base, 1 / math.log(2), seed=0, n=2000)
    expected = (nll.sum() * 0.1) / n_bytes.sum() / math.log(2)
    assert delta == pytest.approx(expected) and low < delta < high and p < 0.01


def test_unpaired_z_test():
    out = unpaired_test(0.5, 0.01, 0.6, 0.01)
    assert out["delta"] == pytest.approx(-0.1) and out["p_value"] < 1e-6
    assert math.isnan(unpaired_test(0.5, math.nan, 0.6, 0.01)["p_value"])
