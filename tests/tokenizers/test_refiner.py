"""Cascaded diffusion refiner: UNet and sampler shapes, determinism, persistence, and that it learns."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from ernie5.config import ConfigError, dump, from_dict, load
from ernie5.metrics import psnr
from ernie5.tokenizers.refiner import Refiner, RefinerConfig, RefinerError, to_pixels, upsample_uint8
from tests.conftest import without_manifest
from train.side.refiner import RefinerTrainConfig, render_pairs

TINY = RefinerConfig(low_size=16, channels=(16, 32), n_res_blocks=1, time_dim=32, sample_steps=4)
"""16 px -> 32 px; the UNet runs at 16x16 and 8x8 (patch 2)."""


def _pairs(n: int, seed: int = 0, cfg: RefinerConfig = TINY) -> tuple[np.ndarray, np.ndarray]:
    return render_pairs(n, random.Random(seed), cfg.low_size, cfg.scale)


def _fit(refiner: Refiner, low: np.ndarray, high: np.ndarray, steps: int, lr: float = 3e-3) -> list[float]:
    """Plain AdamW on a fixed batch of pairs; returns the losses."""
    opt = torch.optim.AdamW(refiner.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    low_BCHW, high_BCHW = to_pixels(low), to_pixels(high)
    losses = []
    for _ in range(steps):
        loss = refiner.loss(low_BCHW, high_BCHW, generator=generator)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def tiny_refiner() -> Refiner:
    """A tiny refiner with randomised output layer (a zero-initialised one would make every test trivial)."""
    torch.manual_seed(0)
    refiner = Refiner(TINY)
    with torch.no_grad():
        for p in refiner.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return refiner


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"scale": 1}, "scale=1"),
        ({"channels": ()}, "channels"),
        ({"channels": (12, 32)}, "norm_groups"),
        ({"low_size": 5}, "divisible"),
        ({"patch_size": 0}, "patch_size"),
        ({"residual_scale": 0.0}, "residual_scale"),
        ({"sample_noise_aug": 0.5}, "sample_noise_aug"),
        ({"loss_t_min": 1.0}, "loss_t_min"),
        ({"noise_aug_prob": 1.5}, "noise_aug_prob"),
        ({"sample_steps": 0}, "sample_steps"),
        ({"t_sampling": "cosine"}, "t_sampling"),
    ],
)
def test_config_rejects(overrides, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(RefinerConfig, overrides)


def test_configs_round_trip_through_yaml(tmp_path):
    for cfg in (RefinerConfig(), TINY, RefinerTrainConfig(refiner=TINY, eval_steps=(2, 3))):
        path = tmp_path / "cfg.yaml"
        path.write_text(dump(cfg))
        assert load(type(cfg), path) == cfg


def test_default_refiner_is_small():
    n_params = sum(p.numel() for p in Refiner(RefinerConfig()).parameters())
    assert n_params <= 1_000_000


# ---------------------------------------------------------------------- shapes
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"patch_size": 1},
        {"attention": False},
        {"channels": (16, 32, 32), "n_res_blocks": 2},
        {"predict_residual": False},
        {"scale": 4, "low_size": 8},
    ],
)
def test_unet_and_velocity_shapes(overrides):
    cfg = replace(TINY, **overrides)
    refiner = Refiner(cfg)
    x_BCHW = torch.randn(2, 3, cfg.high_size, cfg.high_size)
    t_B, aug_B = torch.tensor([0.3, 1.0]), torch.zeros(2)
    assert refiner(x_BCHW, x_BCHW, t_B, aug_B).shape == x_BCHW.shape
    assert refiner.velocity(x_BCHW, x_BCHW, t_B, aug_B).shape == x_BCHW.shape
    low, _ = _pairs(3, cfg=cfg)
    out = refiner.refine(low, steps=2)
    assert out.shape == (3, cfg.high_size, cfg.high_size, 3) and out.dtype == np.uint8


def test_refine_images_clips_and_sdedit(tiny_refiner):
    low, _ = _pairs(3)
    assert tiny_refiner.refine(low).shape == (3, 32, 32, 3)
    clips = np.stack([low, low[::-1]])  # (2 clips, 3 frames, 16, 16, 3)
    assert tiny_refiner.refine(clips, steps=2).shape == (2, 3, 32, 32, 3)
    sdedit = tiny_refiner.refine(low, steps=3, start_t=0.5)
    assert sdedit.shape == (3, 32, 32, 3) and sdedit.dtype == np.uint8


@pytest.mark.parametrize(
    "images, kwargs, message",
    [
        (np.zeros((2, 16, 16, 3), np.float32), {}, "uint8"),
        (np.zeros((16, 16, 3), np.uint8), {}, "uint8"),
        (np.zeros((2, 16, 16, 1), np.uint8), {}, "uint8"),
        (np.zeros((2, 15, 15, 3), np.uint8), {}, "divisible"),
        (np.zeros((2, 16, 16, 3), np.uint8), {"steps": 0}, "steps"),
        (np.zeros((2, 16, 16, 3), np.uint8), {"start_t": 0.0}, "start_t"),
        (np.zeros((2, 16, 16, 3), np.uint8), {"start_t": 1.5}, "start_t"),
    ],
)
def test_refine_rejects(tiny_refiner, images, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_refiner.refine(images, **kwargs)


# ---------------------------------------------------------------------- determinism
def test_sampling_is_deterministic_for_a_seed(tiny_refiner):
    low, _ = _pairs(4)
    a = tiny_refiner.refine(low, seed=7)
    assert np.array_equal(a, tiny_refiner.refine(low, seed=7))
    assert not np.array_equal(a, tiny_refiner.refine(low, seed=8))
    # Noise is drawn up front: the batch size does not change what an image gets (float rounding aside).
    split = tiny_refiner.refine(low, seed=7, batch_size=1)
    assert np.abs(split.astype(int) - a.astype(int)).max() <= 1
    assert np.array_equal(
        tiny_refiner.refine(low, seed=7, start_t=0.4), tiny_refiner.refine(low, seed=7, start_t=0.4)
    )


def test_frames_of_a_clip_share_noise(tiny_refiner):
    low, _ = _pairs(1)
    clip = np.repeat(low[:, None], 3, axis=1)  # a static clip
    out = tiny_refiner.refine(clip, steps=2)
    assert np.array_equal(out[0, 0], out[0, 1]) and np.array_equal(out[0, 0], out[0, 2])


def test_training_mode_is_restored(tiny_refiner):
    tiny_refiner.train()
    tiny_refiner.refine(_pairs(1)[0], steps=1)
    assert tiny_refiner.training


# ---------------------------------------------------------------------- persistence
def test_save_load_round_trip(tiny_refiner, tmp_path):
    low, _ = _pairs(3)
    path = tiny_refiner.save(tmp_path / "refiner", meta={"note": "x"})
    loaded = Refiner.load(path)
    assert loaded.cfg == tiny_refiner.cfg
    assert np.array_equal(loaded.refine(low, seed=3), tiny_refiner.refine(low, seed=3))
    meta = json.loads((path / "meta.json").read_text())
    assert meta["note"] == "x" and meta["n_params"] == sum(p.numel() for p in tiny_refiner.parameters())
    assert not list(tmp_path.glob(".*tmp*"))


def _corrupt_weights(path):
    (path / "refiner.safetensors").write_bytes(b"not safetensors")


def _bad_version(path):
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "version": "other/0"}))


def _other_config(path):
    (path / "config.yaml").write_text(dump(replace(TINY, channels=(16, 48))))


def _unknown_key(path):
    (path / "config.yaml").write_text(dump(TINY) + "bogus: 1\n")


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: (p / "meta.json").unlink(), "missing meta.json"),
        (lambda p: (p / "refiner.safetensors").unlink(), "missing refiner.safetensors"),
        (lambda p: (p / "meta.json").write_text("{"), "unreadable JSON"),
        (_bad_version, "version 'other/0'"),
        (_unknown_key, "unknown key 'bogus'"),
        (_corrupt_weights, "unreadable"),
        (_other_config, "does not match config.yaml|has shape"),
    ],
)
def test_load_errors_are_one_line(tiny_refiner, tmp_path, corrupt, message):
    path = tiny_refiner.save(tmp_path / "refiner")
    corrupt(path)
    without_manifest(path)  # the manifest would name any edit first (tests/tokenizers/test_folder.py)
    with pytest.raises(RefinerError, match=message) as info:
        Refiner.load(path)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------- learning
def test_loss_falls_on_a_handful_of_pairs():
    torch.manual_seed(0)
    low, high = _pairs(4)
    losses = _fit(Refiner(TINY), low, high, steps=60)
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])


def test_the_refiner_improves_psnr_when_overfitting():
    torch.manual_seed(0)
    low, high = _pairs(8, seed=1)
    refiner = Refiner(TINY)
    _fit(refiner, low, high, steps=300)
    bicubic = psnr(high, upsample_uint8(low, TINY.scale))
    refined = psnr(high, refiner.refine(low, steps=TINY.sample_steps))
    assert refined > bicubic + 1.0, (refined, bicubic)
