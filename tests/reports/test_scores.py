"""Relative scores, primary metrics and HELM mean win rates on hand-made tables."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from reports.scores import (
    primary_metrics,
    primary_scores,
    relative_score,
    relative_scores,
    relative_stderr,
    win_rates,
)

NAN = math.nan


@pytest.mark.parametrize(
    "value, full, higher, expected",
    [
        (0.6, 0.8, True, 0.75),  # accuracy dropped by a quarter
        (0.8, 0.8, True, 1.0),
        (0.9, 0.6, True, 1.5),  # better than full
        (2.5, 2.0, False, 0.8),  # bits per byte went up: full / sub
        (0.15, 0.3, False, 2.0),  # WER halved
        (0.0, 0.0, True, NAN),  # full scored 0: no retention signal, left out
        (0.0, 0.0, False, 1.0),  # WER 0 for both
        (0.3, 0.0, True, NAN),  # full scored 0: ratio undefined
        (0.0, 0.2, False, NAN),  # sub WER 0: ratio undefined
        (0.0, 0.5, True, 0.0),
        (-1.0, 0.5, True, NAN),  # negative metrics have no ratio
        (NAN, 0.5, True, NAN),
    ],
)
def test_relative_score(value, full, higher, expected):
    got = relative_score(value, full, higher)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


@pytest.mark.parametrize(
    "value, se, full, full_se, higher, expected",
    [
        (0.5, 0.0, 1.0, 0.0, True, 0.0),
        (0.5, 0.1, 1.0, 0.0, True, 0.1),  # d(a/b)/da = 1/b
        (1.0, 0.0, 2.0, 0.2, True, 0.05),  # a * se_b / b^2
        (2.0, 0.2, 1.0, 0.0, False, 0.05),  # ratio full / sub
        (0.5, NAN, 1.0, 0.1, True, NAN),
        (0.5, 0.1, 0.0, 0.1, True, NAN),
        (0.0, 0.0, 0.0, 0.0, True, NAN),  # full scored 0: no retention signal
        (0.0, 0.0, 0.0, 0.0, False, 0.0),  # a perfect 0 (e.g. WER) in both: a deterministic tie
        (0.0, 0.1, 0.0, 0.0, False, NAN),
    ],
)
def test_relative_stderr(value, se, full, full_se, higher, expected):
    got = relative_stderr(value, se, full, full_se, higher)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


def _results(rows):
    cols = ["subnet", "task", "metric", "value", "stderr", "n", "higher_is_better", "modality", "capability"]
    return pd.DataFrame(rows, columns=cols)


def test_primary_metric_is_the_first_declared():
    res = _results(
        [
            ("full", "hs", "acc", 0.7, 0.01, 100, True, "text", "understanding"),
            ("full", "hs", "acc_norm", 0.6, 0.01, 100, True, "text", "understanding"),
            ("k1", "hs", "acc", 0.6, 0.01, 100, True, "text", "understanding"),
            ("k1", "hs", "acc_norm", 0.5, 0.01, 100, True, "text", "understanding"),
        ]
    )
    assert primary_metrics(res) == {"hs": "acc"}
    assert primary_scores(res)["metric"].tolist() == ["acc", "acc"]


def test_relative_scores_against_full():
    res = _results(
        [
            ("full", "qa", "acc", 0.8, 0.02, 100, True, "image", "understanding"),
            ("k1", "qa", "acc", 0.6, 0.02, 100, True, "image", "understanding"),
            ("full", "asr", "wer", 0.2, 0.01, 100, False, "audio", "understanding"),
            ("k1", "asr", "wer", 0.25, 0.01, 100, False, "audio", "understanding"),
            ("k1", "orphan", "acc", 0.5, 0.02, 100, True, "text", "understanding"),  # full has no score
        ]
    )
    rel = relative_scores(res).set_index(["subnet", "task"])["rel"]
    assert rel[("full", "qa")] == 1.0 and rel[("k1", "qa")] == pytest.approx(0.75)
    assert rel[("k1", "asr")] == pytest.approx(0.8)
    assert math.isnan(rel[("k1", "orphan")])


@pytest.mark.parametrize(
    "values, higher, expected",
    [
        # subnet -> value on one task; expected win rate
        ({"a": 0.9, "b": 0.5, "c": 0.1}, True, {"a": 1.0, "b": 0.5, "c": 0.0}),
        ({"a": 0.9, "b": 0.5, "c": 0.1}, False, {"a": 0.0, "b": 0.5, "c": 1.0}),  # lower is better
        ({"a": 0.5, "b": 0.5, "c": 0.1}, True, {"a": 0.75, "b": 0.75, "c": 0.0}),  # a tie is half a win
    ],
)
def test_win_rates_one_task(values, higher, expected):
    res = _results([(s, "t", "m", v, 0.0, 10, higher, "text", "understanding") for s, v in values.items()])
    got = dict(zip(*win_rates(res)[["subnet", "mean_win_rate"]].T.values))
    assert got == pytest.approx(expected)


def test_win_rates_average_over_tasks():
    res = _results(
        [
            ("a", "t1", "acc", 0.9, 0, 10, True, "text", "u"),
            ("b", "t1", "acc", 0.5, 0, 10, True, "text", "u"),
            ("a", "t2", "wer", 0.9, 0, 10, False, "audio", "u"),
            ("b", "t2", "wer", 0.5, 0, 10, False, "audio", "u"),
            ("a", "t3", "acc", 0.7, 0, 10, True, "image", "u"),  # only one subnet: not counted
        ]
    )
    table = win_rates(res).set_index("subnet")
    assert table.loc["a", "mean_win_rate"] == pytest.approx(0.5) and table.loc["a", "n_tasks"] == 2
    assert table.loc["b", "mean_win_rate"] == pytest.approx(0.5)
