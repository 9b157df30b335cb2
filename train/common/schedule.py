"""The learning-rate schedule every trainer uses, and the pretraining loss-weight switch: pure functions
of the step and the run's total steps.

Every schedule here is defined over the total steps: the WSD decay window, the cosine's length and the
``staged`` switch are fractions of it. Extending a pretraining run (``--resume`` with a larger
``train.steps``, :mod:`train.pretrain.loop`) therefore re-evaluates them over the new total from the resume
point on, while the steps already trained keep the values they had: a WSD run resumed after its decay
began returns to the peak learning rate until the new decay window, and a cosine run continues from
the point of the longer curve that its step falls on.

The side-model trainers (:mod:`train.side.audio_codec`, :mod:`train.side.vision_tokenizer`,
:mod:`train.side.refiner`) run the ``cosine`` shape; those with a time budget pass the cosine's
``progress`` themselves (the larger of the step and the time fractions), so a budget-capped run still
anneals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ernie5.config import check


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleConfig:
    """Learning-rate schedule: warmup, then warmup-stable-decay (the paper's stage 1) or cosine."""

    kind: Literal["wsd", "cosine", "constant"] = "wsd"
    """Schedule shape after warmup."""
    warmup_steps: int = 50
    """Linear warmup steps from 0."""
    decay_frac: float = 0.2
    """WSD: fraction of all steps spent in the final linear decay."""
    min_lr_ratio: float = 0.1
    """Final lr as a fraction of the peak (the paper's mid-training cosine goes 1e-4 -> 1e-5)."""

    def __post_init__(self) -> None:
        check(self.warmup_steps >= 0, f"warmup_steps={self.warmup_steps} must be >= 0")
        check(0 <= self.decay_frac <= 1, f"decay_frac={self.decay_frac} must be in [0, 1]")
        check(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")


def cosine_progress(step: int, total_steps: int, warmup_steps: int) -> float:
    """How far along the cosine step ``step`` is: its fraction of the steps after warmup (may pass 1)."""
    return (step - warmup_steps) / max(1, total_steps - warmup_steps)


def lr_at(
    step: int, total_steps: int, peak: float, cfg: ScheduleConfig, progress: float | None = None
) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    Linear warmup to ``peak``; then ``wsd`` holds the peak and decays linearly to
    ``min_lr_ratio * peak`` over the last ``decay_frac`` of the steps, ``cosine`` decays along a
    half cosine to ``min_lr_ratio * peak``, and ``constant`` holds the peak. ``progress`` places a
    ``cosine`` step on its curve (0 -> 1, clipped at 1); None = :func:`cosine_progress` of the step.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    floor = peak * cfg.min_lr_ratio
    if cfg.kind == "constant":
        return peak
    if cfg.kind == "cosine":
        if progress is None:
            progress = cosine_progress(step, total_steps, cfg.warmup_steps)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    decay_steps = round(cfg.decay_frac * total_steps)
    decay_start = total_steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return peak
    progress = (step - decay_start + 1) / decay_steps
    return peak + (floor - peak) * min(1.0, progress)


def staged(step: int, total_steps: int, first: float, final: float, switch_frac: float) -> float:
    """A value that switches from ``first`` to ``final`` at ``switch_frac`` of the run
    (``train.stage2_frac``).

    The paper switches the MTP weight (0.3 -> 0.1) and the bias update speed (1e-4 -> 1e-5) between
    its 8K pretraining stage and mid-training.
    """
    return first if step < switch_frac * total_steps else final
