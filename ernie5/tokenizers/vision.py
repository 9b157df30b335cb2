"""Causal convolutional vision tokenizer: images and videos to multi-scale bitwise codes and back.

Shapes: B batch, C channels, T frames, H x W pixels, h x w latent grid, D code bits (latent dims),
F encoder feature channels. Pixels are float in [-1, 1], laid out ``(B, C, T, H, W)``; an image is a
one-frame video (T = 1). Internally the convolutions run on ``(B, T, C, H, W)``, whose flattening to
``(B*T, C, H, W)`` is free.

Pipeline (one architecture, two conv types chosen by ``cfg.mode``)::

    x (B,C,T,H,W) -> Encoder -> feats (B,F,T,h,w) -> 1x1 proj -> L2-normalise -> z (B,D,T,h,w)
                  -> BitwiseMultiScaleQuantizer (per frame) -> bits per scale + f_hat (B,D,T,h,w)
                  -> Decoder -> x_rec (B,C,T,H,W), tanh to [-1, 1]

* ``mode="2d"``: every conv is a per-frame Conv2d, so a video is a batch of independent images.
* ``mode="3d"``: every conv is a :class:`CausalConv3d` with kernel (kt, k, k): ``kt - 1`` copies of the
  first frame are padded in front, none behind, so output frame t sees input frames ``<= t`` only.
  Norms are GroupNorm per frame (no statistics across time) and resampling is spatial only, so the
  whole tokenizer is causal in time and chunked inference is exact.
* :func:`inflate` turns a trained 2D tokenizer into a 3D one: each k x k kernel goes into the last
  temporal slice of a kt x k x k kernel, zeros elsewhere. On a single frame (or on any clip, before the
  temporal weights are trained) the 3D tokenizer reproduces the 2D one; :class:`CausalConv3d` sums one
  conv per temporal tap, so the reproduction is bitwise.

A saved tokenizer is a folder: ``tokenizer.safetensors`` (weights), ``config.yaml``
(:class:`VisionTokenizerConfig`) and ``meta.json`` (``version``, parameter count, caller metadata).
Pixel helpers convert the project's uint8 images ``(N, H, W, 3)`` and clips ``(N, T, H, W, 3)`` to and from
model tensors; :func:`reconstruct` round-trips uint8 frames through the tokenizer (for PSNR / SSIM).

References:
  * ERNIE 5.0 report, arXiv 2602.04705, section 2.2.1: causal 2D multi-scale image tokenizer inflated
    into a causal 3D tokenizer; bitwise quantisation; progressive tokenizer (bit-depth) switching.
  * MAGVIT-v2, Yu et al. 2024, arXiv 2310.05737: causal 3D CNN, inflation into the last temporal slice.
  * VideoAR, arXiv 2601.05966 section 4.1: 3D causal tokenizer, temporal-independent quantisation.
  * VAR (arXiv 2404.02905), Infinity (arXiv 2412.04431), BSQ (arXiv 2406.07548): see
    :mod:`ernie5.tokenizers.vision_quant`.

Deviations:
  1. No temporal compression: one latent frame per input frame (VideoAR compresses time 4x). The
     backbone's next-frame prediction then works on frames directly and the first frame needs no special
     case.
  2. Causal padding repeats the first frame (as CogVideoX / Open-Sora do) instead of zeros, so a static
     clip looks static to every kernel tap.
  3. A small VQGAN-style CNN (one residual block per stage) instead of the report's undisclosed
     architecture; no ViT semantic path here (the backbone's understanding path owns it).
  4. The decoder ends in ``tanh`` so decoded pixels are always in [-1, 1].
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ernie5.tokenizers.folder import load_module, save_module
from ernie5.tokenizers.vision_config import VisionTokenizerConfig
from ernie5.tokenizers.vision_quant import BitwiseMultiScaleQuantizer, MultiScaleCodes

VERSION = "ernie5-vision-tokenizer/1"
"""Format string stored in ``meta.json``; :meth:`VisionTokenizer.load` refuses other values."""
WEIGHTS_FILE = "tokenizer.safetensors"


class VisionTokenizerError(ValueError):
    """A saved vision tokenizer is missing, invalid or does not match its config. One line."""


# ---------------------------------------------------------------------- leaf modules
class FrameConv2d(nn.Conv2d):
    """A Conv2d applied to every frame of ``(B, T, C, H, W)`` ('same' padding for odd kernels)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1) -> None:
        super().__init__(c_in, c_out, kernel, stride=stride, padding=kernel // 2)

    def forward(self, x_BTCHW: Tensor) -> Tensor:
        return super().forward(x_BTCHW.flatten(0, 1)).unflatten(0, x_BTCHW.shape[:2])


class CausalConv3d(nn.Module):
    """A (kt, k, k) convolution over ``(B, T, C, H, W)`` that is causal in time.

    ``kt - 1`` copies of the first frame are padded in front (none behind); space is 'same'-padded and
    may be strided. Output frame t depends on input frames ``t-kt+1 .. t`` only. Computed as the sum of
    one 2D conv per temporal tap (tap ``kt-1``, the current frame, first and carrying the bias), so a
    kernel that is zero outside its last slice gives bitwise the Conv2d result.
    """

    def __init__(self, c_in: int, c_out: int, kernel: tuple[int, int, int] = (3, 3, 3), stride: int = 1):
        super().__init__()
        kt, kh, kw = kernel
        if kh != kw or kh % 2 == 0 or kt < 1:
            raise ValueError(f"CausalConv3d kernel={kernel}: need kt >= 1 and an odd square spatial kernel")
        self.kernel, self.stride, self.padding = kernel, stride, kh // 2
        self.weight = nn.Parameter(torch.empty(c_out, c_in, kt, kh, kw))
        self.bias = nn.Parameter(torch.empty(c_out))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Conv3d's initialisation
        bound = 1 / math.sqrt(c_in * kt * kh * kw)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x_BTCHW: Tensor) -> Tensor:
        B, T = x_BTCHW.shape[:2]
        kt = self.kernel[0]
        if kt > 1:  # replicate the first frame kt-1 times in front: causal, no look-ahead
            x_BTCHW = torch.cat([x_BTCHW[:, :1].expand(B, kt - 1, *x_BTCHW.shape[2:]), x_BTCHW], dim=1)
        out = None
        for i in reversed(range(kt)):  # tap kt-1 multiplies the current frame
            frames = x_BTCHW[:, i : i + T].reshape(B * T, *x_BTCHW.shape[2:])
            bias = self.bias if i == kt - 1 else None
            y = F.conv2d(frames, self.weight[:, :, i], bias, stride=self.stride, padding=self.padding)
            out = y if out is None else out + y
        return out.unflatten(0, (B, T))


