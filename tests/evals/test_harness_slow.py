"""Slow harness tests: kill -9 mid-sweep then resume; a 2-process sweep (and nightly) equals a 1-process
one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import cli_env

SUITE = """
name: killable
batch_size: 4
tasks:
  - {task: arith_d1, limit: 12}
  - {task: copy_l8, limit: 12}
  - {task: reverse_l8, limit: 12}
  - {task: sort_l4, limit: 12}
subnets: {specs: [full, k1, d0.5, d0.5-k1]}
efficiency: {enabled: false}
"""


_env = cli_env


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("c") / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.cli",
            "train",
            "--config",
            "micro",
            "--out",
            str(run),
            "--quiet",
            "--set",
            "train.steps=20",
            "--set",
            "data.tokenizer_chars=20000",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return run


def _sweep(ckpt, suite, out, *extra, prefix=()):
    cmd = [
        *prefix,
        "-m",
        "jobs.cli",
        "sweep",
        "--checkpoint",
        str(ckpt),
        "--suite",
        str(suite),
        "--out",
        str(out),
        "--quiet",
        *extra,
    ]
    return [sys.executable, *cmd] if not prefix else cmd


@pytest.mark.slow
def test_kill_9_mid_sweep_then_resume_gives_the_same_table(ckpt, tmp_path):
    suite = tmp_path / "s.yaml"
    suite.write_text(SUITE)
    ref = tmp_path / "ref"
    assert subprocess.run(_sweep(ckpt, suite, ref), env=_env(), timeout=600).returncode == 0
    out = tmp_path / "killed"
    for delay in (3.0, 5.0):
        proc = subprocess.Popen(
            _sweep(ckpt, suite, out), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert subprocess.run(_sweep(ckpt, suite, out, "--resume"), env=_env(), timeout=600).returncode == 0
    pd.testing.assert_frame_equal(pd.read_csv(ref / "results.csv"), pd.read_csv(out / "results.csv"))
    done = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    fps = [e["fingerprint"] for e in done if e["event"] == "unit_done"]
    assert len(fps) == len(set(fps)) == 16  # every unit computed exactly once


@pytest.mark.slow
def test_two_process_sweep_equals_one_process(ckpt, tmp_path):
    suite = tmp_path / "s.yaml"
    suite.write_text(SUITE)
    one = tmp_path / "one"
    assert subprocess.run(_sweep(ckpt, suite, one), env=_env(), timeout=600).returncode == 0
    accelerate = Path(sys.executable).with_name("accelerate")
    two = tmp_path / "two"
    prefix = (
        str(accelerate),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    )
    r = subprocess.run(
        _sweep(ckpt, suite, two, "--device", "cpu", prefix=prefix),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    pd.testing.assert_frame_equal(pd.read_csv(one / "results.csv"), pd.read_csv(two / "results.csv"))
    assert json.loads((two / "manifest.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_two_process_nightly_writes_one_run_folder_and_one_report(ckpt, tmp_path):
    """Under torchrun both processes agree on the default run folder (process 0's time stamp), share
    the units, and process 0 alone writes the report and ``nightly.json``; the tables equal a
    one-process sweep's."""
    suite = tmp_path / "s.yaml"
    suite.write_text(SUITE)
    one = tmp_path / "one"
    assert subprocess.run(_sweep(ckpt, suite, one), env=_env(), timeout=600).returncode == 0
    work = tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "jobs.cli", "nightly", "--checkpoint", str(ckpt), "--suite", str(suite), "--quiet"]
    r = subprocess.run(
        [*cmd, "--device", "cpu"], env=_env(), cwd=work, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = (work / "runs").iterdir()
    pd.testing.assert_frame_equal(pd.read_csv(one / "results.csv"), pd.read_csv(run / "results.csv"))
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["device"] == "cpu"
    assert json.loads((run / "nightly.json").read_text())["units"] == len(pd.read_csv(one / "results.csv"))
    assert (run / "report" / "index.html").is_file()
