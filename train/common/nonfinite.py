"""A non-finite loss or gradient in a checkpointing trainer (pretraining, SFT, RL): skip or stop.

Policy (``train.nonfinite`` / ``rl.nonfinite``): ``skip`` (default) drops the step whose loss or
gradient norm is not finite (no optimizer update, no balancing update, nothing learned from it) and
notes it in ``metrics.jsonl`` (``{"event": "nonfinite", ...}``); after ``nonfinite_patience``
consecutive skipped steps the run stops. ``stop`` stops at the first. Stopping raises
:class:`DivergedError`: one line naming the step, the first non-finite quantity (the loss term, or
the gradient norm and the first parameter whose gradient is not finite) and the last good checkpoint;
``ernie5`` exits with :data:`EXIT_DIVERGED`. A checkpoint is never written from non-finite weights
(:func:`first_nonfinite` is asked before every save).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch

from ernie5.store.checkpoint import checkpoint_dirs
from ernie5.store.runs import append_jsonl

EXIT_DIVERGED = 4
"""The exit code of a run stopped by its non-finite policy."""


class DivergedError(Exception):
    """A run stopped by its non-finite policy (one-line message; ``ernie5`` exits with 4)."""


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor | None]]) -> str | None:
    """The name of the first tensor in ``named`` holding a NaN or an infinity (None: all finite)."""
    for name, t in named:
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def nonfinite_grad(model: torch.nn.Module, replica: torch.nn.Module | None = None) -> str | None:
    """The first parameter of ``model`` whose gradient (on the master, or on its compute ``replica``
    where the gradients still live there) is not finite."""
    grads = [(n, p.grad) for n, p in model.named_parameters()]
    if replica is not None and replica is not model:
        grads += [(n, p.grad) for n, p in replica.named_parameters()]
    return first_nonfinite(grads)


class NonFinitePolicy:
    """Counts consecutive non-finite steps of one run and stops it by its policy."""

    def __init__(
        self, policy: str, patience: int, run_dir: Path, write: bool = True, key: str = "train"
    ) -> None:
        self.policy, self.patience, self.run_dir, self.write, self.key = (
            policy,
            patience,
            Path(run_dir),
            write,
            key,
        )
        self.streak = 0

    def ok(self) -> None:
        """A finite step: the streak ends."""
        self.streak = 0

    def skipped(self, step: int, what: str) -> None:
        """Step ``step`` (1-based) was not applied because ``what`` is not finite: note it, and raise
        :class:`DivergedError` when the policy says stop."""
        self.streak += 1
        if self.write:
            append_jsonl(self.run_dir / "metrics.jsonl", {"step": step, "event": "nonfinite", "what": what})
        if self.policy == "stop" or self.streak >= self.patience:
            why = (
                f"{self.key}.nonfinite=stop"
                if self.policy == "stop"
                else f"{self.streak} steps in a row, {self.key}.nonfinite_patience={self.patience}"
            )
            raise DivergedError(f"step {step}: non-finite {what} ({why}); {last_good(self.run_dir)}")


def last_good(run_dir: Path) -> str:
    """Where the run can be resumed or inspected from: its newest complete checkpoint."""
    dirs = checkpoint_dirs(run_dir)
    return f"last good checkpoint: {dirs[-1]}" if dirs else "no checkpoint written yet"


def loss_problem(values: dict[str, float | None]) -> str | None:
    """``"loss (text=nan)"`` for the first non-finite loss term in ``values``, else None."""
    for name, v in values.items():
        if v is not None and not math.isfinite(v):
            return f"loss ({name}={v})"
    return None
