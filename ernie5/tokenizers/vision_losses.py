"""Training losses of the vision tokenizer: reconstruction, a perceptual-style term, adversarial.

Images are float ``(N, C, H, W)`` in [-1, 1] (callers flatten frames into N).

* reconstruction: ``L1 + L2`` per pixel (:func:`reconstruction_loss`);
* perceptual-style: ``(1 - SSIM)`` with an 11x11 gaussian window (sigma 1.5) plus the L1 distance of
  Sobel image gradients (:func:`ssim`, :func:`gradient_loss`). No pretrained feature network (LPIPS /
  VGG) can be downloaded here, and a feature network trained by the project on the same tiny data would
  add little; SSIM (local luminance, contrast, structure) and gradient matching are the standard
  network-free stand-ins that push against the blur an L2 loss prefers;
* adversarial (optional, off by default): a small PatchGAN discriminator (:class:`PatchDiscriminator`)
  with the hinge loss (:func:`hinge_d_loss`, :func:`hinge_g_loss`).

References:
  * SSIM: Wang, Bovik, Sheikh, Simoncelli 2004, "Image quality assessment: from error visibility to
    structural similarity" (gaussian 11x11, sigma 1.5, K1 = 0.01, K2 = 0.03).
  * PatchGAN: Isola et al. 2017 (pix2pix), as used by VQGAN (Esser et al. 2021); hinge loss: Lim & Ye
    2017, Miyato et al. 2018.

Deviations:
  1. No LPIPS and no StyleGAN discriminator (the report's choice): SSIM + Sobel-gradient L1 stand in for
     the perceptual loss and a 3-layer PatchGAN for the discriminator.
  2. No semantic regularisation from a vision foundation model (none is available offline).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def _gaussian_kernel(size: int, sigma: float, channels: int, ref: Tensor) -> Tensor:
    coords = torch.arange(size, dtype=ref.dtype, device=ref.device) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :]).expand(channels, 1, size, size).contiguous()


def ssim(a_NCHW: Tensor, b_NCHW: Tensor) -> Tensor:
    """Differentiable mean SSIM of two image batches in [-1, 1] (gaussian window, 'valid' positions only).

    The images are mapped to [0, 1] first: SSIM's luminance term is not shift-invariant and is only
    meaningful for non-negative intensities, so this equals the uint8 metric
    :func:`evals.metrics.ssim` of the same images (up to rounding).

    Args:
        a_NCHW, b_NCHW: float images of the same shape, values in [-1, 1].

    Returns:
        Scalar: SSIM averaged over valid window positions, channels and images (1 when equal).
    """
    a_NCHW, b_NCHW = (a_NCHW + 1) / 2, (b_NCHW + 1) / 2
    C = a_NCHW.shape[1]
    size = min(SSIM_WINDOW, a_NCHW.shape[-1], a_NCHW.shape[-2])
    size -= 1 - size % 2
    kernel = _gaussian_kernel(size, SSIM_SIGMA, C, a_NCHW)
    c1, c2 = SSIM_K1**2, SSIM_K2**2
    stacked = torch.cat([a_NCHW, b_NCHW, a_NCHW * a_NCHW, b_NCHW * b_NCHW, a_NCHW * b_NCHW], dim=1)
    mu_a, mu_b, aa, bb, ab = F.conv2d(stacked, kernel.repeat(5, 1, 1, 1), groups=5 * C).chunk(5, dim=1)
    var_a, var_b, cov = aa - mu_a**2, bb - mu_b**2, ab - mu_a * mu_b
    num = (2 * mu_a * mu_b + c1) * (2 * cov + c2)
    den = (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
    return (num / den).mean()


def _sobel(x_NCHW: Tensor) -> Tensor:
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]], dtype=x_NCHW.dtype) / 8
    kernel = torch.stack([kx, kx.T]).to(x_NCHW.device)[:, None]  # (2, 1, 3, 3): d/dx, d/dy
    C = x_NCHW.shape[1]
    padded = F.pad(x_NCHW, (1, 1, 1, 1), mode="replicate")
    return F.conv2d(padded, kernel.repeat(C, 1, 1, 1), groups=C)


def gradient_loss(a_NCHW: Tensor, b_NCHW: Tensor) -> Tensor:
    """Mean L1 distance of the Sobel x/y gradients of two image batches."""
    return (_sobel(a_NCHW) - _sobel(b_NCHW)).abs().mean()


def reconstruction_loss(x_rec: Tensor, x: Tensor) -> Tensor:
    """``mean |x_rec - x| + mean (x_rec - x)^2``."""
    diff = x_rec - x
    return diff.abs().mean() + diff.square().mean()


def perceptual_loss(x_rec_NCHW: Tensor, x_NCHW: Tensor) -> tuple[Tensor, Tensor]:
    """``(1 - SSIM, Sobel-gradient L1)`` of a reconstruction against its target."""
    return 1.0 - ssim(x_rec_NCHW, x_NCHW), gradient_loss(x_rec_NCHW, x_NCHW)


class PatchDiscriminator(nn.Module):
    """A small PatchGAN: strided 4x4 convs with LeakyReLU, one real/fake logit per patch."""

    def __init__(self, channels: int = 3, width: int = 32, n_layers: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(channels, width, 4, stride=2, padding=1), nn.LeakyReLU(0.2)]
        c = width
        for _ in range(n_layers - 1):
            layers += [nn.Conv2d(c, 2 * c, 4, stride=2, padding=1), nn.GroupNorm(8, 2 * c), nn.LeakyReLU(0.2)]
            c *= 2
        layers.append(nn.Conv2d(c, 1, 3, padding=1))
        self.net = nn.Sequential(*layers)

    def forward(self, x_NCHW: Tensor) -> Tensor:
        """Patch logits ``(N, 1, H / 2**n_layers, W / 2**n_layers)``."""
        return self.net(x_NCHW)


def hinge_d_loss(logits_real: Tensor, logits_fake: Tensor) -> Tensor:
    """Discriminator hinge loss ``mean relu(1 - real) + mean relu(1 + fake)``, halved."""
    return 0.5 * (F.relu(1.0 - logits_real).mean() + F.relu(1.0 + logits_fake).mean())


def hinge_g_loss(logits_fake: Tensor) -> Tensor:
    """Generator hinge loss ``-mean(fake)``."""
    return -logits_fake.mean()
