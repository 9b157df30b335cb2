"""Audio features in pure torch: mel filterbank, log-mel spectrogram, MFCC and deltas (no torchaudio).

Every function is pure and differentiable with respect to the waveform (the log-mel is used inside the
audio codec's reconstruction loss). Waveforms are float tensors ``wave_BS`` (batch, samples) in [-1, 1];
features are ``(B, C, T)`` with ``T = 1 + S // hop`` frames (centred STFT).

The mel scale is HTK's, ``mel(f) = 2595 * log10(1 + f / 700)``, and the triangular filters have peak 1
with no area normalisation (torchaudio's ``melscale_fbanks(mel_scale="htk", norm=None)``), so on the band
between the first and the last filter centre the filters sum to 1 at every frequency.

References:
  - S. Young et al., *The HTK Book* (the mel scale and triangular filterbank, section 5.4).
  - S. Furui, "Speaker-independent isolated word recognition using dynamic features of speech spectrum",
    IEEE TASSP 1986 (delta features as a regression over +-N frames).

Deviations:
  1. The STFT pads both ends with zeros (``pad_mode="constant"``), not by reflection, so clips shorter
     than half a window (possible for generated audio) are accepted.
  2. The MFCC is the orthonormal DCT-II of the natural-log mel energies, without liftering.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["deltas", "dct_matrix", "hz_to_mel", "log_mel", "mel_filterbank", "mel_to_hz", "mfcc"]


def hz_to_mel(f_hz: float | torch.Tensor) -> float | torch.Tensor:
    """HTK mel of a frequency in Hz."""
    if isinstance(f_hz, torch.Tensor):
        return 2595.0 * torch.log10(1.0 + f_hz / 700.0)
    return 2595.0 * math.log10(1.0 + f_hz / 700.0)


def mel_to_hz(m: float | torch.Tensor) -> float | torch.Tensor:
    """Inverse of :func:`hz_to_mel`."""
    if isinstance(m, torch.Tensor):
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


@functools.lru_cache(maxsize=32)
def _filterbank(n_fft: int, n_mels: int, sample_rate: int, f_min: float, f_max: float) -> torch.Tensor:
    n_freqs = n_fft // 2 + 1
    freqs_F = torch.linspace(0.0, sample_rate / 2, n_freqs, dtype=torch.float64)
    mels_P = torch.linspace(hz_to_mel(f_min), hz_to_mel(f_max), n_mels + 2, dtype=torch.float64)
    hz_P = mel_to_hz(mels_P)
    lower_MF = (freqs_F[None, :] - hz_P[:-2, None]) / (hz_P[1:-1, None] - hz_P[:-2, None])
    upper_MF = (hz_P[2:, None] - freqs_F[None, :]) / (hz_P[2:, None] - hz_P[1:-1, None])
    return torch.clamp(torch.minimum(lower_MF, upper_MF), min=0.0).to(torch.float32)


def mel_filterbank(
    n_fft: int, n_mels: int, sample_rate: int, f_min: float = 0.0, f_max: float | None = None
) -> torch.Tensor:
    """Triangular HTK-mel filters, ``float32 (n_mels, n_fft // 2 + 1)``, peak 1 (no area normalisation).

    The ``n_mels + 2`` edge frequencies are equally spaced in mel between ``f_min`` and ``f_max``
    (default: Nyquist); filter ``m`` rises from edge ``m`` to 1 at edge ``m + 1`` and falls to 0 at edge
    ``m + 2``, evaluated at the STFT bin frequencies ``k * sample_rate / n_fft``.
    """
    f_max = sample_rate / 2 if f_max is None else float(f_max)
    if not 0.0 <= f_min < f_max <= sample_rate / 2:
        raise ValueError(f"need 0 <= f_min < f_max <= sample_rate/2, got f_min={f_min}, f_max={f_max}")
    if n_mels < 1 or n_fft < 2:
        raise ValueError(f"need n_mels >= 1 and n_fft >= 2, got n_mels={n_mels}, n_fft={n_fft}")
    return _filterbank(n_fft, n_mels, sample_rate, float(f_min), f_max).clone()


@functools.lru_cache(maxsize=32)
def _dct(n_out: int, n_in: int) -> torch.Tensor:
    n = torch.arange(n_in, dtype=torch.float64)
    k = torch.arange(n_out, dtype=torch.float64)[:, None]
    basis_KN = torch.cos(math.pi / n_in * (n + 0.5) * k)
    basis_KN[0] *= 1.0 / math.sqrt(2.0)
    return (basis_KN * math.sqrt(2.0 / n_in)).to(torch.float32)


def dct_matrix(n_out: int, n_in: int) -> torch.Tensor:
    """Orthonormal DCT-II basis ``float32 (n_out, n_in)``: ``y = D @ x`` (``scipy.fft.dct(x, norm="ortho")``
    truncated to ``n_out`` coefficients)."""
    if not 1 <= n_out <= n_in:
        raise ValueError(f"need 1 <= n_out <= n_in, got n_out={n_out}, n_in={n_in}")
    return _dct(n_out, n_in).clone()


def log_mel(
    wave_BS: torch.Tensor,
    sample_rate: int,
    n_fft: int = 256,
    hop: int = 80,
    n_mels: int = 40,
    eps: float = 1e-5,
    f_min: float = 0.0,
    f_max: float | None = None,
) -> torch.Tensor:
    """Natural-log mel power spectrogram ``(B, n_mels, 1 + S // hop)`` of ``wave_BS`` ``(B, S)`` (or ``(S,)``,
    treated as ``B = 1``).

    STFT with a periodic Hann window of ``n_fft`` samples, hop ``hop``, centred frames (zero padding, see
    Deviations); power ``|X|^2`` is pooled by :func:`mel_filterbank` and ``log(mel + eps)`` is returned.
    Differentiable; runs on the device and in the dtype of ``wave_BS`` (float32 if it is not floating).
    """
    if wave_BS.dim() == 1:
        wave_BS = wave_BS[None]
    if wave_BS.dim() != 2:
        raise ValueError(f"wave must be (B, S) or (S,), got shape {tuple(wave_BS.shape)}")
    if not wave_BS.is_floating_point():
        wave_BS = wave_BS.float()
    window_W = torch.hann_window(n_fft, periodic=True, dtype=wave_BS.dtype, device=wave_BS.device)
    spec_BFT = torch.stft(
        wave_BS,
        n_fft=n_fft,
        hop_length=hop,
        win_length=n_fft,
        window=window_W,
        center=True,
        pad_mode="constant",
        return_complex=True,
    )
    power_BFT = spec_BFT.real.square() + spec_BFT.imag.square()
    fb_MF = mel_filterbank(n_fft, n_mels, sample_rate, f_min, f_max).to(wave_BS.device, wave_BS.dtype)
    mel_BMT = torch.einsum("mf,bft->bmt", fb_MF, power_BFT)
    return torch.log(mel_BMT + eps)


def mfcc(wave_BS: torch.Tensor, sample_rate: int, n_mfcc: int = 13, **log_mel_kwargs) -> torch.Tensor:
    """MFCCs ``(B, n_mfcc, T)``: the orthonormal DCT-II over the mel axis of :func:`log_mel` (same keyword
    arguments; ``n_mels`` defaults to 40 and must be at least ``n_mfcc``)."""
    logmel_BMT = log_mel(wave_BS, sample_rate, **log_mel_kwargs)
    dct_KM = dct_matrix(n_mfcc, logmel_BMT.shape[1]).to(logmel_BMT.device, logmel_BMT.dtype)
    return torch.einsum("km,bmt->bkt", dct_KM, logmel_BMT)


def deltas(x_BCT: torch.Tensor, n: int = 2) -> torch.Tensor:
    """Time derivative of features ``(B, C, T)`` by regression over ``+-n`` frames, edges replicated:
    ``d_t = sum_{k=1..n} k (x_{t+k} - x_{t-k}) / (2 sum_{k=1..n} k^2)`` (a linear ramp gives its slope)."""
    if x_BCT.dim() != 3:
        raise ValueError(f"deltas expects (B, C, T), got shape {tuple(x_BCT.shape)}")
    if n < 1:
        raise ValueError(f"deltas needs n >= 1, got {n}")
    t = x_BCT.shape[-1]
    padded_BCT = torch.cat([x_BCT[..., :1].expand(-1, -1, n), x_BCT, x_BCT[..., -1:].expand(-1, -1, n)], -1)
    out_BCT = torch.zeros_like(x_BCT)
    for k in range(1, n + 1):
        out_BCT = out_BCT + k * (padded_BCT[..., n + k : n + k + t] - padded_BCT[..., n - k : n - k + t])
    return out_BCT / (2.0 * sum(k * k for k in range(1, n + 1)))
