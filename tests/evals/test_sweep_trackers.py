"""``ernie5 sweep --log-with``: every unit's scores and wall time reach the trackers, equal to the
run's own tables; a bad tracker name stops ``sweep`` and ``nightly`` before any work."""

from __future__ import annotations

import pandas as pd
import pytest

from jobs.cli import main

SUITE = """
name: tracked
batch_size: 8
tasks:
  - {task: arith_d1, limit: 8}
  - {task: copy_l8, limit: 8}
subnets: {specs: [full, k1]}
efficiency: {enabled: false}
"""


def test_sweep_scores_and_wall_times_reach_tensorboard(micro_ckpt, tmp_path):
    from tests.store.test_trackers import needs, tensorboard_scalars

    needs("tensorboard")

    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE)
    out = tmp_path / "run"
    args = ["sweep", "--checkpoint", str(micro_ckpt), "--suite", str(suite), "--out", str(out), "--quiet"]
    assert main([*args, "--log-with", "tensorboard"]) == 0
    got = tensorboard_scalars(out / "tensorboard" / "run")
    results = pd.read_csv(out / "results.csv")
    assert len(results) == 4
    for row in results.itertuples():
        assert got[f"{row.task}/{row.metric}/{row.subnet}"] == [(0, pytest.approx(row.value, abs=1e-6))]
    assert [s for s, _ in got["unit/wall_s"]] == [0, 1, 2, 3]
    assert got["sweep/computed"] == [(0, 4.0)] and got["sweep/n_units"] == [(0, 4.0)]


@pytest.mark.parametrize("command", ["sweep", "nightly"])
def test_a_bad_tracker_name_stops_before_any_work(command, tmp_path, capsys):
    args = [command, "--out", str(tmp_path / "run"), "--log-with", "neptune", "--quiet"]
    if command == "sweep":
        args += ["--checkpoint", "reference", "--suite", "smoke"]
    assert main(args) == 2
    assert "--log-with 'neptune': expected one of" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
