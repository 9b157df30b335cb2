"""Causal convolutional RVQ audio codec: 8 kHz waveforms to 12.5-25 Hz frames of Q codes and back.

Shapes: B batch, S samples, C channels, D latent dims, N frames, Q levels. Waveforms are float
``(B, S)`` in [-1, 1] at ``cfg.sample_rate``; codes are long ``(B, N, Q)`` in ``[0, K)``.

Pipeline (SEANet / EnCodec-like, no recurrent or attention layers)::

    wave (B,S) -> conv k7 -> per stage i: residual units, act, strided conv (kernel 2 s_i, stride s_i,
               channels x2) -> act -> conv k3 to D -> z (B,D,N), N = S / hop
               -> ResidualVQ (Q EMA codebooks) -> codes (B,N,Q), z_q (B,D,N)
               -> conv k7 -> per stage (mirrored): act, transposed conv (kernel 2 s_i, stride s_i,
               channels /2), residual units -> act -> conv k7 to 1 -> tanh -> wave (B, N*hop)

``act`` is Snake (default) or ELU (``cfg.activation``).

Causality (``cfg.causal``, the default): every conv pads on the left only (``(k-1)*dilation`` for stride
1, ``k - s`` for stride s) and every transposed conv drops the ``k - s`` samples its output has beyond
``s`` per input on the right. So frame n's latent, and its codes, depend only on samples
``< (n+1) * hop`` (the end of frame n), and every decoded sample of frame n depends only on the codes of
frames ``<= n``: the codec can encode and decode a stream frame by frame with one frame of latency. There
are no normalisation layers, so a batch element never depends on another one.

A saved codec is a folder: ``codec.safetensors`` (weights and codebook buffers), ``config.yaml``
(:class:`AudioCodecConfig`) and ``meta.json`` (``version``, parameter count, caller metadata).

The pure metrics :func:`snr_db` and :func:`mel_distance` (used by the trainer's held-out evaluation and
the harness) live here.

References:
  * ERNIE 5.0 report, arXiv 2602.04705, section 2.3.1: codec-style RVQ audio tokenizer at 12.5 Hz,
    level 1 semantic (distilled, see :mod:`ernie5.tokenizers.audio_teacher`), levels >= 2 acoustic.
  * SoundStream, Zeghidour et al. 2021, arXiv 2107.03312: causal conv encoder/decoder, residual units with
    dilations, strided conv of kernel 2s, RVQ.
  * EnCodec, Défossez et al. 2022, arXiv 2210.13438 (SEANet encoder/decoder, ELU, causal padding).
  * Mimi / Moshi, arXiv 2410.00037: 12.5 Hz frame rate with causal streaming convolutions.
  * DAC, Kumar et al. 2023, arXiv 2306.06546: Snake activation ``x + sin^2(alpha x) / alpha``.

Deviations:
  1. 8 kHz (FSDD's native rate; the data of this project), default 25 Hz frames (ERNIE and Mimi use
     12.5 Hz; any rate in [12.5, 25] Hz is a config change of ``strides``) and a tiny SEANet (one residual
     unit per stage, widths 8..128, no LSTM / Transformer, no weight normalisation), so encoding and
     decoding one second takes milliseconds on a CPU.
  2. The report's audio decoder is undisclosed; this one is the encoder's mirror ending in ``tanh``.
  3. Trained without a GAN discriminator (see :mod:`train.side.audio_codec`).
  4. Snake activations (DAC) instead of SEANet's ELU by default. In a CPU-minutes budget the ELU codec
     stayed at near-silent output for hundreds of steps (log-mel L1 about 1.07 after 250 steps on
     random DTMF crops), the Snake codec learned tones from the start (0.75); ``activation="elu"``
     restores SEANet's choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ernie5.tokenizers.audio_config import AudioCodecConfig
from ernie5.tokenizers.audio_quant import ResidualVQ, code_usage
from ernie5.tokenizers.audio_teacher import SemanticTeacher, pool_to_frames
from ernie5.tokenizers.folder import load_module, save_module

VERSION = "ernie5-audio-codec/1"
"""Format string stored in ``meta.json``; :meth:`AudioCodec.load` refuses other values."""
WEIGHTS_FILE = "codec.safetensors"


class AudioCodecError(ValueError):
    """A saved audio codec is missing, invalid or does not match its config. One line."""


# ---------------------------------------------------------------------- layers
class Conv1d(nn.Conv1d):
    """A Conv1d padded so that ``S`` inputs give ``S / stride`` outputs (``S`` divisible by the stride).

    Causal: all ``(k-1)*dilation + 1 - stride`` padding on the left, so output t depends on inputs
    ``< (t+1) * stride``. Non-causal: the padding is split, the extra sample on the right.
    """

    def __init__(
        self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1, causal: bool = True
    ) -> None:
        super().__init__(c_in, c_out, kernel, stride=stride, dilation=dilation)
        total = (kernel - 1) * dilation + 1 - stride
        if total < 0:
            raise ValueError(f"kernel={kernel} must be >= stride={stride}")
        self.pad = (total, 0) if causal else (total // 2, total - total // 2)

    def forward(self, x_BCS: Tensor) -> Tensor:
        return super().forward(F.pad(x_BCS, self.pad))


class ConvTranspose1d(nn.ConvTranspose1d):
    """A ConvTranspose1d that turns ``N`` inputs into exactly ``N * stride`` outputs.

    The full output has ``(N-1)*s + k``; the ``k - s`` extra samples are dropped on the right (causal:
    output sample t then depends on inputs ``<= t // s``) or split between both ends (non-causal).
    """

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, causal: bool = True) -> None:
        super().__init__(c_in, c_out, kernel, stride=stride)
        total = kernel - stride
        if total < 0:
            raise ValueError(f"kernel={kernel} must be >= stride={stride}")
        self.trim = (0, total) if causal else (total // 2, total - total // 2)

    def forward(self, x_BCN: Tensor) -> Tensor:
        y = super().forward(x_BCN)
        left, right = self.trim
        return y[..., left : y.shape[-1] - right]


class Snake(nn.Module):
    """Snake activation ``x + sin^2(alpha x) / alpha`` with a learned ``alpha`` per channel (DAC).

    Periodic, so stacks of it synthesise tones and harmonics far more easily than ELU (see Deviations).
    Computed as ``x + (1 - cos(2 alpha x)) / (2 alpha)``.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x_BCS: Tensor) -> Tensor:
        a = self.alpha[None, :, None]
        return x_BCS + (1.0 - torch.cos(2.0 * a * x_BCS)) / (2.0 * a + 1e-9)


