"""Configuration of the vision tokenizer (:mod:`ernie5.tokenizers.vision`).

One frozen dataclass, loaded strictly through :mod:`ernie5.config` (``from_dict``, ``load``, ``dump``).
The defaults are the CPU-sized 32x32 tokenizer: two encoder stages take 32x32 pixels to an 8x8 latent
grid, each latent position carries a 10-bit code at every scale of the schedule ``(1, 2, 4, 8)``
(85 tokens per frame).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ernie5.config import check


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionTokenizerConfig:
    """Shape of the causal convolutional multi-scale bitwise tokenizer."""

    image_size: int = 32
    """Side of the (square) input frames, in pixels."""
    channels: int = 3
    """Colour channels of the input frames."""
    base_channels: int = 32
    """Width of the full-resolution convolution (the stem of the encoder, the head of the decoder)."""
    channel_mult: tuple[int, ...] = (1, 2)
    """One entry per stage: the stage's width is ``base_channels * mult``; every stage halves H and W."""
    n_res_blocks: int = 1
    """Residual blocks per stage (after the downsampling conv in the encoder, before the upsampling one
    in the decoder)."""
    norm_groups: int = 8
    """GroupNorm groups. Norms are computed per frame, never across time (chunked inference is exact)."""
    latent_bits: int = 10
    """D: bits of one code = dimensions of the BSQ latent (vocabulary ``2**D`` per token)."""
    scales: tuple[int, ...] = (1, 2, 4, 8)
    """Multi-scale schedule: side ``n_k`` of the code grid of scale ``k``; the last equals the latent
    grid side ``image_size / 2**len(channel_mult)``."""
    temporal_kernel: int = 3
    """kt of every causal 3D kernel once inflated (``mode="3d"``); unused in 2D mode."""
    mode: Literal["2d", "3d"] = "2d"
    """``"2d"``: every conv is a per-frame Conv2d (a video is a batch of images). ``"3d"``: every conv is a
    causal (kt, k, k) CausalConv3d (made by :func:`ernie5.tokenizers.vision.inflate`)."""
    phi: bool = False
    """VAR's shared 3x3 refinement conv ``Phi`` on each upsampled scale (``h/2 + conv(h)/2``)."""
    commit_beta: float = 0.25
    """VAR commitment weight ``beta`` in ``beta*||sg(f_hat)-z||^2 + ||f_hat-sg(z)||^2``."""

    def __post_init__(self) -> None:
        check(self.image_size >= 1, f"image_size={self.image_size} must be >= 1")
        check(self.channels >= 1, f"channels={self.channels} must be >= 1")
        check(self.base_channels >= 1, f"base_channels={self.base_channels} must be >= 1")
        check(len(self.channel_mult) >= 1, "channel_mult must have at least one stage")
        check(all(m >= 1 for m in self.channel_mult), f"channel_mult={list(self.channel_mult)} must be >= 1")
        check(self.n_res_blocks >= 0, f"n_res_blocks={self.n_res_blocks} must be >= 0")
        stride = 2 ** len(self.channel_mult)
        check(
            self.image_size % stride == 0,
            f"image_size={self.image_size} must be divisible by 2**len(channel_mult)={stride}",
        )
        widths = (self.base_channels, *(self.base_channels * m for m in self.channel_mult))
        check(
            self.norm_groups >= 1 and all(c % self.norm_groups == 0 for c in widths),
            f"norm_groups={self.norm_groups} must divide every stage width {list(widths)}",
        )
        check(1 <= self.latent_bits <= 64, f"latent_bits={self.latent_bits} must be in [1, 64]")
        check(len(self.scales) >= 1, "scales must have at least one entry")
        check(
            all(a < b for a, b in zip(self.scales, self.scales[1:])) and self.scales[0] >= 1,
            f"scales={list(self.scales)} must be strictly increasing and >= 1",
        )
        check(
            self.scales[-1] == self.latent_size,
            f"scales[-1]={self.scales[-1]} must equal the latent grid side {self.latent_size} "
            f"(image_size / 2**len(channel_mult))",
        )
        check(self.temporal_kernel >= 1, f"temporal_kernel={self.temporal_kernel} must be >= 1")
        check(self.commit_beta >= 0, f"commit_beta={self.commit_beta} must be >= 0")

    @property
    def latent_size(self) -> int:
        """Side h = w of the latent grid."""
        return self.image_size // 2 ** len(self.channel_mult)

    @property
    def feature_channels(self) -> int:
        """Channels of the pre-quantisation CNN feature map returned by ``encode_features``."""
        return self.base_channels * self.channel_mult[-1]

    @property
    def tokens_per_frame(self) -> int:
        """Codes per frame over all scales: ``sum(n_k**2)``."""
        return sum(n * n for n in self.scales)
