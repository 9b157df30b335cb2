"""Mel filterbank, log-mel, MFCC and deltas: shapes, the HTK scale, tone localisation, gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ernie5.tokenizers.audio_features import (
    dct_matrix,
    deltas,
    hz_to_mel,
    log_mel,
    mel_filterbank,
    mel_to_hz,
    mfcc,
)


def test_mel_scale_is_htk_and_invertible():
    assert hz_to_mel(700.0) == pytest.approx(2595.0 * math.log10(2.0))
    assert hz_to_mel(1000.0) == pytest.approx(999.99, abs=0.1)  # HTK: 1000 Hz is ~1000 mel
    f = torch.tensor([0.0, 100.0, 1234.5, 4000.0], dtype=torch.float64)
    assert torch.allclose(mel_to_hz(hz_to_mel(f)), f)


def test_filterbank_shape_rows_and_partition_of_unity():
    fb = mel_filterbank(256, 40, 8000)
    assert fb.shape == (40, 129) and fb.dtype == torch.float32
    assert fb.min() >= 0 and fb.max() <= 1 + 1e-6
    assert (fb.sum(dim=1) > 0).all()  # no empty filter at the default 8 kHz settings
    # between the first and the last filter centre the triangles sum to 1 at every bin
    edges = mel_to_hz(torch.linspace(hz_to_mel(0.0), hz_to_mel(4000.0), 42, dtype=torch.float64))
    freqs = torch.linspace(0, 4000, 129, dtype=torch.float64)
    inside = (freqs >= edges[1]) & (freqs <= edges[-2])
    assert torch.allclose(fb.sum(0)[inside], torch.ones(int(inside.sum())), atol=1e-5)
    # each row is a single triangle: its peak moves up with the row index
    assert (torch.diff(fb.argmax(dim=1)) >= 0).all()
    assert torch.equal(mel_filterbank(256, 40, 8000), fb)  # pure (cache returns copies)
    fb.zero_()
    assert mel_filterbank(256, 40, 8000).sum() > 0


def test_filterbank_band_limits_and_errors():
    fb = mel_filterbank(512, 20, 16000, f_min=300.0, f_max=3400.0)
    freqs = torch.linspace(0, 8000, 257)
    assert fb[:, freqs < 300].abs().sum() == 0 and fb[:, freqs > 3400].abs().sum() == 0
    with pytest.raises(ValueError):
        mel_filterbank(256, 40, 8000, f_max=5000.0)
    with pytest.raises(ValueError):
        mel_filterbank(256, 0, 8000)


@pytest.mark.parametrize("freq", [300.0, 1000.0, 2500.0])
def test_pure_tone_peaks_in_its_band(freq):
    sr = 8000
    t = torch.arange(sr // 2, dtype=torch.float32) / sr
    wave = 0.5 * torch.sin(2 * math.pi * freq * t)[None]
    lm = log_mel(wave, sr)
    assert lm.shape == (1, 40, 1 + wave.shape[1] // 80)
    peak_band = int(lm[0, :, 5:-5].mean(-1).argmax())
    fb = mel_filterbank(256, 40, sr)
    k = round(freq * 256 / sr)
    assert peak_band in set(torch.nonzero(fb[:, k] > 0.2).flatten().tolist())


def test_log_mel_shapes_batching_and_silence():
    wave = torch.randn(3, 1000) * 0.1
    lm = log_mel(wave, 8000)
    assert lm.shape == (3, 40, 13)
    assert torch.allclose(log_mel(wave[1], 8000), lm[1:2], atol=1e-5)  # 1-D input is B=1
    silent = log_mel(torch.zeros(1, 400), 8000, eps=1e-5)
    assert torch.allclose(silent, torch.full_like(silent, math.log(1e-5)))
    short = log_mel(torch.randn(2, 50), 8000)  # shorter than half a window: zero padding accepts it
    assert short.shape == (2, 40, 1)


def test_gradients_flow_through_log_mel_and_mfcc():
    wave = (torch.randn(2, 800) * 0.1).requires_grad_(True)
    (log_mel(wave, 8000).mean() + mfcc(wave, 8000).square().mean()).backward()
    assert wave.grad is not None and torch.isfinite(wave.grad).all() and wave.grad.abs().sum() > 0


def test_mfcc_is_orthonormal_dct_of_log_mel():
    d = dct_matrix(40, 40)
    assert torch.allclose(d @ d.T, torch.eye(40), atol=1e-5)
    wave = torch.randn(2, 1600) * 0.1
    c = mfcc(wave, 8000, n_mfcc=13)
    assert c.shape == (2, 13, 21)
    lm = log_mel(wave, 8000)
    full = torch.einsum("km,bmt->bkt", d, lm)
    assert torch.allclose(c, full[:, :13], atol=1e-4)
    assert torch.allclose(c[:, 0], lm.sum(1) / math.sqrt(40), atol=1e-4)  # c0 is the scaled mean
    scipy_fft = pytest.importorskip("scipy.fft")
    ref = scipy_fft.dct(lm.numpy(), type=2, norm="ortho", axis=1)[:, :13]
    np.testing.assert_allclose(c.numpy(), ref, atol=1e-4)


def test_deltas_of_ramp_and_constant():
    ramp = torch.arange(10, dtype=torch.float32).expand(2, 3, 10)
    d = deltas(ramp)
    assert d.shape == ramp.shape
    assert torch.allclose(d[..., 2:-2], torch.ones(2, 3, 6))  # interior: exact slope
    assert torch.allclose(deltas(torch.full((1, 2, 5), 3.0)), torch.zeros(1, 2, 5))
    assert torch.allclose(deltas(ramp, n=1)[..., 1:-1], torch.ones(2, 3, 8))
    with pytest.raises(ValueError):
        deltas(torch.zeros(3, 4))
