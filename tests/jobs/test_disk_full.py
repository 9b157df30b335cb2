"""A write that fails at the OS level (disk full, quota, read-only, I/O) in train and sweep: one line
naming the path and what was being written, exit 2, the previous checkpoint and every finished unit
intact, nothing partial left as if complete, and a rerun after space is freed continues where it
stopped. On a real small filesystem (a tmpfs mount) where the machine allows it; else with a per-file
size limit (RLIMIT_FSIZE), under which the kernel fails the write with EFBIG."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ernie5.store.checkpoint import checkpoint_dirs, load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["data.tokenizer_chars=20000", "train.steps=30", "train.ckpt_every=10", "train.keep_ckpts=5"]
CKPT_BYTES = 7.7e6
"""A micro checkpoint's size (model, optimizer state, tokenizer)."""


class Disk:
    """A folder whose writes fail past a budget: a tmpfs of ``size`` (root, mount allowed), or else a
    per-file size limit in the child processes."""

    def __init__(self, path: Path, size: str, mode: str) -> None:
        self.path = path
        path.mkdir()
        self.tmpfs = False
        if mode == "tmpfs":
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
            )
            if mounted.returncode != 0:
                pytest.skip(
                    f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}); the limit mode runs"
                )
            self.tmpfs = True

    def grow(self) -> None:
        """Free the space (the rerun's condition)."""
        if self.tmpfs:
            subprocess.run(["mount", "-o", "remount,size=200M", str(self.path)], check=True)
        self.limit = None

    def close(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)

    limit: int | None = int(4e6)  # the fallback: no file over 4 MB (a checkpoint's model file is larger)

    def run(self, args: list[str]) -> subprocess.CompletedProcess:
        return _cli(args, None if self.tmpfs else self.limit)


def _cli(args: list[str], limit: int | None = None) -> subprocess.CompletedProcess:
    """``ernie5 ARGS`` in a child process; with ``limit``, no file it writes may pass that many bytes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def cap() -> None:
        if limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        preexec_fn=cap, timeout=900,
    )  # fmt: skip


MODES = ["tmpfs", pytest.param("limit", marks=pytest.mark.slow)]
"""A real full filesystem (tmpfs) in the default run; the file-size limit (RLIMIT_FSIZE, the same
ENOSPC path) in the slow one, to keep the default run within its budget."""


@pytest.fixture(params=MODES)
def disk(tmp_path, request):
    d = Disk(tmp_path / "disk", f"{int(CKPT_BYTES * 1.6)}", request.param)  # one checkpoint, not two
    yield d
    d.close()


def _train_args(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        "micro",
        "--out",
        str(out),
        "--quiet",
        *extra,
        *(x for i in TRAIN for x in ("--set", i)),
    ]


def _partials(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if ".tmp" in p.name]


def test_train_on_a_full_disk_ends_in_one_line_and_resumes_after_space_is_freed(disk, tmp_path):
    out = disk.path / "run"
    failed = disk.run(_train_args(out))
    assert failed.returncode == 2, failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ernie5 train: error: "), failed.stderr
    what = "No space left on device" if disk.tmpfs else "File too large"
    assert f"{what} while writing the checkpoint: {out / 'checkpoints'}/step_" in lines[0]
    assert not _partials(out)  # the half-written checkpoint is gone, nothing looks complete
    kept = checkpoint_dirs(out)
    assert [d.name for d in kept] == (["step_00000010"] if disk.tmpfs else [])
    for d in kept:
        load_checkpoint(d, fast=False)  # the previous checkpoint is intact
    disk.grow()
    resumed = disk.run(_train_args(out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    whole = tmp_path / "whole"
    assert _cli(_train_args(whole)).returncode == 0
    a = load_checkpoint(checkpoint_dirs(whole)[-1], fast=False).model.state_dict()
    b = load_checkpoint(checkpoint_dirs(out)[-1], fast=False).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # as if nothing had happened
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 30


@pytest.mark.parametrize("mode", MODES)
def test_a_sweep_on_a_full_disk_keeps_its_finished_units_and_continues(tmp_path, mode):
    d = Disk(tmp_path / "disk", "200K", mode)
    try:
        if not d.tmpfs:
            d.limit = 20_000  # the unit files are small: a cache file over 20 kB fails instead
        out = d.path / "sweep"
        args = ["sweep", "--checkpoint", "reference", "--suite", "smoke", "--out", str(out), "--quiet"]
        failed = d.run(args)
        assert failed.returncode == 2, failed.stderr
        lines = failed.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ernie5 sweep: error: ") and str(out) in lines[0]
        assert "while writing" in lines[0]
        assert not _partials(out)
        finished = sorted(p.relative_to(out) for p in (out / "units").rglob("*.json"))
        for p in finished:
            json.loads((out / p).read_text())  # every unit written is whole
        d.grow()
        rerun = d.run(args)
        assert rerun.returncode == 0, rerun.stderr
        summary = json.loads(rerun.stdout.strip().splitlines()[-1])
        assert summary["reused"] >= len(finished) and summary["errors"] == 0
    finally:
        d.close()
