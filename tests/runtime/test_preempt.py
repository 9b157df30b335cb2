"""Preemption: a real SIGTERM to a real training process mid-run ends in a checkpoint at the next step
boundary, one line and exit 143; --resume then gives exactly the uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ernie5.runtime.preempt import Preemption, preemptible
from ernie5.store.checkpoint import checkpoint_dirs, load_checkpoint

ROOT = Path(__file__).resolve().parents[3]
SETS = ["data.tokenizer_chars=20000", "train.steps=30", "train.ckpt_every=100", "train.log_every=1"]


def _train(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jobs.cli", "train", "--config", "micro", "--out", str(out), "--quiet"]
    for item in SETS:
        cmd += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*cmd, *extra], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_sigterm_checkpoints_at_the_step_boundary_and_resume_is_exact(tmp_path):
    whole = tmp_path / "whole"
    assert _train(whole).wait(timeout=600) == 0
    cut = tmp_path / "cut"
    proc = _train(cut)
    deadline = time.monotonic() + 300
    while _steps_logged(cut) < 5 and time.monotonic() < deadline:  # mid-run, several steps in
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    lines = [x for x in err.splitlines() if x.startswith("ernie5 train: preempted: SIGTERM at step ")]
    assert len(lines) == 1, err
    step = int(lines[0].split(" at step ")[1].split()[0])
    assert 5 <= step < 30
    dirs = checkpoint_dirs(cut)
    assert [d.name for d in dirs] == [f"step_{step:08d}"] and str(dirs[0]) in lines[0]
    resumed = _train(cut, "--resume")
    assert resumed.wait(timeout=600) == 0
    a = load_checkpoint(checkpoint_dirs(whole)[-1], fast=False).model.state_dict()
    b = load_checkpoint(checkpoint_dirs(cut)[-1], fast=False).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    recs = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 31))


def test_a_stop_request_is_seen_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with preemptible(grace_s=30) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested and stop.signal == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == before
    state = Preemption(30)
    state.request("SIGINT")
    state.request("SIGTERM")  # the first request is the one that counts
    assert state.signal == "SIGINT"
    state.cancel()
