"""Metrics shared by training and evaluation: image reconstruction quality (PSNR, SSIM).

Pure functions of uint8 arrays: no I/O, no models, no global state. The tokenizer and refiner
trainers log them; the harness's reconstruction and refiner tasks score with them.

References:
  * SSIM: Wang, Bovik, Sheikh, Simoncelli (2004), "Image quality assessment: from error visibility
    to structural similarity"; matches ``skimage.metrics.structural_similarity`` with
    ``gaussian_weights=True, use_sample_covariance=False``.
"""

from __future__ import annotations

import numpy as np

PSNR_CAP_DB = 100.0
"""PSNR of identical images (MSE 0): a finite cap, so means and JSON stay finite."""
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def _image_pair(a: np.ndarray, b: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Both as float64 ``(N, H, W, C)``; accepts ``(H, W)``, ``(H, W, C)`` or ``(..., H, W, C)``."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"{name}: shapes differ, {a.shape} vs {b.shape}")
    if a.ndim < 2:
        raise ValueError(f"{name}: expected an image (H, W[, C]) or a stack (..., H, W, C), got {a.shape}")
    if a.ndim == 2:
        a, b = a[..., None], b[..., None]
    return a.reshape(-1, *a.shape[-3:]).astype(np.float64), b.reshape(-1, *b.shape[-3:]).astype(np.float64)


def psnr(a: np.ndarray, b: np.ndarray, data_range: float = 255.0) -> float:
    """Peak signal-to-noise ratio in dB, ``10 log10(data_range^2 / MSE)``, of uint8 images.

    Args:
        a, b: images of the same shape: ``(H, W)``, ``(H, W, C)``, or a stack ``(..., H, W, C)`` (frames or
            a batch), values 0..255.
        data_range: peak value (255 for uint8).

    Returns:
        For one image the PSNR over all its pixels and channels; for a stack the mean of the per-image
        values. An image with MSE 0 scores :data:`PSNR_CAP_DB` (100 dB), and no image scores above it.
    """
    a, b = _image_pair(a, b, "psnr")
    mse = ((a - b) ** 2).reshape(len(a), -1).mean(axis=1)
    with np.errstate(divide="ignore"):
        values = 10.0 * np.log10(data_range**2 / mse)
    return float(np.minimum(values, PSNR_CAP_DB).mean())


def _gaussian_valid(x: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Separable 'valid' gaussian filter over axes 1, 2 of ``(N, H, W, C)``."""
    from numpy.lib.stride_tricks import sliding_window_view

    x = np.tensordot(sliding_window_view(x, len(g), axis=1), g, axes=([-1], [0]))
    return np.tensordot(sliding_window_view(x, len(g), axis=2), g, axes=([-1], [0]))


def ssim(a: np.ndarray, b: np.ndarray, data_range: float = 255.0) -> float:
    """Mean structural similarity (Wang et al. 2004) of uint8 images.

    Gaussian 11x11 window with sigma 1.5, ``K1 = 0.01``, ``K2 = 0.03``, population (not sample) variances,
    the mean over 'valid' window positions (no padding), then over channels and images; this is
    ``skimage.metrics.structural_similarity(gaussian_weights=True, use_sample_covariance=False)``. Images
    smaller than 11 pixels use the largest odd window that fits.

    Args:
        a, b: images of the same shape: ``(H, W)``, ``(H, W, C)`` or a stack ``(..., H, W, C)``.
        data_range: ``L`` in ``(K1 L)^2`` and ``(K2 L)^2`` (255 for uint8).

    Returns:
        SSIM in [-1, 1]; 1.0 for identical images.
    """
    a, b = _image_pair(a, b, "ssim")
    side = min(SSIM_WINDOW, a.shape[1], a.shape[2])
    side -= 1 - side % 2
    coords = np.arange(side) - (side - 1) / 2
    g = np.exp(-(coords**2) / (2 * SSIM_SIGMA**2))
    g /= g.sum()
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    mu_a, mu_b = _gaussian_valid(a, g), _gaussian_valid(b, g)
    var_a = _gaussian_valid(a * a, g) - mu_a**2
    var_b = _gaussian_valid(b * b, g) - mu_b**2
    cov = _gaussian_valid(a * b, g) - mu_a * mu_b
    num = (2 * mu_a * mu_b + c1) * (2 * cov + c2)
    den = (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
    return float((num / den).mean())
