"""Cascaded diffusion refiner: a small rectified-flow UNet that upsamples the backbone's low-res decode 2x.

The backbone generates ``low_size`` images (its vision tokenizer's decode); this separately trained model
maps them to ``scale`` x the resolution and restores detail. Nothing here touches the backbone: the two
never share a loss.

Shapes: N/B batch, C channels, H x W pixels (of the high-res output unless named ``low``), E the
time-embedding width. Pixels are float in [-1, 1] laid out ``(B, C, H, W)``; the public API speaks the
project's uint8 ``(N, H, W, 3)``.

Model: concat conditioning (SR3 / improved-diffusion ``SuperResModel``): the UNet input is
``concat(x_t, c_aug)`` (6 channels) where ``c = up(low)`` is the bicubic upsample of the low-res image and
``c_aug = c + s * eps'`` its noise-augmented copy (Imagen noise-conditioning augmentation: ``s`` ~
U[0, ``noise_aug_max``] for a ``noise_aug_prob`` share of training examples, else 0;
``sample_noise_aug`` at sampling). ``t`` and ``s`` each get a sinusoidal embedding -> MLP; their sum
modulates every residual block (GroupNorm scale/shift). The input is PixelUnshuffled by ``patch_size``
(default 2: the first level runs on the 32x32 low-res grid), levels follow ``channels`` (one 2x
downsample between levels, GroupNorm + SiLU residual blocks), single-head self-attention in the middle
block at the lowest resolution (16x16 by default), PixelShuffle back at the output.

Objective (rectified flow), with ``x`` the target: the residual ``residual_scale * (high - c)`` when
``predict_residual`` (else ``high`` itself)::

    t ~ logit-normal(0, 1) = sigmoid(N(0, 1))  (or U[0, 1]: ``t_sampling``);   eps ~ N(0, I)
    x_t = (1 - t) x + t eps;   target v = eps - x
    x_hat = UNet(x_t / std(x_t), c_aug, t, s);   v_theta = (x_t - x_hat) / max(t, loss_t_min)
    L = || v_theta - v ||^2

Sampler: Euler from ``t = start_t`` (default 1) to 0 over ``steps`` uniform steps,
``x <- x + (t_next - t) v_theta`` with the exact ``t``; the last step lands on ``x_hat``.
``start_t < 1`` is the SDEdit shortcut: start from ``(1 - t0) base + t0 eps`` with ``base`` the bicubic
upsample (residual 0). A single step from ``t = 1`` returns the model's estimate of the posterior mean
(the MMSE answer); more steps give a sharper sample. All noise comes from one ``torch.Generator`` seeded
by ``seed`` and is drawn up front, so a fixed seed fixes the output.

A saved refiner is a folder: ``refiner.safetensors``, ``config.yaml`` (:class:`RefinerConfig`) and
``meta.json`` (``version``, parameter count, caller metadata). No pickle.

References:
  * ERNIE 5.0 report, arXiv 2602.04705, section 2.2.3: the backbone generates low-res images / video, a
    separately trained diffusion refiner upsamples and adds detail, trained on (degraded low-res, high-res)
    pairs.
  * Rectified flow, Liu et al. 2022, arXiv 2209.03003; SD3, Esser et al. 2024, arXiv 2403.03206
    (logit-normal t).
  * SR3, Saharia et al. 2021, arXiv 2104.07636; Cascaded Diffusion Models, Ho et al. 2021,
    arXiv 2106.15282 (concat conditioning, conditioning augmentation); Imagen, arXiv 2205.11487
    (noise-conditioning augmentation with the level as an input).
  * SDEdit, Meng et al. 2021, arXiv 2108.01073 (start from a noised guess).

Deviations:
  1. A tiny UNet for a 2-core CPU (default widths 32/64, one 2x downsample, ~0.8M parameters) instead of
     64/128/256 with 2 blocks per level: the input is PixelUnshuffled 2x first (ESPCN-style sub-pixel
     stem and head), so the UNet runs at 32x32 and 16x16 (4x cheaper than at 64x64) and the attention
     sits at 16x16.
  2. Bicubic, not bilinear, upsampling of the conditioning, so the residual target starts from the
     baseline the refiner is measured against.
  3. The residual target is multiplied by ``residual_scale`` (std ~0.5 = ``sigma_data`` on the shapes
     world), as latent diffusion scales its latents, so signal and noise are comparable across ``t``.
  4. The UNet predicts the target ``x_hat`` and ``v = (x_t - x_hat) / t`` (x-prediction with the v-loss,
     as JiT, Li & He 2025, arXiv 2511.13720, with ``t`` clamped at ``loss_t_min`` = 0.2 in the loss, not
     0.05, so the small-``t`` terms do not swamp the gradient); the loss is still MSE against
     ``v = eps - x``. A v-predicting net trained for a CPU budget left visible noise in flat regions (it
     must learn to pass the noise through), which cost SSIM; here a flat region is ``x_hat = 0`` and its
     noise is removed exactly.
  5. Noise-conditioning augmentation hits only ``noise_aug_prob`` (half) of the training examples, so half
     the budget trains the ``s = 0`` case the sampler uses; Imagen draws ``s`` for every example.
  6. Video is refined frame by frame (a clip is a batch of frames); the frames of a clip share their
     noise so static content stays static, but nothing else ties the frames together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ernie5.tokenizers.folder import load_module, save_module

VERSION = "ernie5-refiner/1"
"""Format string stored in ``meta.json``; :meth:`Refiner.load` refuses other values."""
WEIGHTS_FILE = "refiner.safetensors"
FREQ_DIM = 64
"""Width of the sinusoidal embedding of ``t`` and of the augmentation level, before their MLPs."""


class RefinerError(ValueError):
    """A saved refiner folder is missing, malformed or does not match its config; the message is one line."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RefinerConfig:
    """The refiner: sizes, UNet widths, objective and sampler defaults."""

    low_size: int = 32
    """Side of the low-res input the refiner is trained on (the backbone's generated image side)."""
    scale: int = 2
    """Upsampling factor: the output side is ``scale * low_size``."""
    patch_size: int = 2
    """Space-to-depth factor of the UNet's stem and head (PixelUnshuffle in, PixelShuffle out): the first
    level runs at ``high_size / patch_size``, the low-res grid by default."""
    channels: tuple[int, ...] = (32, 64)
    """UNet width per level; each level after the first halves the resolution."""
    n_res_blocks: int = 2
    """Residual blocks per level in the encoder and in the decoder."""
    time_dim: int = 128
    """Width of the time / augmentation-level embedding fed to every residual block."""
    norm_groups: int = 8
    """GroupNorm groups (must divide every width)."""
    attention: bool = True
    """Single-head self-attention in the middle block (at the lowest resolution)."""
    predict_residual: bool = True
    """Generate ``residual_scale * (high - up(low))`` instead of the image itself."""
    residual_scale: float = 6.0
    """Multiplier of the residual target (``predict_residual`` only), bringing its std near ``sigma_data``
    (the shapes world's bicubic residual has std ~0.08); see Deviations 3."""
    sigma_data: float = 0.5
    """Assumed std of the generation target, for the input / skip / output scalings of the velocity
    (Deviations 4)."""
    loss_t_min: float = 0.2
    """In the loss, ``v = (x_t - x_hat) / max(t, loss_t_min)``: caps the ``1 / t**2`` weight x-prediction
    puts on small ``t`` (JiT uses 0.05); the sampler uses the exact ``t``. See Deviations 4."""
    t_sampling: Literal["logit_normal", "uniform"] = "logit_normal"
    """Training distribution of ``t``: ``sigmoid(N(0, 1))`` (SD3) or U[0, 1]."""
    noise_aug_max: float = 0.3
    """Training noise-conditioning augmentation level ``s`` ~ U[0, noise_aug_max] (pixels in [-1, 1])."""
    noise_aug_prob: float = 0.5
    """Share of training examples that get an augmentation level at all (the rest ``s = 0``, the sampling
    default); see Deviations."""
    sample_noise_aug: float = 0.0
    """Augmentation level ``s`` used at sampling (Imagen tunes it; 0 keeps all the low-res information)."""
    sample_steps: int = 20
    """Default Euler steps of :meth:`Refiner.refine`."""

    def __post_init__(self) -> None:
        if self.low_size < 1 or self.scale < 2:
            raise ValueError(f"low_size={self.low_size} must be >= 1 and scale={self.scale} >= 2")
        if not self.channels or any(c < 1 or c % self.norm_groups for c in self.channels):
            raise ValueError(
                f"channels={self.channels} must be non-empty, each a multiple of "
                f"norm_groups={self.norm_groups}"
            )
        if self.patch_size < 1:
            raise ValueError(f"patch_size={self.patch_size} must be >= 1")
        if self.n_res_blocks < 1 or self.time_dim < 1:
            raise ValueError(f"n_res_blocks={self.n_res_blocks} and time_dim={self.time_dim} must be >= 1")
        if self.high_size % self.downsample_factor:
            raise ValueError(
                f"low_size * scale = {self.high_size} must be divisible by patch_size * "
                f"2**(len(channels) - 1) = {self.downsample_factor}"
            )
        if self.residual_scale <= 0 or self.sigma_data <= 0:
            raise ValueError(
                f"residual_scale={self.residual_scale} and sigma_data={self.sigma_data} must be > 0"
            )
        if not 0 <= self.sample_noise_aug <= self.noise_aug_max <= 1:
            raise ValueError(
                f"need 0 <= sample_noise_aug={self.sample_noise_aug} <= "
                f"noise_aug_max={self.noise_aug_max} <= 1"
            )
        if not 0 <= self.loss_t_min < 1:
            raise ValueError(f"loss_t_min={self.loss_t_min} must be in [0, 1)")
        if not 0 <= self.noise_aug_prob <= 1:
            raise ValueError(f"noise_aug_prob={self.noise_aug_prob} must be in [0, 1]")
        if self.sample_steps < 1:
            raise ValueError(f"sample_steps={self.sample_steps} must be >= 1")

    @property
    def high_size(self) -> int:
        """Side of the refined output."""
        return self.low_size * self.scale

    @property
    def downsample_factor(self) -> int:
        """Total downsampling inside the UNet (patching included); the high-res side must be a multiple."""
        return self.patch_size * 2 ** (len(self.channels) - 1)


