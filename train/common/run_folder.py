"""The run folder of a checkpointing trainer (pretraining, SFT, RL) and its resume contract.

Layout::

    run_dir/config.yaml                 the run's config (rewritten at every start)
    run_dir/meta.json                   provenance of the newest start
    run_dir/metrics.jsonl               one record per logged step (records with an ``event`` key are notes)
    run_dir/checkpoints/step_XXXXXXXX/  the newest ``keep_ckpts`` checkpoints (ernie5.store.checkpoint)

Contract: a new run needs an empty (or absent) folder. ``--resume`` continues the folder's newest
*complete* checkpoint (an interrupted checkpoint write is never complete) with the run's own config,
except what the trainer lets change (how the run is spread over processes and devices, and the
steps, which may grow and never shrink); ``metrics.jsonl`` is cut back to the resume point.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from ernie5.config import ConfigError, from_dict, read_yaml, to_dict
from ernie5.model.config import ModelConfig
from ernie5.store.checkpoint import Checkpoint, CheckpointError, checkpoint_dirs, load_checkpoint
from ernie5.store.runs import LOCK_FILE, RunLock, RunLocked, read_jsonl, rewrite_jsonl

C = TypeVar("C")


class RunError(RuntimeError):
    """A run folder cannot be used as asked (one-line message)."""


def drop_old_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints."""
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def first_difference(a: dict, b: dict, prefix: str = "") -> str:
    """The first dotted key where two config mappings differ (``optim.lr: 0.001 -> 0.002``), or ''."""
    for k in sorted(set(a) | set(b)):
        key = f"{prefix}{k}"
        if k not in a or k not in b:
            return f"{key} differs"
        if isinstance(a[k], dict) and isinstance(b[k], dict):
            sub = first_difference(a[k], b[k], key + ".")
            if sub:
                return sub
        elif a[k] != b[k]:
            return f"{key}: {a[k]!r} -> {b[k]!r}"
    return ""


def _dotted(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def open_run_dir(
    run_dir: Path,
    cfg: C,
    *,
    resume: bool,
    steps_key: str,
    may_change: Callable[[C], C],
    check_stored: Callable[[C], None] | None = None,
) -> tuple[Path | None, C | None]:
    """Check that ``run_dir`` can take ``cfg`` (the module docstring's contract).

    Args:
        run_dir: the run folder.
        cfg: the config of this start.
        resume: ``--resume``.
        steps_key: the dotted key of the run's steps (``train.steps``, ``rl.steps``): it may grow.
        may_change: the stored config with what may change at a resume (the steps at least) taken
            from ``cfg``; any other difference is a :class:`RunError`.
        check_stored: a further check of the stored config (raises :class:`RunError`), run after the
            config comparison and before the steps check.

    Returns:
        ``(checkpoint to resume or None, the stored config or None)``.
    """
    cfg_path = run_dir / "config.yaml"
    ckpts = checkpoint_dirs(run_dir)
    if not resume and (ckpts or cfg_path.exists()):
        raise RunError(
            f"run folder {run_dir} already holds a run; pass --resume to continue it, or a new --out"
        )
    stored = None
    if resume and cfg_path.exists():
        try:
            stored = from_dict(type(cfg), read_yaml(cfg_path))
        except ConfigError as e:
            raise RunError(f"{cfg_path}: {e}") from None
        same = may_change(stored)
        if to_dict(same) != to_dict(cfg):
            diff = first_difference(to_dict(same), to_dict(cfg))
            raise RunError(
                f"--resume with a different config than {cfg_path} ({diff}); only {steps_key} may grow"
            )
        if check_stored is not None:
            check_stored(stored)
        old_steps, steps = _dotted(stored, steps_key), _dotted(cfg, steps_key)
        if steps < old_steps:
            raise RunError(
                f"--resume with {steps_key}={steps} < {old_steps} of {cfg_path}: "
                "a run can be extended, not shortened"
            )
    return (ckpts[-1] if (resume and ckpts) else None), stored


def cut_metrics(run_dir: Path, step: int, notes: list[dict] | tuple[dict, ...] = ()) -> None:
    """Cut ``metrics.jsonl`` back to the records at or before ``step`` (the resume point; 0 for a new
    run), then append ``notes``."""
    metrics = run_dir / "metrics.jsonl"
    kept = [r for r in read_jsonl(metrics) if r.get("step", math.inf) <= step]
    rewrite_jsonl(metrics, [*kept, *notes])


def load_start(source: str | Path, model: ModelConfig, key: str) -> Checkpoint:
    """The checkpoint a run starts from (``key``: the config key that names it, ``train.init_from`` or
    ``rl.init_from``), loaded in full precision; it must hold ``model``'s config and a text tokenizer
    (else a one-line :class:`RunError`)."""
    try:
        ckpt = load_checkpoint(source, fast=False)
    except (CheckpointError, OSError) as e:
        raise RunError(f"{key}: {str(e).splitlines()[0]}") from None
    theirs, ours = to_dict(ckpt.cfg), to_dict(model)
    if theirs != ours and _grows_content(ckpt.cfg, model):
        ckpt = _with_content_projection(ckpt, model)
        theirs = ours
    if theirs != ours:
        raise RunError(f"{key}: {source} has a different model config ({first_difference(theirs, ours)})")
    if ckpt.tokenizer is None:
        raise RunError(f"{key}: {source} has no text tokenizer")
    return ckpt


def _grows_content(theirs: ModelConfig, ours: ModelConfig) -> bool:
    """Whether ``ours`` is ``theirs`` with speech-content features added (``audio.content_dim`` 0 -> F)."""
    import dataclasses

    if not (ours.audio.enabled and theirs.audio.content_dim == 0 and ours.audio.content_dim > 0):
        return False
    same = dataclasses.replace(ours, audio=dataclasses.replace(ours.audio, content_dim=0))
    return to_dict(same) == to_dict(theirs)


def _with_content_projection(ckpt: Checkpoint, model_cfg: ModelConfig) -> Checkpoint:
    """``ckpt`` with its model rebuilt under ``model_cfg``: every weight kept, the new content projection
    initialised with a zero output layer, so the grown model computes exactly what the old one did until
    training moves it (as an adapter is added)."""
    import dataclasses

    from ernie5.model.model import Ernie5Model

    grown = Ernie5Model(model_cfg)
    missing, unexpected = grown.load_state_dict(ckpt.model.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("audio.content_proj.") for k in missing), (missing, unexpected)
    with torch.no_grad():
        grown.audio.content_proj[2].weight.zero_()
    return dataclasses.replace(ckpt, model=grown, cfg=model_cfg)


@contextmanager
def hold_run_folder(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s writer lock (:class:`ernie5.store.runs.RunLock`) for the block, in the first
    process of a run (``RANK`` 0; the other processes write through it): two runs into one folder would
    interleave their checkpoints. Another holder is a one-line :class:`RunError`."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    run_dir = Path(run_dir)
    existed = run_dir.exists()
    try:
        lock = RunLock(run_dir)
    except RunLocked as e:
        raise RunError(str(e)) from None
    try:
        yield
    finally:
        lock.release()
        if not existed and [p.name for p in run_dir.iterdir()] == [LOCK_FILE]:
            shutil.rmtree(run_dir)  # a run that failed before writing anything leaves no folder
