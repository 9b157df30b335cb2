"""Preemption of a sweep: ``SIGTERM`` to a real ``ernie5 sweep`` process mid-run stops it between
units with exit 143 and one line, keeps every finished unit and leaves no tables or manifest as if the
run were complete; the same command then continues and ends with the tables an uninterrupted sweep
writes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from ernie5.runtime.preempt import EXIT_PREEMPTED
from tests.conftest import ROOT, cli_env

SUITE = """
name: preempt
batch_size: 8
tasks:
  - {task: arith_d1, limit: 24}
  - {task: copy_l8, limit: 16}
  - {task: reverse_l8, limit: 16}
  - {task: sort_l4, limit: 16}
subnets: {specs: [full, k1, d0.5]}
efficiency: {enabled: false}
"""


def _sweep(ckpt: Path, suite: Path, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jobs.cli", "sweep", "--checkpoint", str(ckpt), "--suite", str(suite)]
    return subprocess.Popen(
        [*cmd, "--out", str(out), "--quiet"],
        cwd=ROOT,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _units_done(out: Path) -> int:
    events = out / "events.jsonl"
    return events.read_text().count('"unit_done"') if events.is_file() else 0


def test_sigterm_stops_between_units_and_the_rerun_continues(micro_ckpt, tmp_path):
    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert _sweep(micro_ckpt, suite, whole).wait(timeout=600) == 0
    proc = _sweep(micro_ckpt, suite, cut)
    deadline = time.monotonic() + 300
    while _units_done(cut) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    lines = [
        x for x in err.splitlines() if x.startswith("ernie5 sweep: preempted: sweep preempt: stopped by")
    ]
    assert len(lines) == 1 and "rerun the same command to continue" in lines[0], err
    done = int(lines[0].split(" after ")[1].split()[0])
    assert 2 <= done < 12
    assert len(list((cut / "units").rglob("*.json"))) == done == _units_done(cut)
    assert not (cut / "manifest.json").exists() and not (cut / "results.csv").exists()
    assert not [p for p in cut.rglob(".*.tmp-*")]

    rerun = _sweep(micro_ckpt, suite, cut)
    out, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["reused"] == done and summary["computed"] == 12 - done
    a, b = pd.read_csv(whole / "results.csv"), pd.read_csv(cut / "results.csv")
    cols = ["subnet", "task", "metric", "value", "stderr", "n"]
    pd.testing.assert_frame_equal(a[cols], b[cols])
