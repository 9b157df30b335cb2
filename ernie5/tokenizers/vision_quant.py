"""Bitwise multi-scale residual quantiser (VAR schedule, Infinity/BSQ codes), per frame.

Shapes: B batch, T frames, D code bits (= latent dims), h x w latent grid, n_k side of scale k,
N = B*T frames quantised independently.

For every frame, with ``z`` the unit-norm latent and ``f_hat = 0``, for each scale k of the schedule:

1. ``r_k = area_downsample(z - f_hat, n_k)`` (the residual still to explain, at scale k);
2. ``b_k = sign(r_k)`` in {-1, +1}^D (``sign(0) = +1``); these are the scale's tokens;
3. optionally flip each bit w.p. ``flip_prob`` (Infinity's bitwise self-correction): the flipped bits
   are what gets accumulated, so every later residual, and so every later target, is computed from the
   corrupted cumulative map;
4. ``f_hat += Phi(upsample(rho_k * b_k / sqrt(D), h x w))`` (bilinear; ``Phi`` optional).

Progressive bit depth: quantising with ``n_bits < D`` uses only the first ``n_bits`` latent dims; the
code of a token is those ``n_bits`` bits and the other ``D - n_bits`` dims of ``f_hat`` are zero. Every
operation above acts on each dim separately (area pooling, sign, bilinear upsampling), so without
``Phi`` the ``n_bits`` codes are exactly the first ``n_bits`` bits of the full-depth codes and ``f_hat``
is the full-depth ``f_hat`` with the last dims zeroed: a backbone trained on the low-depth tokens keeps
its meaning when the depth is raised (new bit heads are added, old ones stay valid). ``Phi`` mixes dims
(its input and output are masked to the first ``n_bits``), so with ``Phi`` the low-depth codes are a
different, still valid, code.

References:
  * VAR, Tian et al. 2024, arXiv 2404.02905 (``models/quant.py``): multi-scale residual quantisation,
    area down / bicubic up, Phi, commitment loss averaged over scales, teacher-forcing inputs.
  * Infinity, Han et al. 2025, arXiv 2412.04431: bitwise tokens, bitwise self-correction.
  * BSQ, Zhao et al. 2024, arXiv 2406.07548: unit-sphere latent, codes ``b / sqrt(D)``.
  * VideoAR, arXiv 2601.05966 section 4.1: temporal-independent (per frame) quantisation.

Deviations:
  1. Each scale's code is added at a learned radius ``rho_k`` (``rho_k = exp(log_radius[k])``,
     initialised to ``2**-k``) times ``b_k / sqrt(D)``. Infinity adds every scale at radius 1 to an
     unnormalised latent; with a unit-sphere latent (BSQ) constant steps overshoot from the second scale
     on, so the residual would not shrink. Halving steps make the schedule a successive approximation
     (the error of ``z`` falls with every scale), and learning ``rho`` is VAR's codebook learning for a
     binary codebook. The tokens are unchanged: D bits per position.
  2. Bilinear, not bicubic, upsampling (no overshoot on 1x1 -> 8x8); one shared Phi, not four.
  3. The straight-through output keeps the gradient of ``rho`` and ``Phi`` from the reconstruction loss
     (``f_hat + z - sg(z)``), where VAR passes only the commitment loss to its codebook.
  4. No BSQ entropy penalty: codes are deterministic signs and the small latent uses its bits without it
     (bit usage is logged by the trainer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ernie5.tokenizers.vision_config import VisionTokenizerConfig


@dataclass(frozen=True, slots=True)
class MultiScaleCodes:
    """The result of quantising a latent.

    ``bits[k]`` are the tokens (training targets) of scale k; ``input_bits[k]`` are the bits that were
    accumulated into ``f_hat`` (they differ from ``bits`` only where self-correction flipped a bit; with
    ``flip_prob=0`` they are the same tensors). ``codes_to_fhat(input_bits)`` equals ``f_hat`` and
    ``scale_inputs(input_bits)`` gives the teacher-forcing inputs whose targets are ``bits``.
    """

    bits: list[Tensor]
    """Per scale, float ``(B, T, n_k, n_k, n_bits)`` in {-1, +1}."""
    input_bits: list[Tensor]
    """Per scale, float ``(B, T, n_k, n_k, n_bits)`` in {-1, +1}: ``bits`` after flips."""
    f_hat: Tensor
    """``(B, D, T, h, w)`` cumulative reconstruction of the latent (straight-through to ``z``); dims
    ``>= n_bits`` are zero."""
    commit_loss: Tensor
    """Scalar VAR commitment loss, averaged over scales (0 when ``z`` needs no gradient)."""
    n_bits: int
    """Bits per code used (``<= D``)."""


# ---------------------------------------------------------------------- layout helpers
def frames_to_batch(x_BDThw: Tensor) -> Tensor:
    """``(B, D, T, h, w) -> (B*T, D, h, w)``, frames of one batch item contiguous."""
    B, D, T, h, w = x_BDThw.shape
    return x_BDThw.transpose(1, 2).reshape(B * T, D, h, w)


def batch_to_frames(x_NDhw: Tensor, B: int) -> Tensor:
    """``(B*T, D, h, w) -> (B, D, T, h, w)``."""
    N, D, h, w = x_NDhw.shape
    return x_NDhw.reshape(B, N // B, D, h, w).transpose(1, 2)


def area_downsample(x_NDhw: Tensor, n: int) -> Tensor:
    """Mean over the pixels of each cell of an ``n x n`` grid (``F.interpolate(mode='area')``)."""
    return x_NDhw if x_NDhw.shape[-1] == n and x_NDhw.shape[-2] == n else F.adaptive_avg_pool2d(x_NDhw, n)


def _upsample(x_NDnn: Tensor, h: int, w: int) -> Tensor:
    if x_NDnn.shape[-2:] == (h, w):
        return x_NDnn
    return F.interpolate(x_NDnn, size=(h, w), mode="bilinear", align_corners=False)


def _bits_to_channels(bits_BTnnK: Tensor) -> Tensor:
    """``(B, T, n, n, K) -> (B*T, K, n, n)``."""
    B, T, n, m, K = bits_BTnnK.shape
    return bits_BTnnK.reshape(B * T, n, m, K).permute(0, 3, 1, 2)


def _channels_to_bits(x_NKnn: Tensor, B: int) -> Tensor:
    """``(B*T, K, n, n) -> (B, T, n, n, K)``."""
    N, K, n, m = x_NKnn.shape
    return x_NKnn.permute(0, 2, 3, 1).reshape(B, N // B, n, m, K)


# ---------------------------------------------------------------------- quantiser
class BitwiseMultiScaleQuantizer(nn.Module):
    """Per-frame bitwise multi-scale residual quantiser (see the module docstring for the steps)."""

    def __init__(self, cfg: VisionTokenizerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.scales = tuple(cfg.scales)
        self.latent_bits = cfg.latent_bits
        n_scales = len(cfg.scales)
        self.log_radius = nn.Parameter(-math.log(2.0) * torch.arange(n_scales, dtype=torch.float32))
        self.phi = nn.Conv2d(cfg.latent_bits, cfg.latent_bits, 3, padding=1) if cfg.phi else None

    # ------------------------------------------------------------------ pieces
    def _check_bits(self, n_bits: int | None) -> int:
        D = self.latent_bits
        n_bits = D if n_bits is None else int(n_bits)
        if not 1 <= n_bits <= D:
            raise ValueError(f"n_bits={n_bits} must be in [1, latent_bits={D}]")
        return n_bits

    def _scale_map(self, bits_NKnn: Tensor, k: int, h: int, w: int) -> Tensor:
        """The contribution of scale k's bits to ``f_hat``: ``(N, K, n, n) -> (N, D, h, w)``."""
        D, K = self.latent_bits, bits_NKnn.shape[1]
        radius = self.log_radius[k].exp().to(bits_NKnn.dtype) / math.sqrt(D)
        h_NKhw = _upsample(bits_NKnn * radius, h, w)
        if self.phi is not None:
            h_NDhw = F.pad(h_NKhw, (0, 0, 0, 0, 0, D - K)) if K < D else h_NKhw
            h_NKhw = (0.5 * h_NDhw + 0.5 * self.phi(h_NDhw))[:, :K]
        return F.pad(h_NKhw, (0, 0, 0, 0, 0, D - K)) if K < D else h_NKhw

    def _grid(self, bits_list: list[Tensor]) -> tuple[int, int, int]:
        if len(bits_list) != len(self.scales):
            raise ValueError(f"got {len(bits_list)} scales of bits, the schedule has {len(self.scales)}")
        for k, (b, n) in enumerate(zip(bits_list, self.scales)):
            if b.ndim != 5 or b.shape[2] != n or b.shape[3] != n or not 1 <= b.shape[4] <= self.latent_bits:
                raise ValueError(
                    f"bits[{k}] has shape {tuple(b.shape)}, "
                    f"expected (B, T, {n}, {n}, n_bits<={self.latent_bits})"
                )
        B, T = bits_list[0].shape[:2]
        return B, T, self.scales[-1]

    # ------------------------------------------------------------------ public
    def forward(
        self,
        z_BDThw: Tensor,
        n_bits: int | None = None,
        flip_prob: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> MultiScaleCodes:
        """Quantise a latent (see :meth:`ernie5.tokenizers.vision.VisionTokenizer.quantize`)."""
        n_bits = self._check_bits(n_bits)
        if not 0.0 <= flip_prob <= 1.0:
            raise ValueError(f"flip_prob={flip_prob} must be in [0, 1]")
        B, D, T, h, w = z_BDThw.shape
        if z_BDThw.shape[1] != self.latent_bits:
            raise ValueError(f"latent has {D} dims, the quantiser expects latent_bits={self.latent_bits}")
        z_NDhw = frames_to_batch(z_BDThw)
        if n_bits < D:
            z_NDhw = F.pad(z_NDhw[:, :n_bits], (0, 0, 0, 0, 0, D - n_bits))
        z_sg = z_NDhw.detach()
        f_hat = torch.zeros_like(z_sg)
        bits, input_bits = [], []
        commit = z_NDhw.new_zeros(())
        for k, n in enumerate(self.scales):
            r_NKnn = area_downsample(z_sg[:, :n_bits] - f_hat[:, :n_bits].detach(), n)
            b_NKnn = torch.where(r_NKnn >= 0, 1.0, -1.0).to(z_sg.dtype)
            bits.append(_channels_to_bits(b_NKnn, B))
            if flip_prob > 0:
                flip = torch.rand(b_NKnn.shape, generator=generator, device=b_NKnn.device) < flip_prob
                b_NKnn = torch.where(flip, -b_NKnn, b_NKnn)
                input_bits.append(_channels_to_bits(b_NKnn, B))
            else:
                input_bits.append(bits[-1])
            f_hat = f_hat + self._scale_map(b_NKnn, k, h, w)
            if z_NDhw.requires_grad or f_hat.requires_grad:
                zk, fk = z_NDhw[:, :n_bits], f_hat[:, :n_bits]
                commit = commit + self.cfg.commit_beta * F.mse_loss(zk, fk.detach())
                commit = commit + F.mse_loss(fk, zk.detach())
        commit = commit / len(self.scales)
        f_hat_st = f_hat + (z_NDhw - z_sg)  # value f_hat; gradient to z is the identity (straight-through)
        return MultiScaleCodes(
            bits=bits,
            input_bits=input_bits,
            f_hat=batch_to_frames(f_hat_st, B),
            commit_loss=commit,
            n_bits=n_bits,
        )

    def codes_to_fhat(self, bits_list: list[Tensor]) -> Tensor:
        """Cumulative reconstruction ``(B, D, T, h, w)`` of per-scale bits ``(B, T, n_k, n_k, n_bits)``.

        Bitwise equal to the ``f_hat`` of the :meth:`forward` call that produced ``input_bits``.
        """
        B, T, size = self._grid(bits_list)
        f_hat = None
        for k, b in enumerate(bits_list):
            contrib = self._scale_map(_bits_to_channels(b), k, size, size)
            f_hat = torch.zeros_like(contrib) + contrib if f_hat is None else f_hat + contrib
        return batch_to_frames(f_hat, B)

    def scale_inputs(self, bits_list: list[Tensor]) -> list[Tensor]:
        """VAR teacher-forcing inputs: per scale k, ``(B, T, n_k, n_k, D)``.

        Input k is ``area_downsample(f_hat_{<k}, n_k)``, the cumulative reconstruction of scales before k
        at scale k's grid; input 0 is zeros (the backbone replaces it by its start embedding, or by the
        previous frame's ``f_hat`` for frames after the first). Dims ``>= n_bits`` are zero.
        """
        B, T, size = self._grid(bits_list)
        D = self.latent_bits
        n0 = self.scales[0]
        inputs = [bits_list[0].new_zeros(B, T, n0, n0, D)]
        f_hat = None
        for k in range(1, len(self.scales)):
            contrib = self._scale_map(_bits_to_channels(bits_list[k - 1]), k - 1, size, size)
            f_hat = torch.zeros_like(contrib) + contrib if f_hat is None else f_hat + contrib
            inputs.append(_channels_to_bits(area_downsample(f_hat, self.scales[k]), B))
        return inputs
