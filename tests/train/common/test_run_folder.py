"""The run-folder contract shared by pretraining, SFT and RL (the trainers' own tests run it end to end)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ernie5.config import dump
from ernie5.store.checkpoint import checkpoint_dir, checkpoint_dirs
from ernie5.store.runs import append_jsonl, read_jsonl
from train.common.optim import OptimConfig
from train.common.run_folder import (
    RunError,
    cut_metrics,
    drop_old_checkpoints,
    first_difference,
    open_run_dir,
)
from train.pretrain.config import RunConfig, TrainConfig


def _open(run_dir, cfg, resume):
    return open_run_dir(
        run_dir,
        cfg,
        resume=resume,
        steps_key="train.steps",
        may_change=lambda s: replace(s, train=replace(s.train, steps=cfg.train.steps)),
    )


def _ckpt(run_dir, step):
    path = checkpoint_dir(run_dir, step)
    path.mkdir(parents=True)
    (path / "meta.json").write_text("{}")
    return path


def test_new_resume_grow_and_shrink(tmp_path):
    cfg = RunConfig(train=TrainConfig(steps=10))
    assert _open(tmp_path, cfg, resume=False) == (None, None)
    (tmp_path / "config.yaml").write_text(dump(cfg))
    with pytest.raises(RunError, match="already holds a run; pass --resume"):
        _open(tmp_path, cfg, resume=False)
    (tmp_path / "checkpoints" / ".step_00000009.tmp").mkdir(parents=True)  # an interrupted write
    newest = _ckpt(tmp_path, 8)
    _ckpt(tmp_path, 4)
    grown = RunConfig(train=TrainConfig(steps=20))
    ckpt, stored = _open(tmp_path, grown, resume=True)
    assert ckpt == newest and stored == cfg
    with pytest.raises(RunError, match=r"train.steps=5 < 10 .*extended, not shortened"):
        _open(tmp_path, RunConfig(train=TrainConfig(steps=5)), resume=True)
    with pytest.raises(RunError, match=r"optim.lr: .*only train.steps may grow"):
        _open(tmp_path, RunConfig(train=TrainConfig(steps=10), optim=OptimConfig(lr=1e-4)), resume=True)
    drop_old_checkpoints(tmp_path, 1)
    assert checkpoint_dirs(tmp_path) == [newest]


def test_cut_metrics_keeps_the_steps_to_the_resume_point(tmp_path):
    for step in (1, 2, 3):
        append_jsonl(tmp_path / "metrics.jsonl", {"step": step})
    cut_metrics(tmp_path, 2, [{"step": 2, "event": "extended"}])
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 1},
        {"step": 2},
        {"step": 2, "event": "extended"},
    ]


def test_first_difference_names_the_dotted_key():
    assert first_difference({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == "a.c: 2 -> 3"
    assert first_difference({"a": 1}, {"b": 1}) == "a differs"
    assert first_difference({"a": 1}, {"a": 1}) == ""


def test_two_runs_into_one_folder_get_the_one_line_lock_error(tmp_path):
    """A second train / sft / rl into a folder another process is writing: one line, nothing written
    (they interleaved checkpoints before)."""
    import subprocess
    import sys

    from train.common.run_folder import RunError, hold_run_folder

    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from ernie5.store.runs import RunLock; "
         f"lock = RunLock({str(run)!r}); print('locked', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with (
            pytest.raises(RunError, match=rf"{run} is being written by process {holder.pid}"),
            hold_run_folder(run),
        ):
            pass
    finally:
        holder.kill()
        holder.wait()
    with hold_run_folder(run):  # free once the holder is gone
        pass
