"""The refiner's trainer: seeded degradations, its learning-rate schedule, the output folder."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from ernie5.tokenizers.refiner import Refiner, RefinerConfig
from train.common.schedule import lr_at
from train.side.refiner import RefinerTrainConfig, degrade, render_pairs, train_refiner

TINY = RefinerConfig(low_size=16, channels=(16, 32), n_res_blocks=1, time_dim=32, sample_steps=4)
"""16 px -> 32 px (the refiner's own tests' tiny config)."""


def _pairs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return render_pairs(n, random.Random(seed), TINY.low_size, TINY.scale)


def test_degrade_is_seeded_and_keeps_shape():
    cfg = RefinerTrainConfig(p_blur=0.5, p_noise=0.5, p_jpeg=0.5)
    low, _ = _pairs(6)
    a = degrade(low, random.Random(3), cfg, None)
    assert a.shape == low.shape and a.dtype == np.uint8
    assert np.array_equal(a, degrade(low, random.Random(3), cfg, None))
    assert not np.array_equal(a, low)
    off = RefinerTrainConfig(p_tokenizer=0.0, p_blur=0.0, p_noise=0.0, p_jpeg=0.0)
    assert np.array_equal(degrade(low, random.Random(3), off, None), low)


@pytest.mark.parametrize(
    "step, progress, expected",
    [
        (0, 0.0, 2e-3 / 50),
        (49, 0.0, 2e-3),
        (50, 0.0, 2e-3),
        (60, 0.5, 2e-3 * (0.05 + 0.95 * 0.5)),
        (99, 1.0, 1e-4),
    ],
)
def test_lr_schedule(step, progress, expected):
    cfg = RefinerTrainConfig()
    assert lr_at(step, cfg.steps, cfg.optim.lr, cfg.schedule, progress) == pytest.approx(expected)


def test_train_refiner_writes_its_folder(tmp_path):
    cfg = RefinerTrainConfig(
        refiner=replace(TINY, sample_steps=2),
        steps=3,
        batch_size=4,
        eval_images=4,
        eval_steps=(1,),
        log_every=1,
    )
    # An empty data root: shapes only, whatever $ERNIE5_DATA_DIR says.
    (tmp_path / "no-data").mkdir()
    summary = train_refiner(cfg, tmp_path / "run", data_dir=tmp_path / "no-data")
    names = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"config.yaml", "meta.json", "metrics.jsonl", "refiner", "summary.json"} <= names
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    assert summary["steps"] == 3 and set(summary["eval"]) == {"shapes"}
    row = summary["eval"]["shapes"]
    assert {"bicubic", "steps_1", "steps_2", "sdedit_t0.5_steps_10"} <= set(row)
    assert row["steps_2"]["psnr_gain"] == pytest.approx(
        row["steps_2"]["psnr"] - row["bicubic"]["psnr"], abs=2e-3
    )
    assert summary["psnr_gain"] == row["steps_2"]["psnr_gain"]
    Refiner.load(tmp_path / "run" / "refiner")


@pytest.mark.slow
def test_train_refiner_beats_bicubic_in_a_minute(tmp_path):
    summary = train_refiner(
        RefinerTrainConfig(eval_images=32, eval_steps=(4,)), tmp_path / "run", time_budget_s=60
    )
    assert summary["stopped_early_at_step"] > 0
    assert summary["eval"]["shapes"]["steps_4"]["psnr_gain"] > 0
