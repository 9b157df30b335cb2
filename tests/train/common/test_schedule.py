"""Schedules are pure functions of the step."""

from __future__ import annotations

import pytest

from train.common.schedule import ScheduleConfig, lr_at, staged


@pytest.mark.parametrize(
    ("kind", "step", "expected"),
    [
        ("wsd", 0, 0.1),  # warmup 10 steps: (0+1)/10
        ("wsd", 9, 1.0),
        ("wsd", 50, 1.0),  # stable
        ("wsd", 79, 1.0),  # decay starts at 80 (decay_frac 0.2 of 100)
        ("wsd", 99, 0.1),  # ends at min_lr_ratio
        ("cosine", 10, 1.0),
        ("cosine", 55, 0.55),
        ("cosine", 100, 0.1),
        ("constant", 99, 1.0),
    ],
)
def test_lr_table(kind, step, expected):
    cfg = ScheduleConfig(kind=kind, warmup_steps=10, decay_frac=0.2, min_lr_ratio=0.1)
    assert lr_at(step, 100, 1.0, cfg) == pytest.approx(expected, abs=1e-9)


def test_staged_switches_at_stage2():
    assert [staged(s, 10, 0.3, 0.1, 0.8) for s in (0, 7, 8, 9)] == [0.3, 0.3, 0.1, 0.1]
