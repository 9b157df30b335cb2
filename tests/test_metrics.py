"""Table-driven tests of the image reconstruction metrics (PSNR, SSIM) in ernie5.metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ernie5.metrics import PSNR_CAP_DB, psnr, ssim


def _ramp(h: int = 32, w: int = 32, c: int = 3) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    img = (40 + 3 * x + 2 * y) % 200 + 20
    return np.repeat(img[..., None], c, axis=2).astype(np.uint8)


def _const(value: int, shape=(16, 16, 3)) -> np.ndarray:
    return np.full(shape, value, dtype=np.uint8)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (_ramp(), _ramp(), PSNR_CAP_DB),  # identical: capped, finite
        (_const(100), _const(105), 10 * math.log10(255**2 / 25)),  # MSE 25 -> 34.15 dB
        (_const(0), _const(255), 0.0),  # worst case: MSE = peak^2
        (_const(10, (8, 8)), _const(20, (8, 8)), 10 * math.log10(255**2 / 100)),  # grayscale (H, W)
        (
            _ramp().astype(np.int16) + 0,
            np.clip(_ramp().astype(np.int16) + 1, 0, 255),
            10 * math.log10(255**2),
        ),
    ],
)
def test_psnr_table(a, b, expected):
    assert psnr(a, b) == pytest.approx(expected, abs=1e-6)


def test_psnr_known_noise_level():
    rng = np.random.default_rng(0)
    a = rng.integers(20, 236, size=(64, 64, 3)).astype(np.uint8)
    noise = rng.choice([-8, 8], size=a.shape)  # |error| = 8 everywhere: MSE 64 exactly
    b = (a.astype(np.int16) + noise).astype(np.uint8)
    assert psnr(a, b) == pytest.approx(20 * math.log10(255 / 8), abs=1e-9)


def test_psnr_of_a_stack_is_the_mean_of_per_image_values():
    a = np.stack([_const(100), _const(100)])
    b = np.stack([_const(105), _const(100)])  # one exact image -> capped at 100 dB, not inf
    assert psnr(a, b) == pytest.approx((10 * math.log10(255**2 / 25) + PSNR_CAP_DB) / 2)
    clips = np.stack([a, a])  # (N, T, H, W, C)
    assert psnr(clips, np.stack([b, b])) == pytest.approx(psnr(a, b))


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (_ramp(), _ramp(), 1.0),
        (_const(0), _const(0), 1.0),
        # constant images: only the luminance term, (2 mu_a mu_b + c1) / (mu_a^2 + mu_b^2 + c1)
        (_const(100), _const(150), (2 * 100 * 150 + 6.5025) / (100**2 + 150**2 + 6.5025)),
        (_const(0), _const(255), 6.5025 / (255**2 + 6.5025)),
        (_const(50, (12, 12)), _const(60, (12, 12)), (2 * 50 * 60 + 6.5025) / (50**2 + 60**2 + 6.5025)),
    ],
)
def test_ssim_table(a, b, expected):
    assert ssim(a, b) == pytest.approx(expected, abs=1e-9)


def test_ssim_orders_distortions_and_is_symmetric():
    rng = np.random.default_rng(1)
    a = _ramp(48, 48)
    light = np.clip(a + rng.normal(0, 5, a.shape), 0, 255).astype(np.uint8)
    heavy = np.clip(a + rng.normal(0, 40, a.shape), 0, 255).astype(np.uint8)
    assert 1.0 > ssim(a, light) > ssim(a, heavy) > 0.0
    assert ssim(a, heavy) == pytest.approx(ssim(heavy, a))
    inverted = (255 - a).astype(np.uint8)
    assert ssim(a, inverted) < 0.2  # anti-correlated structure


def test_ssim_small_images_use_a_smaller_window():
    a = _ramp(6, 6)
    b = np.clip(a.astype(np.int16) + 3, 0, 255).astype(np.uint8)
    assert 0.9 < ssim(a, b) < 1.0


@pytest.mark.parametrize("fn", [psnr, ssim])
def test_image_metrics_reject_mismatched_shapes(fn):
    with pytest.raises(ValueError, match="shapes differ"):
        fn(_const(0, (8, 8, 3)), _const(0, (8, 8, 1)))
    with pytest.raises(ValueError, match="expected an image"):
        fn(np.zeros(4, dtype=np.uint8), np.zeros(4, dtype=np.uint8))


def test_image_metrics_are_higher_is_better():
    import evals.tasks  # noqa: F401  (registers every task)
    from evals.task import TASKS

    declared = {m: h for n in TASKS.names() for m, h in TASKS.get(n).metrics.items()}
    for name in ("psnr", "ssim", "psnr_gain", "ssim_gain"):
        assert declared[name] is True