# ---------------------------------------------------------------------- helpers
def upsample(low_BCHW: Tensor, scale: int) -> Tensor:
    """Bicubic ``scale`` x upsample of pixels in [-1, 1] (clamped back into range)."""
    return F.interpolate(low_BCHW, scale_factor=scale, mode="bicubic", align_corners=False).clamp(-1.0, 1.0)


def to_pixels(images: np.ndarray) -> Tensor:
    """uint8 ``(N, H, W, 3)`` -> float ``(N, 3, H, W)`` in [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float()
    return x.div_(127.5).sub_(1.0)


def to_uint8(x_BCHW: Tensor) -> np.ndarray:
    """float ``(B, C, H, W)`` in [-1, 1] -> uint8 ``(B, H, W, C)`` (rounded, clipped)."""
    x = ((x_BCHW.detach().float().cpu() + 1.0) * 127.5).round().clamp(0, 255)
    return x.to(torch.uint8).permute(0, 2, 3, 1).numpy()


def upsample_uint8(low: np.ndarray, scale: int = 2) -> np.ndarray:
    """The bicubic baseline: uint8 ``(N, H, W, 3)`` -> uint8 ``(N, scale H, scale W, 3)``."""
    return to_uint8(upsample(to_pixels(low), scale))


def sinusoidal(value_B: Tensor, dim: int = FREQ_DIM) -> Tensor:
    """Transformer-style embedding ``(B, dim)`` of a value in [0, 1] (scaled by 1000, as DDPM's steps)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=value_B.device) / half)
    angles = 1000.0 * value_B.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def _check_images(images: np.ndarray, cfg: RefinerConfig) -> np.ndarray:
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim not in (4, 5) or images.shape[-1] != 3:
        raise ValueError(
            f"low-res input must be uint8 (N, H, W, 3) or (N, T, H, W, 3), got {images.dtype} {images.shape}"
        )
    h, w = images.shape[-3:-1]
    if (h * cfg.scale) % cfg.downsample_factor or (w * cfg.scale) % cfg.downsample_factor:
        raise ValueError(
            f"low-res side {h}x{w} times scale={cfg.scale} must be divisible by {cfg.downsample_factor}"
        )
    return images


# ---------------------------------------------------------------------- leaf modules
class Embedding(nn.Module):
    """Sinusoidal features of a value in [0, 1] -> MLP -> ``(B, E)``."""

    def __init__(self, time_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQ_DIM, time_dim), nn.SiLU(), nn.Linear(time_dim, time_dim))

    def forward(self, value_B: Tensor) -> Tensor:
        return self.mlp(sinusoidal(value_B))


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice; the embedding sets the second norm's scale and shift (AdaGN)."""

    def __init__(self, c_in: int, c_out: int, time_dim: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.emb = nn.Linear(time_dim, 2 * c_out)
        self.norm2 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)  # each block starts as the identity (improved-diffusion)
        nn.init.zeros_(self.conv2.bias)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x_BCHW: Tensor, emb_BE: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x_BCHW)))
        scale_BC, shift_BC = self.emb(F.silu(emb_BE)).chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale_BC[:, :, None, None]) + shift_BC[:, :, None, None]
        return self.skip(x_BCHW) + self.conv2(F.silu(h))


