"""Pareto frontier, aggregate scores and operating points on hand-made tables."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from reports.pareto import aggregate_scores, efficiency_table, operating_points, pareto_front, reduced_dims

NAN = math.nan


@pytest.mark.parametrize(
    "score, cost, front",
    [
        ([1.0, 0.9, 0.8], [100, 80, 60], [True, True, True]),  # a clean trade-off
        ([1.0, 0.9, 0.95], [100, 80, 90], [True, True, True]),
        ([1.0, 0.9, 0.85], [100, 80, 90], [True, True, False]),  # worse and dearer than the second
        ([1.0, 1.0], [100, 80], [False, True]),  # same score, cheaper wins
        ([0.9, 1.0], [80, 80], [False, True]),  # same cost, better wins
        ([1.0, 1.0], [80, 80], [True, True]),  # identical points are both on the frontier
        ([1.0, NAN, 0.5], [100, 50, NAN], [True, False, False]),  # NaN is never on it
    ],
)
def test_pareto_front(score, cost, front):
    assert pareto_front(score, cost) == front


def test_aggregate_weighs_modalities_equally():
    groups = pd.DataFrame(
        {
            "subnet": ["s", "s"],
            "group": ["text", "image"],
            "rel": [0.9, 0.7],
            "ci_low": [0.86, 0.6],
            "ci_high": [0.94, 0.8],
        }
    )
    row = aggregate_scores(groups).iloc[0]
    assert row["score"] == pytest.approx(0.8)
    assert row["ci_high"] - row["score"] == pytest.approx(math.sqrt(0.04**2 + 0.1**2) / 2)


EFF = pd.DataFrame(
    [
        # subnet, depth, width, top_k, total, active, tokens/s
        ("full", 16, 64, 8, 1000, 200, 100.0),
        ("k1", 16, 64, 1, 1000, 120, 130.0),
        ("k2", 16, 64, 2, 1000, 130, 118.0),  # 25% of top-k 8: the ES point
        ("k4", 16, 64, 4, 1000, 150, 110.0),
        ("d0.75", 12, 64, 8, 800, 160, 120.0),
        ("d0.75-w0.5-k4", 12, 32, 4, 400, 110, 150.0),
        ("d0.5-w0.5-k2", 8, 32, 2, 300, 70, 190.0),
    ],
    columns=["subnet", "depth", "width", "top_k", "total_params", "active_params", "decode_tokens_per_s"],
).assign(active_params_measured=NAN, flops_per_token=NAN)
AGG = pd.DataFrame({"subnet": EFF["subnet"], "score": [1.0, 0.9, 0.97, 0.99, 0.95, 0.96, 0.85]})


def test_operating_points():
    points = operating_points(efficiency_table(EFF), AGG).set_index("point")
    assert points.loc["ES", "subnet"] == "k2"
    assert points.loc["ES", "top_k_fraction"] == pytest.approx(0.25)
    assert points.loc["ES", "speedup"] == pytest.approx(1.18)
    assert points.loc["EA", "subnet"] == "d0.75-w0.5-k4"  # best-scoring fully elastic subnet
    assert points.loc["EA", "active_pct"] == pytest.approx(0.55)
    assert points.loc["EA", "total_pct"] == pytest.approx(0.4)


def test_operating_points_absent_without_candidates():
    eff = efficiency_table(EFF[EFF["subnet"].isin(["full", "d0.75"])])
    assert operating_points(eff, AGG).empty


@pytest.mark.parametrize(
    "row, dims",
    [
        ({"subnet": "k2", "depth": 16, "width": 64, "top_k": 2}, {"top_k"}),
        ({"subnet": "x", "depth": 12, "width": 32, "top_k": 8}, {"depth", "width"}),
        ({"subnet": "d0.75-w0.5-k1", "depth": NAN, "width": NAN, "top_k": NAN}, {"depth", "width", "top_k"}),
        ({"subnet": "w0.5", "depth": NAN, "width": NAN, "top_k": NAN}, {"width"}),
    ],
)
def test_reduced_dims(row, dims):
    full = pd.Series({"subnet": "full", "depth": 16, "width": 64, "top_k": 8})
    assert reduced_dims(pd.Series(row), full) == dims


def test_decode_latency_from_throughput():
    eff = efficiency_table(EFF)
    assert eff.set_index("subnet").loc["full", "decode_ms_per_token"] == pytest.approx(10.0)
