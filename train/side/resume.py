"""Exact resume and preemption for the side-model trainers (vision tokenizer, speech-content encoder,
audio codec, refiner), as :mod:`train.pretrain.loop` has them for the backbone.

A side trainer runs its loop inside :func:`side_run`. After every step it calls
:meth:`SideRun.step_done`, which writes ``OUT/resume.pt`` every ``ResumeConfig.every`` steps and, after
``SIGTERM`` or a first Ctrl-C (:mod:`ernie5.runtime.preempt`), at once, then raises
:class:`~ernie5.runtime.preempt.Preempted` (``ernie5`` prints one line, exit 143). The same command on
the same ``--out`` continues from it: the modules, optimizers, Python / NumPy / torch random states,
the step and ``metrics.jsonl`` (cut back to what it held at that step) are restored, so the resumed run
ends bit-identical to an uninterrupted one (tested). ``resume.pt`` is removed when the run finishes.

The file is written to a temporary name and renamed (``ernie5.store.runs.write_atomic``): a kill leaves
the previous one or the new one, never half of one. A resume state written under another config is
refused with one line naming both ways forward, and the folder is locked while the trainer runs, so
two trainers into one ``--out`` do not interleave their states.

References: none (engineering; the backbone's contract, :mod:`train.pretrain.loop`).
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ernie5.config import ConfigError, check
from ernie5.runtime.preempt import Preempted, Preemption, preemptible
from ernie5.store.runs import RunLock, write_atomic

RESUME_FILE = "resume.pt"
METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class ResumeConfig:
    """When a side trainer writes its resume state."""

    every: int = 500
    """Steps between periodic resume states (0 = only when stopped by a signal); a ``kill -9`` loses at
    most this many steps."""
    grace_s: float = 60.0
    """After ``SIGTERM`` the step in progress may take this long before the process exits at once (the
    last resume state then stands)."""

    def __post_init__(self) -> None:
        check(self.every >= 0, f"resume.every={self.every} must be >= 0")
        check(self.grace_s > 0, f"resume.grace_s={self.grace_s} must be > 0")


Stateful = torch.nn.Module | torch.optim.Optimizer | random.Random | np.random.Generator | torch.Generator


def _state_of(obj: Stateful) -> Any:
    if isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
        return obj.state_dict()
    if isinstance(obj, random.Random):
        return obj.getstate()
    if isinstance(obj, np.random.Generator):
        return obj.bit_generator.state
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    raise TypeError(f"cannot save the state of {type(obj).__name__}")


def _restore(obj: Stateful, state: Any) -> None:
    if isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
        obj.load_state_dict(state)
    elif isinstance(obj, random.Random):
        obj.setstate(_as_tuples(state))
    elif isinstance(obj, np.random.Generator):
        obj.bit_generator.state = state
    elif isinstance(obj, torch.Generator):
        obj.set_state(state)
    else:
        raise TypeError(f"cannot restore the state of {type(obj).__name__}")


def _as_tuples(state: Any) -> Any:
    """``random.Random.getstate()`` is nested tuples; keep them tuples whatever the pickler made."""
    return tuple(_as_tuples(s) for s in state) if isinstance(state, list | tuple) else state


class SideRun:
    """One side trainer's resume state in ``out`` (see the module docstring)."""

    def __init__(self, out: Path, config_text: str, cfg: ResumeConfig, stop: Preemption) -> None:
        self.out, self.config_text, self.cfg, self.stop = out, config_text, cfg, stop
        self.path = out / RESUME_FILE
        self.saved: dict[str, Any] | None = self._read() if self.path.is_file() else None
        metrics = out / METRICS_FILE
        if self.saved is None:
            metrics.unlink(missing_ok=True)
        elif metrics.is_file() and metrics.stat().st_size > self.saved["metrics_bytes"]:
            with open(metrics, "r+b") as f:  # the records logged after the resume state was written
                f.truncate(self.saved["metrics_bytes"])

    def _read(self) -> dict[str, Any]:
        try:
            saved = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ConfigError(
                f"{self.path}: unreadable resume state ({type(e).__name__}); delete it to start over"
            ) from None
        if not isinstance(saved, dict) or saved.get("config") != self.config_text:
            raise ConfigError(
                f"{self.path}: this resume state was written by a run with another config; rerun with "
                "the same config to continue, or delete it (or use a new --out) to start over"
            )
        return saved

    @property
    def phase(self) -> str | None:
        """The phase the saved state belongs to (None: nothing saved, a fresh run)."""
        return None if self.saved is None else self.saved["phase"]

    def restore(self, phase: str, objects: dict[str, Stateful]) -> tuple[int, dict[str, Any]]:
        """Load the saved ``phase`` state into ``objects`` (and torch's global generator); returns the
        steps already done in it and the extras saved beside them. ``(0, {})`` when the saved state is
        of another phase or there is none."""
        if self.saved is None or self.saved["phase"] != phase:
            return 0, {}
        missing = sorted(set(objects) - set(self.saved["objects"]))
        if missing:
            raise ConfigError(
                f"{self.path}: resume state lacks {', '.join(missing)}; delete it to start over"
            )
        for name, obj in objects.items():
            _restore(obj, self.saved["objects"][name])
        torch.set_rng_state(self.saved["torch_rng"])
        return int(self.saved["step"]), dict(self.saved["extras"])

    def step_done(
        self, phase: str, step: int, objects: dict[str, Stateful], extras: dict[str, Any] | None = None
    ) -> None:
        """Call after ``step`` steps of ``phase`` are done: writes the state when it is due or a stop was
        asked for; on a stop then raises :class:`Preempted`."""
        requested = self.stop.requested
        if requested or (self.cfg.every and step % self.cfg.every == 0):
            self.save(phase, step, objects, extras)
        if requested:
            raise Preempted(
                f"{self.stop.signal} at {phase} step {step}: resume state {self.path}; the same command "
                "continues from it"
            )

    def save(
        self, phase: str, step: int, objects: dict[str, Stateful], extras: dict[str, Any] | None = None
    ) -> None:
        metrics = self.out / METRICS_FILE
        state = {
            "config": self.config_text,
            "phase": phase,
            "step": step,
            "objects": {name: _state_of(obj) for name, obj in objects.items()},
            "extras": dict(extras or {}),
            "torch_rng": torch.get_rng_state(),
            "metrics_bytes": metrics.stat().st_size if metrics.is_file() else 0,
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        write_atomic(self.path, buf.getvalue())

    def finish(self) -> None:
        """The run ended: its resume state is no longer needed."""
        self.path.unlink(missing_ok=True)


@contextmanager
def side_run(out: Path, config_text: str, cfg: ResumeConfig) -> Iterator[SideRun]:
    """A :class:`SideRun` for ``out`` (its ``config.yaml`` written from ``config_text``), with
    ``SIGTERM`` / first Ctrl-C handled as stop requests and the folder locked
    (:class:`~ernie5.store.runs.RunLock`: a second trainer into it gets one line)."""
    with RunLock(out), preemptible(cfg.grace_s) as stop:
        run = SideRun(out, config_text, cfg, stop)
        write_atomic(out / "config.yaml", config_text)
        yield run