class Attention(nn.Module):
    """Single-head self-attention over the pixels of a feature map, residual, output projection zeroed."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x_BCHW: Tensor) -> Tensor:
        b, c, h, w = x_BCHW.shape
        q_BTC, k_BTC, v_BTC = self.qkv(self.norm(x_BCHW)).flatten(2).transpose(1, 2).chunk(3, dim=2)
        out_BTC = F.scaled_dot_product_attention(q_BTC, k_BTC, v_BTC)
        return x_BCHW + self.proj(out_BTC.transpose(1, 2).reshape(b, c, h, w))


# ---------------------------------------------------------------------- UNet
class UNet(nn.Module):
    """``v_theta(x_t, t, c_aug, s)``: input ``concat(x_t, c_aug)`` (6 channels), output 3 channels.

    Steps:
      1. ``emb = Embedding_t(t) + Embedding_s(s)``; PixelUnshuffle the 6-channel input by ``patch_size``.
      2. Encoder: per level ``n_res_blocks`` ResBlocks, keep the output as the skip, stride-2 conv down.
      3. Middle: ResBlock, optional Attention, ResBlock (lowest resolution).
      4. Decoder: per level (lowest first) concat the skip, ``n_res_blocks`` ResBlocks, nearest 2x up + conv.
      5. GroupNorm-SiLU-conv to ``3 * patch_size**2`` channels, zero-initialised (the initial velocity is
         0), PixelShuffle back to full resolution.
    """

    def __init__(self, cfg: RefinerConfig) -> None:
        super().__init__()
        ch, e, g, n = cfg.channels, cfg.time_dim, cfg.norm_groups, cfg.n_res_blocks
        self.t_embed, self.s_embed = Embedding(e), Embedding(e)
        p = cfg.patch_size
        self.unshuffle, self.shuffle = nn.PixelUnshuffle(p), nn.PixelShuffle(p)
        self.stem = nn.Conv2d(6 * p * p, ch[0], 3, padding=1)
        self.down_blocks = nn.ModuleList()
        self.downs = nn.ModuleList()
        for i, c in enumerate(ch):
            c_prev = ch[max(i - 1, 0)]
            self.down_blocks.append(
                nn.ModuleList([ResBlock(c_prev if j == 0 else c, c, e, g) for j in range(n)])
            )
            self.downs.append(nn.Conv2d(c, c, 3, stride=2, padding=1) if i < len(ch) - 1 else nn.Identity())
        self.mid1 = ResBlock(ch[-1], ch[-1], e, g)
        self.attn = Attention(ch[-1], g) if cfg.attention else nn.Identity()
        self.mid2 = ResBlock(ch[-1], ch[-1], e, g)
        self.up_blocks = nn.ModuleList()
        self.ups = nn.ModuleList()
        for i in reversed(range(len(ch))):
            c = ch[i]
            self.up_blocks.append(
                nn.ModuleList([ResBlock(2 * c if j == 0 else c, c, e, g) for j in range(n)])
            )
            self.ups.append(nn.Conv2d(c, ch[i - 1], 3, padding=1) if i > 0 else nn.Identity())
        self.out_norm = nn.GroupNorm(g, ch[0])
        self.out = nn.Conv2d(ch[0], 3 * p * p, 3, padding=1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x_BCHW: Tensor, cond_BCHW: Tensor, t_B: Tensor, aug_B: Tensor) -> Tensor:
        emb_BE = self.t_embed(t_B) + self.s_embed(aug_B)
        h = self.stem(self.unshuffle(torch.cat([x_BCHW, cond_BCHW], dim=1)))
        skips = []
        for blocks, down in zip(self.down_blocks, self.downs):
            for block in blocks:
                h = block(h, emb_BE)
            skips.append(h)
            h = down(h)
        h = self.mid2(self.attn(self.mid1(h, emb_BE)), emb_BE)
        for blocks, up in zip(self.up_blocks, self.ups):
            h = torch.cat([h, skips.pop()], dim=1)
            for block in blocks:
                h = block(h, emb_BE)
            if not isinstance(up, nn.Identity):
                h = up(F.interpolate(h, scale_factor=2, mode="nearest"))
        return self.shuffle(self.out(F.silu(self.out_norm(h))))


# ---------------------------------------------------------------------- refiner
class Refiner(nn.Module):
    """The UNet plus its objective (:meth:`loss`), sampler (:meth:`refine`) and persistence."""

    def __init__(self, cfg: RefinerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.unet = UNet(cfg)

    def forward(self, x_BCHW: Tensor, cond_BCHW: Tensor, t_B: Tensor, aug_B: Tensor) -> Tensor:
        """The denoised estimate ``x_hat (B, 3, H, W)`` of the target from ``x_t``, the (augmented) upsampled
        condition ``(B, 3, H, W)``, ``t (B,)`` and the augmentation level ``s (B,)``.

        The UNet sees ``x_t / std(x_t)`` (``std`` assuming a target of std ``sigma_data``) and predicts the
        target directly (x-prediction); :meth:`velocity` turns that into ``v``.
        """
        t = t_B.float()[:, None, None, None]
        std_xt = ((1 - t) ** 2 * self.cfg.sigma_data**2 + t**2).sqrt()
        return self.unet(x_BCHW / std_xt, cond_BCHW, t_B, aug_B)

    def velocity(
        self, x_BCHW: Tensor, cond_BCHW: Tensor, t_B: Tensor, aug_B: Tensor, t_min: float = 0.0
    ) -> Tensor:
        """``v = (x_t - x_hat) / max(t, t_min)``: the flow's velocity implied by :meth:`forward`'s ``x_hat``
        (exact for ``t >= t_min``; ``eps = (x_t - (1 - t) x) / t`` so ``eps - x = (x_t - x) / t``)."""
        t = t_B.float()[:, None, None, None].clamp_min(max(t_min, 1e-6))
        return (x_BCHW - self(x_BCHW, cond_BCHW, t_B, aug_B)) / t

    def _to_target(self, high_BCHW: Tensor, up_BCHW: Tensor) -> Tensor:
        if self.cfg.predict_residual:
            return self.cfg.residual_scale * (high_BCHW - up_BCHW)
        return high_BCHW

    def _from_target(self, x_BCHW: Tensor, up_BCHW: Tensor) -> Tensor:
        if self.cfg.predict_residual:
            return up_BCHW + x_BCHW / self.cfg.residual_scale
        return x_BCHW

    def sample_t(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``n`` training times from ``cfg.t_sampling``."""
        if self.cfg.t_sampling == "uniform":
            return torch.rand(n, generator=generator)
        return torch.sigmoid(torch.randn(n, generator=generator))

    def loss(self, low_BCHW: Tensor, high_BCHW: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Rectified-flow loss on a batch of pairs (pixels in [-1, 1]).

        Args:
            low_BCHW: degraded low-res inputs ``(B, 3, H / scale, W / scale)``.
            high_BCHW: high-res targets ``(B, 3, H, W)``.
            generator: source of ``t``, the noise and the augmentation (None: torch's global RNG).

        Returns:
            Scalar mean squared error between the predicted and the target velocity ``eps - x``.
        """
        b = high_BCHW.shape[0]
        up_BCHW = upsample(low_BCHW, self.cfg.scale)
        x_BCHW = self._to_target(high_BCHW, up_BCHW)
        t_B = self.sample_t(b, generator).to(high_BCHW.device)
        aug_B = self.cfg.noise_aug_max * torch.rand(b, generator=generator)
        aug_B = torch.where(torch.rand(b, generator=generator) < self.cfg.noise_aug_prob, aug_B, 0.0)
        aug_B = aug_B.to(high_BCHW.device)
        eps_BCHW = torch.randn(high_BCHW.shape, generator=generator).to(high_BCHW.device)
        aug_noise_BCHW = torch.randn(high_BCHW.shape, generator=generator).to(high_BCHW.device)
        cond_BCHW = up_BCHW + aug_B[:, None, None, None] * aug_noise_BCHW
        tb = t_B[:, None, None, None]
        x_t_BCHW = (1 - tb) * x_BCHW + tb * eps_BCHW
        v_BCHW = self.velocity(x_t_BCHW, cond_BCHW, t_B, aug_B, t_min=self.cfg.loss_t_min)
        return F.mse_loss(v_BCHW, eps_BCHW - x_BCHW)

    @torch.no_grad()
    def refine(
        self,
        low_uint8: np.ndarray,
        steps: int | None = None,
        seed: int = 0,
        start_t: float | None = None,
        *,
        noise_aug: float | None = None,
        batch_size: int = 64,
    ) -> np.ndarray:
        """Upsample uint8 images (or clips) ``scale`` x with ``steps`` Euler steps of the flow.

        Args:
            low_uint8: uint8 ``(N, H, W, 3)`` images, or clips ``(N, T, H, W, 3)`` refined frame by frame
                (the frames of a clip share their noise). ``scale * H`` and ``scale * W`` must be
                multiples of ``patch_size * 2 ** (len(channels) - 1)``; it is trained at ``H = low_size``.
            steps: Euler steps (default ``cfg.sample_steps``); 1 step from ``t = 1`` is the posterior mean.
            seed: seeds the ``torch.Generator`` all noise is drawn from; same seed, same output.
            start_t: None or 1.0 samples from pure noise; ``0 < start_t < 1`` is SDEdit: start from the
                bicubic upsample noised to ``t = start_t`` and integrate ``steps`` steps from there.
            noise_aug: augmentation level ``s`` given to the model (default ``cfg.sample_noise_aug``).
            batch_size: images per UNet call (does not change which noise each image gets).

        Returns:
            uint8 of shape ``(N, scale H, scale W, 3)`` (or ``(N, T, scale H, scale W, 3)``).
        """
        images = _check_images(low_uint8, self.cfg)
        steps = self.cfg.sample_steps if steps is None else steps
        t0 = 1.0 if start_t is None else float(start_t)
        aug = self.cfg.sample_noise_aug if noise_aug is None else float(noise_aug)
        if steps < 1 or not 0.0 < t0 <= 1.0 or not 0.0 <= aug <= 1.0:
            raise ValueError(f"need steps={steps} >= 1, start_t={t0} in (0, 1], noise_aug={aug} in [0, 1]")
        clip_shape = images.shape[:-3]
        frames = images.reshape(-1, *images.shape[-3:])
        n_clips, per_clip = clip_shape[0], (clip_shape[1] if len(clip_shape) == 2 else 1)
        hs, ws = frames.shape[1] * self.cfg.scale, frames.shape[2] * self.cfg.scale
        generator = torch.Generator().manual_seed(seed)
        # All noise is drawn up front, per clip, so batching never changes which noise a frame gets.
        eps_NCHW = torch.randn(n_clips, 3, hs, ws, generator=generator).repeat_interleave(per_clip, dim=0)
        aug_NCHW = torch.randn(n_clips, 3, hs, ws, generator=generator).repeat_interleave(per_clip, dim=0)
        device = next(self.parameters()).device
        times = torch.linspace(t0, 0.0, steps + 1).tolist()
        was_training = self.training
        self.eval()
        out = []
        try:
            for i in range(0, len(frames), batch_size):
                up_BCHW = upsample(to_pixels(frames[i : i + batch_size]).to(device), self.cfg.scale)
                b = up_BCHW.shape[0]
                cond_BCHW = up_BCHW + aug * aug_NCHW[i : i + b].to(device)
                aug_B = torch.full((b,), aug, device=device)
                base_BCHW = self._to_target(up_BCHW, up_BCHW)  # the upsample itself, in target space
                x_BCHW = (1 - t0) * base_BCHW + t0 * eps_NCHW[i : i + b].to(device)
                for t, t_next in zip(times[:-1], times[1:]):
                    v_BCHW = self.velocity(x_BCHW, cond_BCHW, torch.full((b,), t, device=device), aug_B)
                    x_BCHW = x_BCHW + (t_next - t) * v_BCHW
                out.append(to_uint8(self._from_target(x_BCHW, up_BCHW).clamp(-1.0, 1.0)))
        finally:
            self.train(was_training)
        return np.concatenate(out).reshape(*clip_shape, hs, ws, 3)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
        """Write the folder ``path/`` atomically: weights, ``config.yaml`` and ``meta.json``."""
        return save_module(path, self, self.cfg, VERSION, WEIGHTS_FILE, meta)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> Refiner:
        """Load a folder written by :meth:`save` (safetensors + YAML, no pickle).

        Raises:
            RefinerError: a missing or unreadable file, another format version, or weights that do not
                match ``config.yaml``; the message is one line.
        """
        return load_module(path, cls, RefinerConfig, VERSION, WEIGHTS_FILE, RefinerError, "refiner", device)
