"""Learning-rate and loss-weight schedules: pure functions of the step and the run's ``train.steps``.

Every schedule here is defined over the total ``train.steps``: the WSD decay window, the cosine's
length and the ``stage2_frac`` switch are fractions of it. Extending a run (``--resume`` with a larger
``train.steps``, :mod:`train.loop`) therefore re-evaluates them over the new total from the resume
point on, while the steps already trained keep the values they had: a WSD run resumed after its decay
began returns to the peak learning rate until the new decay window, and a cosine run continues from
the point of the longer curve that its step falls on.
"""

from __future__ import annotations

import math

from train.config import ScheduleConfig, TrainConfig


def lr_at(step: int, total_steps: int, peak: float, cfg: ScheduleConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    Linear warmup to ``peak``; then ``wsd`` holds the peak and decays linearly to
    ``min_lr_ratio * peak`` over the last ``decay_frac`` of the steps, ``cosine`` decays along a
    half cosine to ``min_lr_ratio * peak``, and ``constant`` holds the peak.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    floor = peak * cfg.min_lr_ratio
    if cfg.kind == "constant":
        return peak
    if cfg.kind == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = round(cfg.decay_frac * total_steps)
    decay_start = total_steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return peak
    progress = (step - decay_start + 1) / decay_steps
    return peak + (floor - peak) * min(1.0, progress)


def staged(step: int, total_steps: int, first: float, final: float, cfg: TrainConfig) -> float:
    """A value that switches from ``first`` to ``final`` at ``stage2_frac`` of the run.

    The paper switches the MTP weight (0.3 -> 0.1) and the bias update speed (1e-4 -> 1e-5) between
    its 8K pretraining stage and mid-training.
    """
    return first if step < cfg.stage2_frac * total_steps else final
