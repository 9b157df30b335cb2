"""Vision inside the backbone: dual-path understanding inputs, NFSP generation inputs, bitwise head.

Understanding (report §2.2.2): pre-quantisation CNN features of the tokenizer encoder (perceptual)
and features of a small ViT over the same latent grid (semantic) are fused per group of adjacent
patches (2 x 2 for an image, 2 x 2 x ``merge_frames`` for video) by an attention-based patch merger:
project the CNN features to the ViT width, concatenate the 2K patch tokens, one self-attention
layer, mean-pool, linear to ``d_model``. The merged vectors enter the backbone as continuous
embeddings between BOI/EOI (BOV/EOV) with no loss on them.

Generation, Next-Frame-and-Scale Prediction (report §2.2.3; VAR, Infinity, VideoAR): frame-major,
scale-minor blocks; the input of scale ``k`` of a frame is the area-downsampled sum of the coarser
scales (VAR) mapped to ``d_model`` plus a learned scale embedding; the first scale of the first
frame gets a learned start embedding and the first scale of a later frame the accumulated previous
frame (the tokenizer computes these inputs); the bitwise head predicts the ``latent_bits`` bits of
every token of the block (Infinity's bitwise classifier instead of a 2^D softmax).

Positions (Uni-RoPE): ``t`` = frame, ``(h, w)`` = centre-aligned coordinates of a cell on the
latent grid, doubled so they are integers: the cell ``i`` of an ``n``-cell scale covers latent
cells ``[i L/n, (i+1) L/n)``, whose centre is ``(i + 0.5) L/n - 0.5``, stored as ``(2i + 1) L/n - 1``.
Every scale of every frame is one attention block (bidirectional inside, causal across).

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.2.2 (dual-path features, attention-based
    patch merger), §2.2.3 (NFSP, scale-wise causal mask, Uni-RoPE centre alignment, coarse-scale
    loss weighting, bit-flip self-correction).
  * VAR (arXiv 2404.02905), Infinity (arXiv 2412.04431), VideoAR (arXiv 2601.05966).
  * Xiao et al., "Early convolutions help transformers see better" (arXiv 2106.14881): the conv stem.

Deviations:
  1. The ViT is small and trained from scratch with the backbone (no pretrained vision foundation
     model can be downloaded here); the CNN features come from the frozen project tokenizer.
  2. Per-scale loss weights are ``1 / sqrt(n_k^2)`` normalised to mean 1 over positions (the report
     says coarse scales are up-weighted but not by how much).
  3. Besides Uni-RoPE, every generation position gets a learned embedding of its cell (its index
     within the frame's scales), as VAR adds absolute position embeddings: inside a bidirectional
     block of near-identical VAR inputs, relative rotary phases alone barely tell positions apart.
  4. The merger normalises its inputs and its pooled output (LayerNorm on the CNN features before
     the projection, and on the mean-pooled vector before the final linear), as Qwen2-VL's merger
     does; the report lists the merger's steps but not its norms. Without them the pre-norm
     residual stream of the merger layer grows into a large image-independent component: the
     backbone's first RMSNorm then divides the image-dependent part (and its gradient) by it, and
     understanding does not train (measured: a merged vector of norm ~78 varying by ~0.6 across
     MNIST digits; answer loss stuck at chance after 300 steps of 80 % MNIST).
  5. ``vit_stem: conv`` (option; default ``patch``, the report's ViT) embeds pixels with three 3x3
     convolutions instead of one linear map per patch, as the early-convolution ViTs do. At this
     scale it is what lets the ViT learn shapes of strokes rather than pixel positions: a 32-wide
     one-layer ViT classifier on MNIST's train split, augmented, reads 0.969 of MNIST's test split,
     0.945 of USPS and 0.759 of Semeion with it, against 0.949 / 0.939 / 0.694 with the patch stem.
  6. ``merger_positions`` (option; default off, as the report's merger) adds learned embeddings of a
     token's frame and cell inside its merge group before the merger's attention. Without positions
     the merger pools a set, so the order of the ``merge_frames`` frames it merges, and with it a
     clip's motion direction, cannot reach the backbone (measured: direction answered at chance,
     0.26, after 600 steps of a clip proxy whose content questions reach 0.997).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ernie5.model.config import VisionConfig
from ernie5.model.inputs import VisionGen, VisionInputs


def cell_centres(n: int, latent: int) -> torch.Tensor:
    """Doubled centre coordinates of the ``n`` cells of a scale on a ``latent``-cell axis (ints)."""
    i = torch.arange(n)
    return (2 * i + 1) * latent // n - 1


def nfsp_layout(cfg: VisionConfig, n_frames: int) -> dict[str, torch.Tensor]:
    """Relative positions (3, N), block ids, scale index and frame index of NFSP generation tokens.

    Order: frame-major, scale-minor, row-major inside a scale. One block per (frame, scale).
    """
    pos, blk, scale, frame, cell = [], [], [], [], []
    k_scales = len(cfg.scales)
    for f in range(n_frames):
        for k, n in enumerate(cfg.scales):
            c = cell_centres(n, cfg.latent_size)
            hh, ww = torch.meshgrid(c, c, indexing="ij")
            m = n * n
            pos.append(torch.stack([torch.full((m,), f), hh.reshape(-1), ww.reshape(-1)]))
            blk.append(torch.full((m,), f * k_scales + k))
            scale.append(torch.full((m,), k))
            frame.append(torch.full((m,), f))
            cell.append(torch.arange(m) + sum(q * q for q in cfg.scales[:k]))
    return {
        "positions": torch.cat(pos, dim=1),
        "block_ids": torch.cat(blk),
        "scale": torch.cat(scale),
        "frame": torch.cat(frame),
        "cell": torch.cat(cell),
    }


def scale_loss_weights(cfg: VisionConfig, n_frames: int) -> torch.Tensor:
    """Per-token bit-loss weights favouring coarse scales: ``1/n_k``, normalised to mean 1."""
    w = torch.cat([torch.full((n * n,), 1.0 / n) for _ in range(n_frames) for n in cfg.scales])
    return w * (w.numel() / w.sum())


def und_groups(cfg: VisionConfig, n_frames: int) -> tuple[int, int]:
    """(temporal groups, spatial groups per side) of the understanding merger."""
    tg = math.ceil(n_frames / cfg.merge_frames) if n_frames > 1 else 1
    return tg, cfg.latent_size // cfg.merge


def und_layout(cfg: VisionConfig, n_frames: int) -> dict[str, torch.Tensor]:
    """Relative positions (3, N) and block ids of understanding embeddings (one block: bidirectional)."""
    tg, sg = und_groups(cfg, n_frames)
    c = cell_centres(sg, cfg.latent_size)
    pos = []
    for t in range(tg):
        hh, ww = torch.meshgrid(c, c, indexing="ij")
        pos.append(torch.stack([torch.full((sg * sg,), t), hh.reshape(-1), ww.reshape(-1)]))
    positions = torch.cat(pos, dim=1)
    return {"positions": positions, "block_ids": torch.zeros(positions.shape[1], dtype=torch.long)}


class _EncoderLayer(nn.Module):
    """Pre-norm bidirectional self-attention + MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        b, n, d = x_BND.shape
        q, k, v = self.qkv(self.norm1(x_BND)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x_BND = x_BND + self.proj(o.transpose(1, 2).reshape(b, n, d))
        return x_BND + self.mlp(self.norm2(x_BND))


def conv_stem(dim: int) -> nn.Sequential:
    """Three 3x3 convolutions (stride 1, 2, 2) from RGB to ``dim`` channels: a 4x downsampling stem."""
    return nn.Sequential(
        nn.Conv2d(3, dim // 2, 3, 1, 1),
        nn.GELU(),
        nn.Conv2d(dim // 2, dim, 3, 2, 1),
        nn.GELU(),
        nn.Conv2d(dim, dim, 3, 2, 1),
    )


class ViT(nn.Module):
    """A small ViT over one frame: patches of ``patch`` pixels -> a ``latent x latent`` feature grid."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        if cfg.vit_stem == "conv":
            self.embed = conv_stem(cfg.vit_dim)
        else:
            self.embed = nn.Conv2d(3, cfg.vit_dim, cfg.patch, stride=cfg.patch)
        self.pos = nn.Parameter(torch.zeros(1, cfg.latent_size**2, cfg.vit_dim))
        self.layers = nn.ModuleList(_EncoderLayer(cfg.vit_dim, cfg.vit_heads) for _ in range(cfg.vit_layers))
        self.norm = nn.LayerNorm(cfg.vit_dim)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` in [-1, 1] -> ``(B, h, w, vit_dim)``."""
        f = self.embed(x_BCHW)
        b, d, h, w = f.shape
        x = f.flatten(2).transpose(1, 2) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.norm(x).view(b, h, w, d)


class PatchMerger(nn.Module):
    """Attention-based fusion of K CNN and K ViT patch tokens into one backbone embedding."""

    def __init__(self, cfg: VisionConfig, d_model: int) -> None:
        super().__init__()
        self.cnn_norm = nn.LayerNorm(cfg.cnn_channels)
        self.cnn_proj = nn.Linear(cfg.cnn_channels, cfg.vit_dim)
        self.type_emb = nn.Parameter(torch.zeros(2, cfg.vit_dim))  # which path a token came from
        if cfg.merger_positions:  # a token's frame and cell inside its group (the group's order is (t, y, x))
            self.frame_emb = nn.Parameter(torch.zeros(cfg.merge_frames, cfg.vit_dim))
            self.cell_emb = nn.Parameter(torch.zeros(cfg.merge * cfg.merge, cfg.vit_dim))
        self.attn = _EncoderLayer(cfg.vit_dim, cfg.vit_heads)
        self.norm = nn.LayerNorm(cfg.vit_dim)
        self.out = nn.Linear(cfg.vit_dim, d_model)

    def forward(self, cnn_GKC: torch.Tensor, vit_GKD: torch.Tensor) -> torch.Tensor:
        """``G`` groups of ``K`` patches from each path -> ``(G, d_model)``."""
        cnn = self.cnn_proj(self.cnn_norm(cnn_GKC))
        if hasattr(self, "frame_emb"):
            cells = self.cell_emb.shape[0]
            frames = cnn.shape[1] // cells
            pos = (self.frame_emb[:frames, None] + self.cell_emb[None]).reshape(frames * cells, -1)
            cnn, vit_GKD = cnn + pos, vit_GKD + pos
        tokens = torch.cat([cnn + self.type_emb[0], vit_GKD + self.type_emb[1]], dim=1)
        return self.out(self.norm(self.attn(tokens).mean(dim=1)))


def _group(x_NThwC: torch.Tensor, merge: int, merge_frames: int) -> torch.Tensor:
    """Group adjacent patches: ``(N, T, h, w, C)`` -> ``(N * groups, K, C)`` in layout order."""
    n, t, h, w, c = x_NThwC.shape
    tf = merge_frames if t > 1 else 1
    if t % tf:
        pad = tf - t % tf  # repeat the last frame so the clip splits into whole groups
        x_NThwC = torch.cat([x_NThwC, x_NThwC[:, -1:].expand(n, pad, h, w, c)], dim=1)
        t += pad
    x = x_NThwC.view(n, t // tf, tf, h // merge, merge, w // merge, merge, c)
    x = x.permute(0, 1, 3, 5, 2, 4, 6, 7)  # (N, tg, hg, wg, tf, m, m, C)
    return x.reshape(n * (t // tf) * (h // merge) * (w // merge), tf * merge * merge, c)


class VisionModule(nn.Module):
    """The backbone's vision-specific input embeddings and output head."""

    def __init__(self, cfg: VisionConfig, d_model: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.vit = ViT(cfg)
        self.merger = PatchMerger(cfg, d_model)
        self.gen_in = nn.Linear(cfg.latent_bits, d_model)
        self.scale_emb = nn.Embedding(len(cfg.scales), d_model)
        self.cell_emb = nn.Embedding(cfg.tokens_per_frame, d_model)  # VAR-style absolute position per cell
        self.start_emb = nn.Parameter(torch.zeros(d_model))
        self.head = nn.Linear(d_model, cfg.latent_bits)

    def understanding_embeds(self, pixels_NCTHW: torch.Tensor, cnn_NCThw: torch.Tensor) -> torch.Tensor:
        """Merged dual-path embeddings of ``N`` clips (images: T = 1), in ``und_layout`` order."""
        n, _, t, hh, ww = pixels_NCTHW.shape
        frames = pixels_NCTHW.permute(0, 2, 1, 3, 4).reshape(n * t, 3, hh, ww)
        vit = self.vit(frames.to(self.gen_in.weight.dtype))
        vit = vit.view(n, t, *vit.shape[1:])
        cnn = cnn_NCThw.permute(0, 2, 3, 4, 1).to(vit.dtype)  # (N, T, h, w, C)
        g_cnn = _group(cnn, self.cfg.merge, self.cfg.merge_frames)
        g_vit = _group(vit, self.cfg.merge, self.cfg.merge_frames)
        return self.merger(g_cnn, g_vit)

    def generation_embeds(
        self, inputs_PD: torch.Tensor, scale_P: torch.Tensor, start_P: torch.Tensor, cell_P: torch.Tensor
    ) -> torch.Tensor:
        """Embeddings of NFSP positions: projected scale inputs + scale and cell embeddings (+ start)."""
        x = (
            self.gen_in(inputs_PD.to(self.gen_in.weight.dtype))
            + self.scale_emb(scale_P)
            + self.cell_emb(cell_P)
        )
        return torch.where(start_P[:, None], x + self.start_emb, x)

    def embed(self, x_BTD: torch.Tensor, vision: VisionInputs) -> torch.Tensor:
        """``x`` with the merged understanding embeddings and the NFSP generation inputs placed
        where their masks say."""
        if vision.und_items:
            und_MD = torch.cat(
                [self.understanding_embeds(u.pixels_CTHW[None], u.cnn_CThw[None]) for u in vision.und_items]
            )
            x_BTD = x_BTD.masked_scatter(vision.und_mask_BT[..., None], und_MD.to(x_BTD.dtype))
        if vision.gen is not None:
            g = vision.gen
            gen_PD = self.generation_embeds(g.inputs_PD, g.scale_P, g.start_P, g.cell_P)
            x_BTD = x_BTD.masked_scatter(vision.gen_mask_BT[..., None], gen_PD.to(x_BTD.dtype))
        return x_BTD

    def loss(self, bit_logits_PD: torch.Tensor, gen: VisionGen) -> torch.Tensor:
        """Weighted bitwise BCE of the NFSP positions: each position's mean over its bits, weighted
        by ``gen.weights_P`` (coarse scales up-weighted; default 1)."""
        bce_PD = F.binary_cross_entropy_with_logits(bit_logits_PD, gen.targets_PD.float(), reduction="none")
        w_P = gen.weights_P if gen.weights_P is not None else torch.ones_like(bce_PD[:, 0])
        return (bce_PD.mean(dim=-1) * w_P).sum() / w_P.sum().clamp_min(1e-6)
