"""A failed efficiency measurement (``status = failed`` in efficiency.csv, or an impossible figure) is
shown as "measurement failed" and never becomes a speedup or a point of a decode-latency frontier."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest

from reports import build_report
from reports.pareto import FAILED, efficiency_table, operating_points, pareto_table

ABSURD = 7.0e9  # tokens/s: what the old subtraction of two noisy totals produced for k1
EFF = pd.DataFrame(
    [
        # subnet, depth, width, top_k, total, active, tokens/s, status
        ("full", 16, 64, 8, 1000, 200, 100.0, "ok"),
        ("k2", 16, 64, 2, 1000, 130, ABSURD, "failed"),  # the ES point
        ("k4", 16, 64, 4, 1000, 150, 110.0, "ok"),
        ("d0.75-w0.5-k4", 12, 32, 4, 400, 110, math.inf, "ok"),  # the EA point; inf never passes
        ("d0.5-w0.5-k2", 8, 32, 2, 300, 70, 190.0, "ok"),
    ],
    columns=[
        "subnet",
        "depth",
        "width",
        "top_k",
        "total_params",
        "active_params",
        "decode_tokens_per_s",
        "status",
    ],
).assign(active_params_measured=math.nan, flops_per_token=math.nan, prefill_ms=5.0, reason="")
AGG = pd.DataFrame({"subnet": EFF["subnet"], "score": [1.0, 0.97, 0.99, 0.96, 0.85]})


def test_failed_rows_give_no_speedup():
    points = operating_points(efficiency_table(EFF), AGG).set_index("point")
    assert points.loc["ES", "subnet"] == "k2" and points.loc["EA", "subnet"] == "d0.75-w0.5-k4"
    assert points["speedup"].isna().all() and points["speedup_failed"].all()


def test_a_failed_full_model_voids_every_speedup():
    eff = EFF.assign(status=["failed", "ok", "ok", "ok", "ok"], decode_tokens_per_s=100.0)
    points = operating_points(efficiency_table(eff), AGG)
    assert points["speedup"].isna().all() and points["speedup_failed"].all()


def test_failed_rows_are_off_the_decode_frontier_but_keep_their_parameter_costs():
    eff = efficiency_table(EFF)
    table = pareto_table(AGG, eff).set_index("subnet")
    assert not table.loc["k2", "front_decode_ms_per_token"]
    assert not table.loc["d0.75-w0.5-k4", "front_decode_ms_per_token"]
    assert table.loc["k4", "front_decode_ms_per_token"]  # dominated by k2 only through the absurd figure
    assert table.loc["d0.75-w0.5-k4", "front_active_params"]  # analytic costs still count
    voided = eff.set_index("subnet")
    assert (
        voided.loc["d0.75-w0.5-k4", "status"] == "failed"
        and "not a positive" in voided.loc["d0.75-w0.5-k4", "reason"]
    )
    assert math.isnan(voided.loc["k2", "prefill_ms"])  # every timing of a failed row is void


@pytest.fixture
def failed_report(make_run):
    run = make_run("failed-timing")
    eff = pd.read_csv(run / "efficiency.csv")
    k1 = eff["subnet"] == "k1"
    eff["status"], eff["reason"] = "ok", ""
    eff.loc[k1, "decode_tokens_per_s"] = ABSURD
    eff.loc[k1, "status"] = "failed"
    eff.loc[k1, "reason"] = "decode: implies 1e16 FLOP/s, above 4x the measured matmul peak"
    eff.to_csv(run / "efficiency.csv", index=False)
    return build_report(run)


def test_report_shows_measurement_failed_and_no_absurd_speedup(failed_report):
    page = (failed_report / "index.html").read_text()
    summary = (failed_report / "summary.md").read_text()
    assert page.count(FAILED) >= 3  # highlights, operating points, measured speed, efficiency table
    assert FAILED in summary and "implies 1e16 FLOP/s" in page
    points = {
        p["point"]: p for p in json.loads((failed_report / "tables" / "operating_points.json").read_text())
    }
    assert points["ES"]["subnet"] == "k1" and points["ES"]["speedup"] is None
    assert points["EA"]["speedup"] == pytest.approx(
        (4e9 / (50e6 + 12 * (2e6 + 0.5e6))) / (4e9 / (50e6 + 16 * (2e6 + 4 * 0.5e6)))
    )
    front = pd.read_csv(failed_report / "tables" / "pareto.csv").set_index("subnet")
    assert not front.loc["k1", "front_decode_ms_per_token"]
    assert re.search(r"ES point k1:[^<]*decode speedup measurement failed", page)
    for text in (page, summary):  # no absurd speedup anywhere (the old report said 199500000.00x)
        text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", text)
        speedups = [float(x) for x in re.findall(r"\b(\d+(?:\.\d+)?)x\b", text)]
        assert speedups and max(speedups) < 10
