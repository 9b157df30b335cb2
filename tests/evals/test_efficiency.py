"""``evals.efficiency.measure``: prefill and decode timed directly, impossible figures are failed
measurements (NaN with a reason), never absurd throughputs."""

from __future__ import annotations

import itertools
import math

import pandas as pd
import pytest
import torch

from ernie5.model.model import Ernie5Model
from ernie5.subnets.spec import resolve
from evals import efficiency
from evals.results import EFFICIENCY_COLUMNS, write_tables
from evals.suite import EfficiencyConfig
from tests.conftest import tiny_config

CFG = EfficiencyConfig(prompt_len=8, decode_tokens=6, repeats=1, extract=False)


@pytest.fixture(scope="module")
def model_and_subnet():
    torch.manual_seed(0)
    model = Ernie5Model(tiny_config()).eval()
    return model, resolve("k1", model.cfg)


def _ticks(step: float):
    """A fake clock that advances ``step`` seconds per reading, whatever the work in between."""
    counter = itertools.count()
    return lambda: next(counter) * step


def test_decode_as_fast_as_the_clock_ticks_is_a_failed_measurement_not_billions_of_tokens(model_and_subnet):
    # The old failure: decoding looked (almost) free next to the prefill, and the difference of two
    # totals became 7e9 tokens/s. A clock that sees 0.1 ns per forward reproduces it.
    model, sub = model_and_subnet
    row = efficiency.measure(model, sub, CFG, clock=_ticks(1e-10), peak_flops=1e12)
    assert row["status"] == "failed"
    assert math.isnan(row["decode_tokens_per_s"]) and math.isnan(row["prefill_ms"])
    assert "decode:" in row["reason"] and "matmul peak" in row["reason"]


def test_a_clock_that_does_not_move_is_a_failed_measurement(model_and_subnet):
    model, sub = model_and_subnet
    row = efficiency.measure(model, sub, CFG, clock=lambda: 5.0, peak_flops=1e12)
    assert row["status"] == "failed" and "non-positive" in row["reason"]
    assert math.isnan(row["decode_tokens_per_s"]) and math.isnan(row["decode_tokens_per_s_high"])


def test_a_spread_too_wide_for_a_median_is_a_failed_measurement():
    steps = [1e-3, 1e-1] * 20  # the middle half of the steps spans 100x
    cols = efficiency._timing_columns([2e-3] * 5, steps, 8, 1e3, 1e12)
    assert cols["status"] == "failed" and "interquartile" in cols["reason"]
    assert math.isnan(cols["decode_tokens_per_s"]) and cols["prefill_ms"] == pytest.approx(2.0)


def test_plausible_timings_give_medians_and_their_spread():
    steps = [1e-3 * (1 + 0.01 * i) for i in range(30)]
    cols = efficiency._timing_columns([4e-3, 5e-3, 6e-3, 5e-3, 5e-3], steps, 8, 1e3, 1e12)
    assert cols["status"] == "ok" and cols["reason"] == ""
    assert cols["prefill_ms_low"] <= cols["prefill_ms"] <= cols["prefill_ms_high"]
    assert cols["prefill_ms"] == pytest.approx(5.0)
    low, mid, high = (cols[f"decode_tokens_per_s{s}"] for s in ("_low", "", "_high"))
    assert low < mid < high and mid == pytest.approx(1 / 1.145e-3, rel=1e-3)


def test_real_timings_on_this_machine_are_within_physical_bounds_or_failed(model_and_subnet):
    # On a loaded machine the steps may scatter too widely to be a measurement; then the row says
    # so. Either way no figure is impossible.
    model, sub = model_and_subnet
    threads = torch.get_num_threads()
    row = efficiency.measure(model, sub, CFG)
    assert torch.get_num_threads() == threads and row["threads"] == efficiency.CPU_THREADS
    assert row["matmul_peak_flops"] > 0
    if row["status"] == "failed":
        assert "interquartile range" in row["reason"] and "matmul peak" not in row["reason"]
        return
    assert row["reason"] == ""
    flops = 2 * row["active_params"]  # an upper bound of the matmul FLOPs of one token
    assert 0 < row["decode_tokens_per_s"] * flops < efficiency.PEAK_SLACK * row["matmul_peak_flops"]
    assert row["decode_tokens_per_s_low"] <= row["decode_tokens_per_s"] <= row["decode_tokens_per_s_high"]
    assert 0 < row["prefill_ms_low"] <= row["prefill_ms"] <= row["prefill_ms_high"]


def test_a_failed_row_reaches_efficiency_csv_whole(model_and_subnet, tmp_path):
    # The table keeps every column of a measured row: a failed measurement stays marked as failed.
    model, sub = model_and_subnet
    row = efficiency.measure(model, sub, CFG, clock=lambda: 5.0, peak_flops=1e12)
    assert set(row) == set(EFFICIENCY_COLUMNS)
    (tmp_path / "manifest.json").write_text('{"units": []}')
    write_tables(tmp_path, efficiency=[row], names=[])
    table = pd.read_csv(tmp_path / "efficiency.csv")
    assert list(table.columns) == list(EFFICIENCY_COLUMNS)
    assert table.loc[0, "status"] == "failed" and "non-positive" in table.loc[0, "reason"]
    assert math.isnan(table.loc[0, "decode_tokens_per_s"])
