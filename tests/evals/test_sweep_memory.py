"""Long sweeps hold a flat memory footprint: a real ``ernie5 sweep`` over 220 units records its
resident memory after every unit (``events.jsonl``: ``rss_mb``), and after unit 200 it is within
:data:`MARGIN_MB` of unit 20."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, cli_env

TASKS = ("arith_d1", "copy_l8", "reverse_l8", "sort_l4")
SPECS = ["full", *(f"w0.5-Erandom{i}" for i in range(54))]  # 55 sub-models x 4 tasks = 220 units
MARGIN_MB = 32.0
"""Allowed growth of resident memory between unit 20 and unit 200 (measured: under 10 MiB on a
500 MiB process; a leak of 200 KiB per unit, 36 MiB over those 180 units, would exceed it)."""


def test_resident_memory_is_flat_over_hundreds_of_units(micro_ckpt, tmp_path):
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        "name: memory\nbatch_size: 4\ntasks:\n"
        + "".join(f"  - {{task: {t}, limit: 2}}\n" for t in TASKS)
        + f"subnets: {{specs: [{', '.join(SPECS)}]}}\nefficiency: {{enabled: false}}\n"
    )
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "jobs.cli", "sweep", "--checkpoint", str(micro_ckpt), "--suite", str(suite)]
    done = subprocess.run(
        [*cmd, "--out", str(out), "--quiet"],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    events = [json.loads(x) for x in Path(out / "events.jsonl").read_text().splitlines()]
    rss = [e["rss_mb"] for e in events if e["event"] == "unit_done"]
    assert len(rss) == len(TASKS) * len(SPECS) == 220
    assert all(r > 0 for r in rss)
    assert rss[199] - rss[19] <= MARGIN_MB, rss[::20]