def _act(cfg: AudioCodecConfig, channels: int) -> nn.Module:
    return Snake(channels) if cfg.activation == "snake" else nn.ELU()


class ResidualUnit(nn.Module):
    """SEANet residual unit: ``x + conv1x1(act(conv_k,dilated(act(x))))`` with a 2x bottleneck."""

    def __init__(self, cfg: AudioCodecConfig, channels: int, dilation: int) -> None:
        super().__init__()
        hidden = max(1, channels // 2)
        self.act1 = _act(cfg, channels)
        self.conv1 = Conv1d(channels, hidden, cfg.residual_kernel_size, dilation=dilation, causal=cfg.causal)
        self.act2 = _act(cfg, hidden)
        self.conv2 = Conv1d(hidden, channels, 1, causal=cfg.causal)

    def forward(self, x_BCS: Tensor) -> Tensor:
        return x_BCS + self.conv2(self.act2(self.conv1(self.act1(x_BCS))))


def _residuals(cfg: AudioCodecConfig, channels: int) -> list[nn.Module]:
    return [ResidualUnit(cfg, channels, cfg.dilation_base**j) for j in range(cfg.n_residual)]


class Encoder(nn.Module):
    """Waveform ``(B, 1, S)`` -> latent ``(B, D, S / hop)``."""

    def __init__(self, cfg: AudioCodecConfig) -> None:
        super().__init__()
        widths = cfg.widths
        layers: list[nn.Module] = [Conv1d(1, widths[0], cfg.kernel_size, causal=cfg.causal)]
        for i, stride in enumerate(cfg.strides):
            layers += _residuals(cfg, widths[i])
            layers += [
                _act(cfg, widths[i]),
                Conv1d(widths[i], widths[i + 1], 2 * stride, stride, causal=cfg.causal),
            ]
        layers += [_act(cfg, widths[-1]), Conv1d(widths[-1], cfg.latent_dim, 3, causal=cfg.causal)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x_B1S: Tensor) -> Tensor:
        return self.layers(x_B1S)


class Decoder(nn.Module):
    """Latent ``(B, D, N)`` -> waveform ``(B, 1, N * hop)`` in [-1, 1] (the encoder mirrored)."""

    def __init__(self, cfg: AudioCodecConfig) -> None:
        super().__init__()
        widths = cfg.widths
        layers: list[nn.Module] = [Conv1d(cfg.latent_dim, widths[-1], cfg.kernel_size, causal=cfg.causal)]
        for i in reversed(range(len(cfg.strides))):
            stride = cfg.strides[i]
            layers += [
                _act(cfg, widths[i + 1]),
                ConvTranspose1d(widths[i + 1], widths[i], 2 * stride, stride, cfg.causal),
            ]
            layers += _residuals(cfg, widths[i])
        layers += [_act(cfg, widths[0]), Conv1d(widths[0], 1, cfg.kernel_size, causal=cfg.causal)]
        self.layers = nn.Sequential(*layers)

    def forward(self, z_BDN: Tensor) -> Tensor:
        return torch.tanh(self.layers(z_BDN))


# ---------------------------------------------------------------------- codec
@dataclass(frozen=True, slots=True)
class CodecOutput:
    """What :meth:`AudioCodec.forward` returns (training and evaluation)."""

    wave_BS: Tensor
    """Reconstruction, trimmed to the input length."""
    codes_BNQ: Tensor
    """long ``(B, N, n_levels)``: the codes of every level (also the levels quantiser dropout skipped)."""
    z_BDN: Tensor
    """The encoder's continuous latent."""
    quantized_BDN: Tensor
    """The quantised latent the decoder read (straight-through to ``z``)."""
    level1_BDN: Tensor
    """Level 1's code vectors, straight-through to ``z``: the input of the semantic head."""
    commit_loss: Tensor
    """Scalar commitment loss (0 when ``z`` needs no gradient)."""
    n_q_B: Tensor
    """long ``(B,)``: levels each element was decoded from."""
    usage: dict[str, list[float]] = field(default_factory=dict)
    """Per level, over this batch: ``perplexity`` and ``used_fraction`` (:func:`code_usage`), and
    ``restarted`` dead codes (training)."""


class AudioCodec(nn.Module):
    """Causal conv encoder + residual VQ + mirrored causal decoder (see the module docstring).

    ``semantic_head`` (``latent_dim -> teacher_dim`` linear, present unless ``cfg.teacher == "none"``)
    maps level-1 vectors to the teacher's target space (cluster logits or teacher features).
    """

    def __init__(self, cfg: AudioCodecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quantizer = ResidualVQ(cfg)
        self.decoder = Decoder(cfg)
        self.semantic_head = nn.Linear(cfg.latent_dim, cfg.teacher_dim) if cfg.teacher != "none" else None

    # ------------------------------------------------------------------ geometry
    @property
    def hop(self) -> int:
        """Samples per frame."""
        return self.cfg.hop

    @property
    def frame_rate(self) -> float:
        """Frames per second of audio."""
        return self.cfg.frame_rate

    @property
    def sample_rate(self) -> int:
        """Sample rate (Hz) of the waveforms."""
        return self.cfg.sample_rate

    @property
    def n_levels(self) -> int:
        """Q: codes per frame."""
        return self.cfg.n_levels

    @property
    def codebook_size(self) -> int:
        """K: codes per level."""
        return self.cfg.codebook_size

    def n_frames(self, n_samples: int) -> int:
        """Frames of an ``n_samples`` waveform: ``ceil(n_samples / hop)`` (the end is zero-padded)."""
        if n_samples < 0:
            raise ValueError(f"n_samples={n_samples} must be >= 0")
        return -(-int(n_samples) // self.hop)

    def _pad(self, wave_BS: Tensor) -> Tensor:
        if wave_BS.ndim != 2:
            raise ValueError(f"wave must be (B, S), got {tuple(wave_BS.shape)}")
        if not wave_BS.is_floating_point():
            raise ValueError(f"wave must be float, got {wave_BS.dtype}")
        S = wave_BS.shape[1]
        if S == 0:
            raise ValueError("wave has no samples")
        extra = self.n_frames(S) * self.hop - S
        return F.pad(wave_BS, (0, extra)) if extra else wave_BS

    # ------------------------------------------------------------------ public
    def encode_latent(self, wave_BS: Tensor) -> Tensor:
        """Continuous latent ``(B, D, N)`` of a waveform (end zero-padded to a multiple of ``hop``)."""
        return self.encoder(self._pad(wave_BS)[:, None])

    @torch.no_grad()
    def encode(self, wave_BS: Tensor, n_levels: int | None = None) -> Tensor:
        """Waveform ``(B, S)`` -> codes long ``(B, ceil(S / hop), n_levels)`` (None = all Q).

        The end is zero-padded to a multiple of ``hop``; deterministic (never updates the codebooks, so
        the same in train and eval mode), no gradient.
        """
        return self.quantizer.encode(self.encode_latent(wave_BS), n_levels)

    def codes_to_latent(self, codes_BNQ: Tensor, n_levels: int | None = None) -> Tensor:
        """Quantised latent ``(B, D, N)``: the sum of the first ``n_levels`` levels' code vectors."""
        return self.quantizer.decode(codes_BNQ, n_levels)

    def decode_latent(self, z_BDN: Tensor) -> Tensor:
        """Latent ``(B, D, N)`` -> waveform ``(B, N * hop)`` in [-1, 1]."""
        if z_BDN.ndim != 3 or z_BDN.shape[1] != self.cfg.latent_dim:
            raise ValueError(f"latent must be (B, {self.cfg.latent_dim}, N), got {tuple(z_BDN.shape)}")
        return self.decoder(z_BDN)[:, 0]

    @torch.no_grad()
    def decode(self, codes_BNQ: Tensor, n_levels: int | None = None) -> Tensor:
        """Codes long ``(B, N, Q')`` (``Q' <= Q``) -> waveform ``(B, N * hop)`` in [-1, 1], from the first
        ``n_levels`` levels (None = all ``Q'`` given). No gradient."""
        return self.decode_latent(self.codes_to_latent(codes_BNQ, n_levels))

    def forward(self, wave_BS: Tensor, n_levels: int | None = None) -> CodecOutput:
        """Reconstruct a waveform through the quantiser (training: EMA updates and quantiser dropout).

        Args:
            wave_BS: float ``(B, S)``; the end is zero-padded to a multiple of ``hop`` and the output is
                trimmed back to ``S`` samples.
            n_levels: quantise with the first ``n_levels`` levels (None = all).
        """
        S = wave_BS.shape[-1]
        z_BDN = self.encode_latent(wave_BS)
        rvq = self.quantizer(z_BDN, n_levels)
        wave_rec = self.decode_latent(rvq.quantized_BDN)[:, :S]
        with torch.no_grad():
            usage: dict[str, list[float]] = code_usage(rvq.codes_BNQ, self.cfg.codebook_size)
            if rvq.restarted:
                usage["restarted"] = [float(r) for r in rvq.restarted]
        return CodecOutput(
            wave_BS=wave_rec,
            codes_BNQ=rvq.codes_BNQ,
            z_BDN=z_BDN,
            quantized_BDN=rvq.quantized_BDN,
            level1_BDN=rvq.level1_BDN,
            commit_loss=rvq.commit_loss,
            n_q_B=rvq.n_q_B,
            usage=usage,
        )

    # ------------------------------------------------------------------ semantic distillation
    def semantic(self, level1_BDN: Tensor) -> Tensor:
        """The semantic head applied to level-1 vectors: ``(B, D, N) -> (B, N, teacher_dim)``."""
        if self.semantic_head is None:
            raise ValueError("this codec has no semantic head (cfg.teacher='none')")
        return self.semantic_head(level1_BDN.transpose(1, 2))

    @torch.no_grad()
    def teacher_targets(self, teacher: SemanticTeacher, wave_BS: Tensor) -> Tensor:
        """The teacher's features of ``wave`` average-pooled to the codec's frames: ``(B, N, D_t)``.

        The waveform is zero-padded to ``N * hop`` samples first, so the teacher's frames span exactly the
        codec's N frames before pooling (:func:`~ernie5.tokenizers.audio_teacher.pool_to_frames`).
        """
        padded = self._pad(wave_BS)
        feats_BTD = teacher.features(padded, self.cfg.sample_rate)
        return pool_to_frames(feats_BTD, padded.shape[1] // self.hop)

    def distill_loss(self, teacher: SemanticTeacher, level1_BDN: Tensor, targets_BND: Tensor) -> Tensor:
        """The teacher's distillation loss of the semantic head on level 1 (see the teacher's ``loss``)."""
        return teacher.loss(self.semantic(level1_BDN), targets_BND)

    def ema_perplexity(self) -> list[float]:
        """Per level: perplexity of the EMA code usage of the codebooks."""
        return self.quantizer.perplexity()

    # ------------------------------------------------------------------ content features
    @property
    def content_encoder(self) -> Any:
        """The frozen speech-content encoder whose features a model with ``audio.content_dim > 0`` reads
        beside the codes of understanding frames (None: codes only). It is not part of the codec's own
        weights: a checkpoint stores it beside the codec and attaches it on load
        (:meth:`attach_content_encoder`)."""
        return self.__dict__.get("_content_encoder")

    def attach_content_encoder(self, encoder: Any) -> AudioCodec:
        """Attach (or with None detach) the frozen speech-content encoder; returns self. Kept outside the
        module tree on purpose, so the codec's ``state_dict`` and its saved folder stay the codec's."""
        self.__dict__["_content_encoder"] = None if encoder is None else encoder.eval().requires_grad_(False)
        return self

    def _apply(self, fn, recurse: bool = True):  # .to(device), .double(), ...: the encoder follows
        super()._apply(fn, recurse)
        if self.content_encoder is not None:
            self.content_encoder._apply(fn, recurse)
        return self

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
        """Write ``path/`` atomically: weights + codebooks, ``config.yaml``, ``meta.json``."""
        return save_module(path, self, self.cfg, VERSION, WEIGHTS_FILE, meta)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> AudioCodec:
        """Load a folder written by :meth:`save` (no pickle), in eval mode; errors are
        :class:`AudioCodecError`."""
        model = load_module(
            path, cls, AudioCodecConfig, VERSION, WEIGHTS_FILE, AudioCodecError, "audio codec", device
        )
        return model.eval()


# ---------------------------------------------------------------------- metrics
def snr_db(ref: Tensor | Any, est: Tensor | Any) -> float:
    """Signal-to-noise ratio (dB) of an estimate of a 1-D signal: ``10 log10(sum ref^2 / sum (ref-est)^2)``.

    Both are trimmed to the shorter length; accepts tensors or arrays. ``inf`` for an exact estimate.
    """
    r = torch.as_tensor(ref, dtype=torch.float64).reshape(-1)
    e = torch.as_tensor(est, dtype=torch.float64).reshape(-1)
    n = min(len(r), len(e))
    if n == 0:
        raise ValueError("snr_db needs non-empty signals")
    r, e = r[:n], e[:n]
    noise = float((r - e).square().sum())
    signal = float(r.square().sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(max(signal, 1e-300) / noise)


def mel_distance(ref: Tensor | Any, est: Tensor | Any, sample_rate: int) -> float:
    """Mean absolute difference of the log-mel spectrograms (:func:`ernie5.tokenizers.audio_features.log_mel`,
    defaults: 256-point FFT, hop 80, 40 mels, natural log) of two 1-D signals, trimmed to the shorter."""
    from ernie5.tokenizers.audio_features import log_mel

    r = torch.as_tensor(ref, dtype=torch.float32).reshape(-1)
    e = torch.as_tensor(est, dtype=torch.float32).reshape(-1)
    n = min(len(r), len(e))
    if n == 0:
        raise ValueError("mel_distance needs non-empty signals")
    with torch.no_grad():
        return float((log_mel(r[None, :n], sample_rate) - log_mel(e[None, :n], sample_rate)).abs().mean())