class FrameGroupNorm(nn.GroupNorm):
    """GroupNorm with statistics per frame (never across time)."""

    def forward(self, x_BTCHW: Tensor) -> Tensor:
        return super().forward(x_BTCHW.flatten(0, 1)).unflatten(0, x_BTCHW.shape[:2])


def _conv(cfg: VisionTokenizerConfig, c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Module:
    if cfg.mode == "2d":
        return FrameConv2d(c_in, c_out, kernel, stride)
    return CausalConv3d(c_in, c_out, (cfg.temporal_kernel, kernel, kernel), stride)


class ResBlock(nn.Module):
    """Pre-activation residual block: ``x + conv(silu(norm(conv(silu(norm(x))))))``."""

    def __init__(self, cfg: VisionTokenizerConfig, c_in: int, c_out: int) -> None:
        super().__init__()
        self.norm1 = FrameGroupNorm(cfg.norm_groups, c_in)
        self.conv1 = _conv(cfg, c_in, c_out, 3)
        self.norm2 = FrameGroupNorm(cfg.norm_groups, c_out)
        self.conv2 = _conv(cfg, c_out, c_out, 3)
        self.skip = _conv(cfg, c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x_BTCHW: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x_BTCHW)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x_BTCHW) + h


class Upsample(nn.Module):
    """Nearest-neighbour x2 in space (per frame), then a 3x3 conv."""

    def __init__(self, cfg: VisionTokenizerConfig, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = _conv(cfg, c_in, c_out, 3)

    def forward(self, x_BTCHW: Tensor) -> Tensor:
        up = F.interpolate(x_BTCHW.flatten(0, 1), scale_factor=2.0, mode="nearest")
        return self.conv(up.unflatten(0, x_BTCHW.shape[:2]))


# ---------------------------------------------------------------------- encoder / decoder
class Encoder(nn.Module):
    """Stem conv, then per stage a stride-2 conv and residual blocks; ends with norm + SiLU."""

    def __init__(self, cfg: VisionTokenizerConfig) -> None:
        super().__init__()
        widths = [cfg.base_channels * m for m in cfg.channel_mult]
        self.conv_in = _conv(cfg, cfg.channels, cfg.base_channels, 3)
        blocks: list[nn.Module] = []
        c = cfg.base_channels
        for width in widths:
            blocks.append(_conv(cfg, c, width, 3, stride=2))
            blocks.extend(ResBlock(cfg, width, width) for _ in range(cfg.n_res_blocks))
            c = width
        self.blocks = nn.Sequential(*blocks)
        self.norm_out = FrameGroupNorm(cfg.norm_groups, c)
        self.proj = _conv(cfg, c, cfg.latent_bits, 1)

    def forward(self, x_BTCHW: Tensor) -> tuple[Tensor, Tensor]:
        """Returns ``(feats (B, T, F, h, w), z (B, T, D, h, w))``; z is unit-norm over D."""
        feats = F.silu(self.norm_out(self.blocks(self.conv_in(x_BTCHW))))
        return feats, F.normalize(self.proj(feats), dim=2)


class Decoder(nn.Module):
    """Mirror of the encoder: conv from D, per stage (coarse first) residual blocks and a x2 upsample."""

    def __init__(self, cfg: VisionTokenizerConfig) -> None:
        super().__init__()
        widths = [cfg.base_channels * m for m in cfg.channel_mult]
        outs = [cfg.base_channels, *widths[:-1]]
        self.conv_in = _conv(cfg, cfg.latent_bits, widths[-1], 3)
        blocks: list[nn.Module] = []
        for width, out in zip(reversed(widths), reversed(outs)):
            blocks.extend(ResBlock(cfg, width, width) for _ in range(cfg.n_res_blocks))
            blocks.append(Upsample(cfg, width, out))
        self.blocks = nn.Sequential(*blocks)
        self.norm_out = FrameGroupNorm(cfg.norm_groups, cfg.base_channels)
        self.conv_out = _conv(cfg, cfg.base_channels, cfg.channels, 3)

    def forward(self, f_BTDhw: Tensor) -> Tensor:
        h = self.blocks(self.conv_in(f_BTDhw))
        return torch.tanh(self.conv_out(F.silu(self.norm_out(h))))


# ---------------------------------------------------------------------- tokenizer
class VisionTokenizer(nn.Module):
    """Encoder + bitwise multi-scale quantiser + decoder (see the module docstring)."""

    def __init__(self, cfg: VisionTokenizerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.quantizer = BitwiseMultiScaleQuantizer(cfg)
        self.decoder = Decoder(cfg)

    @property
    def feature_channels(self) -> int:
        """F: channels of the pre-quantisation feature map (``base_channels * channel_mult[-1]``)."""
        return self.cfg.feature_channels

    def _check_pixels(self, x_BCTHW: Tensor) -> None:
        cfg = self.cfg
        if x_BCTHW.ndim != 5 or x_BCTHW.shape[1] != cfg.channels:
            raise ValueError(f"pixels must be (B, {cfg.channels}, T, H, W), got {tuple(x_BCTHW.shape)}")
        H, W = x_BCTHW.shape[-2:]
        stride = 2 ** len(cfg.channel_mult)
        if H % stride or W % stride:
            raise ValueError(f"H={H} and W={W} must be divisible by {stride}")

    def encode_features(self, x_BCTHW: Tensor) -> tuple[Tensor, Tensor]:
        """Encode pixels to the pre-quantisation features and the continuous latent.

        Args:
            x_BCTHW: float ``(B, C, T, H, W)`` in [-1, 1].

        Returns:
            ``(feats_BFThw, z_BDThw)``: the last encoder feature map before the projection to D
            (``F = feature_channels``, after its norm and SiLU; the backbone's understanding input) and the
            latent ``z`` projected to D dims and L2-normalised over D at every position. With
            ``h = H / 2**len(channel_mult)``. Causal in T in 3D mode, per frame in 2D mode.
        """
        self._check_pixels(x_BCTHW)
        feats_BTFhw, z_BTDhw = self.encoder(x_BCTHW.transpose(1, 2))
        return feats_BTFhw.transpose(1, 2), z_BTDhw.transpose(1, 2)

    def quantize(
        self,
        z_BDThw: Tensor,
        n_bits: int | None = None,
        flip_prob: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> MultiScaleCodes:
        """Bitwise multi-scale residual quantisation of every frame independently.

        Args:
            z_BDThw: ``(B, D, T, h, w)`` latent (from :meth:`encode_features`).
            n_bits: bit depth (progressive depth): only the first ``n_bits`` dims are quantised, the rest
                of ``f_hat`` is zero; None = ``latent_bits``.
            flip_prob: bitwise self-correction: each accumulated bit is flipped with this probability,
                and later scales' residuals (targets) are computed from the corrupted map.
            generator: RNG for the flips (deterministic given its seed).

        Returns:
            :class:`MultiScaleCodes`; ``f_hat`` is straight-through to ``z``.
        """
        return self.quantizer(z_BDThw, n_bits=n_bits, flip_prob=flip_prob, generator=generator)

    def encode(self, x_BCTHW: Tensor, n_bits: int | None = None) -> MultiScaleCodes:
        """Pixels ``(B, C, T, H, W)`` -> codes (no flips)."""
        return self.quantize(self.encode_features(x_BCTHW)[1], n_bits=n_bits)

    def decode(self, f_hat_BDThw: Tensor) -> Tensor:
        """Latent ``(B, D, T, h, w)`` (``f_hat``) -> pixels ``(B, C, T, H, W)`` in [-1, 1]."""
        if f_hat_BDThw.ndim != 5 or f_hat_BDThw.shape[1] != self.cfg.latent_bits:
            raise ValueError(
                f"f_hat must be (B, {self.cfg.latent_bits}, T, h, w), got {tuple(f_hat_BDThw.shape)}"
            )
        return self.decoder(f_hat_BDThw.transpose(1, 2)).transpose(1, 2)

    def decode_codes(self, bits_list: list[Tensor]) -> Tensor:
        """Per-scale bits ``(B, T, n_k, n_k, n_bits)`` -> pixels ``(B, C, T, H, W)``."""
        return self.decode(self.codes_to_fhat(bits_list))

    def codes_to_fhat(self, bits_list: list[Tensor]) -> Tensor:
        """Per-scale bits ``(B, T, n_k, n_k, n_bits)`` -> cumulative ``f_hat (B, D, T, h, w)``, exactly as
        :meth:`quantize` accumulates them."""
        return self.quantizer.codes_to_fhat(bits_list)

    def scale_inputs(self, bits_list: list[Tensor]) -> list[Tensor]:
        """Teacher-forcing input of every scale: ``(B, T, n_k, n_k, D)``, zeros for scale 0 (see
        :meth:`BitwiseMultiScaleQuantizer.scale_inputs`)."""
        return self.quantizer.scale_inputs(bits_list)

    def forward(self, x_BCTHW: Tensor, n_bits: int | None = None) -> tuple[Tensor, MultiScaleCodes]:
        """Reconstruct pixels through the quantiser: ``(x_rec (B, C, T, H, W), codes)``."""
        codes = self.encode(x_BCTHW, n_bits=n_bits)
        return self.decode(codes.f_hat), codes

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
        """Write ``path/`` atomically: weights, ``config.yaml`` and ``meta.json`` (``version`` + ``meta``)."""
        return save_module(path, self, self.cfg, VERSION, WEIGHTS_FILE, meta)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> VisionTokenizer:
        """Load a folder written by :meth:`save` (no pickle); errors are :class:`VisionTokenizerError`."""
        return load_module(
            path,
            cls,
            VisionTokenizerConfig,
            VERSION,
            WEIGHTS_FILE,
            VisionTokenizerError,
            "vision tokenizer",
            device,
        )


# ---------------------------------------------------------------------- inflation
def inflate(tok2d: VisionTokenizer) -> VisionTokenizer:
    """The causal 3D tokenizer initialised from a 2D one (MAGVIT-v2 / VideoAR inflation).

    Same config with ``mode="3d"``; every k x k Conv2d weight goes into the last temporal slice of the
    kt x k x k CausalConv3d kernel, the other slices are zero; all other tensors are copied. The result
    on a single frame (and on any clip) equals the 2D tokenizer bitwise until the temporal slices train.
    """
    if tok2d.cfg.mode != "2d":
        raise ValueError(f"inflate expects a 2d tokenizer, got mode={tok2d.cfg.mode!r}")
    ref = next(tok2d.parameters())
    tok3d = VisionTokenizer(dataclasses.replace(tok2d.cfg, mode="3d")).to(device=ref.device, dtype=ref.dtype)
    src = tok2d.state_dict()
    state = {}
    for name, target in tok3d.state_dict().items():
        value = src[name]
        if target.ndim == 5 and value.ndim == 4:
            kernel = torch.zeros_like(target)
            kernel[:, :, -1] = value
            value = kernel
        state[name] = value
    tok3d.load_state_dict(state)
    return tok3d


# ---------------------------------------------------------------------- pixels
def images_to_pixels(images: np.ndarray) -> Tensor:
    """uint8 images ``(N, H, W, C)`` -> float ``(N, C, 1, H, W)`` in [-1, 1] (an image is a 1-frame video)."""
    images = np.asarray(images)
    if images.ndim != 4:
        raise ValueError(f"images must be uint8 (N, H, W, C), got shape {images.shape}")
    return clips_to_pixels(images[:, None])


def clips_to_pixels(clips: np.ndarray) -> Tensor:
    """uint8 clips ``(N, T, H, W, C)`` -> float ``(N, C, T, H, W)`` in [-1, 1]."""
    clips = np.asarray(clips)
    if clips.ndim != 5 or clips.dtype != np.uint8:
        raise ValueError(f"clips must be uint8 (N, T, H, W, C), got {clips.dtype} {clips.shape}")
    x = torch.from_numpy(np.ascontiguousarray(clips)).permute(0, 4, 1, 2, 3).float()
    return x.div_(127.5).sub_(1.0)


def pixels_to_uint8(x_BCTHW: Tensor) -> np.ndarray:
    """float ``(B, C, T, H, W)`` in [-1, 1] -> uint8 ``(B, T, H, W, C)`` (rounded, clipped)."""
    x = ((x_BCTHW.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255)
    return x.to(torch.uint8).permute(0, 2, 3, 4, 1).numpy()


@torch.no_grad()
def reconstruct(
    tok: VisionTokenizer, frames: np.ndarray, n_bits: int | None = None, batch_size: int = 64
) -> np.ndarray:
    """Encode, quantise and decode uint8 images ``(N, H, W, C)`` or clips ``(N, T, H, W, C)``.

    Returns uint8 of the input's shape. Runs in eval mode on the tokenizer's device, ``batch_size`` items
    at a time; the tokenizer's train/eval mode is restored afterwards.
    """
    frames = np.asarray(frames)
    is_image = frames.ndim == 4
    clips = frames[:, None] if is_image else frames
    device = next(tok.parameters()).device
    was_training = tok.training
    tok.eval()
    out = []
    try:
        for i in range(0, len(clips), batch_size):
            x = clips_to_pixels(clips[i : i + batch_size]).to(device)
            out.append(pixels_to_uint8(tok(x, n_bits=n_bits)[0]))
    finally:
        tok.train(was_training)
    rec = np.concatenate(out) if out else np.zeros_like(clips)
    return rec[:, 0] if is_image else rec
