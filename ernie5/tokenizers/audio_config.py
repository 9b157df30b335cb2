"""Configuration of the audio codec (:mod:`ernie5.tokenizers.audio_codec`).

One frozen dataclass, loaded strictly through :mod:`ernie5.config` (``from_dict``, ``load``, ``dump``).
The defaults are the CPU-sized 8 kHz codec (about 317k parameters): four causal strided stages
``(4, 4, 4, 5)`` (widths 8, 16, 32, 64, 128) take 320 samples to one 25 Hz frame; each frame is a 64-dim
latent quantised by 4 residual levels of 256 codes (100 codes, 800 bits per second of audio). The frame
rate is chosen by the strides and must lie in [12.5, 25] Hz (ERNIE 5.0 uses 12.5 Hz; e.g. strides
``(4, 4, 5, 8)`` give 12.5 Hz at 8 kHz).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ernie5.config import check

MIN_FRAME_RATE = 12.5
"""Slowest allowed codec frame rate (Hz): ERNIE 5.0's and Mimi's 12.5 Hz."""
MAX_FRAME_RATE = 25.0
"""Fastest allowed codec frame rate (Hz)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AudioCodecConfig:
    """Shape of the causal convolutional RVQ audio codec and of its quantiser and semantic distillation."""

    sample_rate: int = 8000
    """Sample rate (Hz) of the mono waveforms the codec reads and writes."""
    strides: tuple[int, ...] = (4, 4, 4, 5)
    """Downsampling factor of each encoder stage (mirrored by the decoder's upsampling); their product is
    the hop (samples per frame) and ``sample_rate / hop`` must be in [12.5, 25] Hz."""
    channels: int = 8
    """Width of the full-rate convolution; every stage doubles it, up to ``max_channels``."""
    max_channels: int = 128
    """Cap on the width of any stage."""
    kernel_size: int = 7
    """Kernel of the first encoder conv and of the first and last decoder convs."""
    residual_kernel_size: int = 3
    """Kernel of the dilated conv of every residual unit."""
    n_residual: int = 1
    """Residual units per stage; unit j is dilated by ``dilation_base**j``."""
    dilation_base: int = 3
    """Dilation growth between the residual units of a stage."""
    activation: Literal["snake", "elu"] = "snake"
    """Nonlinearity of the encoder and decoder: DAC's periodic Snake (learned frequency per channel) or
    SEANet's ELU."""
    latent_dim: int = 64
    """D: dimensions of one frame's latent (and of every codebook vector)."""
    n_levels: int = 4
    """Q: residual quantisation levels (codes per frame). Level 1 is the semantic (distilled) level."""
    codebook_size: int = 256
    """K: codes per level."""
    ema_decay: float = 0.99
    """Decay of the exponential moving averages of code usage and code vector sums."""
    eps: float = 1e-5
    """Laplace smoothing of the EMA cluster sizes (and floor of every division by a size)."""
    dead_code_threshold: float = 0.1
    """A code whose EMA usage falls below this fraction of the uniform share (``total / K``) is restarted
    from a vector of the current batch (0 = never)."""
    kmeans_iters: int = 10
    """Lloyd iterations of the k-means initialisation of each codebook from the first training batch
    (0 = keep the random initial codebook)."""
    quantizer_dropout: float = 0.5
    """Probability that a training batch element uses ``n_q ~ U{1..Q}`` levels instead of all Q."""
    causal: bool = True
    """Causal convolutions (left padding only): the codes of frame n depend on samples before the end of
    frame n only, and decoded samples on codes of their own and earlier frames. False = centred padding."""
    teacher: Literal["none", "mfcc_kmeans", "content_kmeans", "whisper"] = "mfcc_kmeans"
    """Semantic teacher distilled into level 1 (:mod:`ernie5.tokenizers.audio_teacher`)."""
    teacher_dim: int = 64
    """Output width of the codec's semantic head: the number of k-means clusters (``mfcc_kmeans``,
    ``content_kmeans``) or the
    teacher's feature width (``whisper``, e.g. 384 for whisper-tiny)."""
    distill_weight: float = 1.0
    """Weight of the semantic distillation loss in training."""

    def __post_init__(self) -> None:
        check(self.sample_rate >= 1, f"sample_rate={self.sample_rate} must be >= 1")
        check(len(self.strides) >= 1, "strides must have at least one stage")
        check(all(s >= 1 for s in self.strides), f"strides={list(self.strides)} must all be >= 1")
        rate = self.sample_rate / math.prod(self.strides)
        check(
            MIN_FRAME_RATE <= rate <= MAX_FRAME_RATE,
            f"frame rate sample_rate / prod(strides) = {self.sample_rate} / {math.prod(self.strides)} = "
            f"{rate:g} Hz must be in [{MIN_FRAME_RATE}, {MAX_FRAME_RATE}] (change strides or sample_rate)",
        )
        check(self.channels >= 1, f"channels={self.channels} must be >= 1")
        check(
            self.max_channels >= self.channels,
            f"max_channels={self.max_channels} must be >= channels={self.channels}",
        )
        check(self.kernel_size >= 1, f"kernel_size={self.kernel_size} must be >= 1")
        check(
            self.residual_kernel_size >= 1,
            f"residual_kernel_size={self.residual_kernel_size} must be >= 1",
        )
        check(self.n_residual >= 0, f"n_residual={self.n_residual} must be >= 0")
        check(self.dilation_base >= 1, f"dilation_base={self.dilation_base} must be >= 1")
        check(self.latent_dim >= 1, f"latent_dim={self.latent_dim} must be >= 1")
        check(self.n_levels >= 1, f"n_levels={self.n_levels} must be >= 1")
        check(self.codebook_size >= 2, f"codebook_size={self.codebook_size} must be >= 2")
        check(0.0 <= self.ema_decay < 1.0, f"ema_decay={self.ema_decay} must be in [0, 1)")
        check(self.eps > 0, f"eps={self.eps} must be > 0")
        check(
            0.0 <= self.dead_code_threshold < 1.0,
            f"dead_code_threshold={self.dead_code_threshold} must be in [0, 1)",
        )
        check(self.kmeans_iters >= 0, f"kmeans_iters={self.kmeans_iters} must be >= 0")
        check(
            0.0 <= self.quantizer_dropout <= 1.0,
            f"quantizer_dropout={self.quantizer_dropout} must be in [0, 1]",
        )
        check(self.teacher_dim >= 1, f"teacher_dim={self.teacher_dim} must be >= 1")
        check(self.distill_weight >= 0, f"distill_weight={self.distill_weight} must be >= 0")

    @property
    def hop(self) -> int:
        """Samples per frame: ``prod(strides)``."""
        return math.prod(self.strides)

    @property
    def frame_rate(self) -> float:
        """Frames (code vectors of Q codes) per second of audio."""
        return self.sample_rate / self.hop

    @property
    def widths(self) -> tuple[int, ...]:
        """Channels before the first stage and after each stage: ``min(channels * 2**i, max_channels)``."""
        return tuple(min(self.channels * 2**i, self.max_channels) for i in range(len(self.strides) + 1))

    @property
    def bitrate(self) -> float:
        """Bits per second of audio at all Q levels: ``frame_rate * Q * log2(K)``."""
        return self.frame_rate * self.n_levels * math.log2(self.codebook_size)
