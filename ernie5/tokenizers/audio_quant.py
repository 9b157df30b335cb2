"""Residual vector quantisation with EMA codebooks (SoundStream / EnCodec / Mimi style).

Shapes: B batch, D latent dims, N frames, Q levels, K codes per level, M = B*N vectors.

For a latent ``z`` and ``r_1 = z``, level l = 1..Q picks the nearest code (Euclidean)
``c_l = argmin_k ||r_l - e_{l,k}||``, adds ``q_l = e_{l,c_l}`` to the reconstruction and passes the
residual ``r_{l+1} = r_l - q_l`` on: each level explains what the levels before it missed, so decoding
the first ``n`` levels is a coarser reconstruction (the error falls with every level on a fitted
quantiser). A frame's tokens are its Q codes ``codes_BNQ``.

Training (``module.training``):

* **k-means init**: on the first training batch each codebook (level by level, on that level's
  residuals) is set by a few Lloyd iterations of k-means started from random batch vectors.
* **EMA codebooks**: the codebooks get no gradient. Per level, with the batch counts ``n_k`` and sums
  ``s_k`` of the vectors assigned to code k: ``usage_k <- d usage_k + (1-d) n_k``,
  ``sum_k <- d sum_k + (1-d) s_k``, ``e_k = sum_k / laplace(usage)_k`` with the Laplace-smoothed sizes
  ``laplace(u)_k = (u_k + eps) / (sum(u) + K eps) * sum(u)``.
* **Dead-code restart**: after the update, every code with ``usage_k < threshold * sum(usage) / K``
  (below ``threshold`` of the uniform share) is replaced by a random vector of the current batch's
  residuals and its usage is reset to the uniform share.
* **Quantiser dropout**: each batch element uses ``n_q ~ U{1..Q}`` levels with probability
  ``quantizer_dropout`` (else all Q); the output of an element is the sum of its first ``n_q`` levels.
* **Straight-through estimator**: the output is ``z + sg(q - z)`` (value ``q``, gradient to ``z`` the
  identity); the commitment loss ``mean_l ||r_l - sg(q_l)||^2`` over the levels each element uses pulls
  the encoder towards the codebooks.

References:
  * SoundStream, Zeghidour et al. 2021, arXiv 2107.03312: RVQ, EMA codebooks, k-means init, dead-code
    restart, quantiser dropout (bitrate scalability).
  * EnCodec, Défossez et al. 2022, arXiv 2210.13438 (``encodec/quantization/core_vq.py``): Laplace-smoothed
    EMA, per-level commitment loss on the residual.
  * Mimi / Moshi, arXiv 2410.00037 (``moshi/quantization/core_vq.py``): EMA decay 0.99, eps 1e-5, dead codes
    below 0.1 of the uniform share replaced by batch vectors with usage reset to the uniform share.
  * ERNIE 5.0, arXiv 2602.04705 section 2.3.1: RVQ audio tokens, level 1 semantic.

Deviations:
  1. Quantiser dropout is drawn per batch element (as SoundStream describes), not once per batch as in
     EnCodec / Mimi. Every element's residuals still update the EMA of every level: a level's residual
     does not depend on whether that element's output stops before it, so the codebook statistics are the
     same, only better estimated.
  2. One straight-through estimator on the summed output instead of one per level (EnCodec's per-level
     form scales the encoder's gradient by the number of levels used).
  3. Dead codes are checked on every training step (Mimi: every 5), and statistics are not all-reduced
     across data-parallel ranks (the codec trains in one process).
  4. No split semantic / acoustic RVQ (Mimi): level 1 is the first residual level, as in SpeechTokenizer
     and ERNIE 5.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ernie5.tokenizers.audio_config import AudioCodecConfig


def _sample_rows(x_MD: Tensor, n: int, generator: torch.Generator | None = None) -> Tensor:
    """``n`` random rows of ``x`` (without replacement when there are enough, else with)."""
    M = x_MD.shape[0]
    if n <= M:
        idx = torch.randperm(M, generator=generator, device="cpu")[:n]
    else:
        idx = torch.randint(0, M, (n,), generator=generator, device="cpu")
    return x_MD[idx.to(x_MD.device)]


def nearest(x_MD: Tensor, codebook_KD: Tensor) -> Tensor:
    """Index ``(M,)`` of the nearest (squared Euclidean) row of ``codebook`` for every row of ``x``."""
    dist_MK = (
        x_MD.square().sum(1, keepdim=True) - 2 * x_MD @ codebook_KD.t() + codebook_KD.square().sum(1)[None, :]
    )
    return dist_MK.argmin(dim=1)


def kmeans(
    x_MD: Tensor, k: int, iters: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Lloyd's k-means from ``k`` random rows of ``x``: ``(centroids (k, D), counts (k,))``.

    An empty cluster keeps its previous centroid. Deterministic given ``generator`` (or the global seed).
    """
    x_MD = x_MD.detach().float()
    centroids = _sample_rows(x_MD, k, generator).clone()
    counts = torch.zeros(k, device=x_MD.device)
    for _ in range(max(iters, 1)):
        assign = nearest(x_MD, centroids)
        counts = torch.bincount(assign, minlength=k).to(x_MD.dtype)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x_MD)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None]
    return centroids, counts


def code_usage(codes_BNQ: Tensor, codebook_size: int) -> dict[str, list[float]]:
    """Per-level statistics of a batch of codes.

    Returns ``perplexity`` (``exp`` of the entropy of the code histogram: K when all codes are equally
    used, 1 when one code is) and ``used_fraction`` (share of the K codes used at least once).
    """
    flat_MQ = codes_BNQ.reshape(-1, codes_BNQ.shape[-1])
    perplexity, used = [], []
    for level in range(flat_MQ.shape[1]):
        counts = torch.bincount(flat_MQ[:, level], minlength=codebook_size).double()
        p = counts / counts.sum().clamp_min(1)
        entropy = -(p[p > 0] * p[p > 0].log()).sum()
        perplexity.append(float(entropy.exp()))
        used.append(float((counts > 0).double().mean()))
    return {"perplexity": perplexity, "used_fraction": used}


# ---------------------------------------------------------------------- one level
class EMACodebook(nn.Module):
    """One level's codebook, learned by exponential moving averages (no gradient).

    Buffers (all saved): ``embedding (K, D)`` the code vectors, ``embedding_sum (K, D)`` and
    ``cluster_usage (K,)`` the EMA statistics, ``initialized`` whether k-means init has run.
    """

    embedding: Tensor
    embedding_sum: Tensor
    cluster_usage: Tensor
    initialized: Tensor

    def __init__(
        self,
        dim: int,
        codebook_size: int,
        decay: float = 0.99,
        eps: float = 1e-5,
        dead_code_threshold: float = 0.1,
        kmeans_iters: int = 10,
    ) -> None:
        super().__init__()
        self.dim, self.codebook_size = dim, codebook_size
        self.decay, self.eps = decay, eps
        self.dead_code_threshold, self.kmeans_iters = dead_code_threshold, kmeans_iters
        embedding = torch.randn(codebook_size, dim) / math.sqrt(dim)
        self.register_buffer("embedding", embedding)
        self.register_buffer("embedding_sum", embedding.clone())
        self.register_buffer("cluster_usage", torch.ones(codebook_size))
        self.register_buffer("initialized", torch.tensor(False))

    def quantize(self, x_MD: Tensor) -> Tensor:
        """Nearest code index ``(M,)`` of every vector."""
        return nearest(x_MD, self.embedding.to(x_MD.dtype))

    def lookup(self, codes_M: Tensor) -> Tensor:
        """Code vectors ``(M, D)`` of code indices ``(M,)``."""
        return F.embedding(codes_M, self.embedding)

    @torch.no_grad()
    def init_kmeans(self, x_MD: Tensor) -> None:
        """Set the codebook to k-means centroids of ``x`` (usage = cluster sizes); marks it initialised."""
        if self.kmeans_iters > 0:
            centroids, counts = kmeans(x_MD, self.codebook_size, self.kmeans_iters)
            self.embedding.copy_(centroids)
            self.cluster_usage.copy_(counts)
            self.embedding_sum.copy_(centroids * counts[:, None])
        self.initialized.fill_(True)

    @torch.no_grad()
    def update(self, x_MD: Tensor, codes_M: Tensor) -> int:
        """One EMA step from the vectors ``x`` assigned to ``codes``, then the dead-code restart.

        Returns the number of codes restarted.
        """
        x_MD = x_MD.detach().to(self.embedding.dtype)
        K, d = self.codebook_size, self.decay
        counts_K = torch.bincount(codes_M, minlength=K).to(x_MD.dtype)
        sums_KD = torch.zeros_like(self.embedding_sum).index_add_(0, codes_M, x_MD)
        self.cluster_usage.mul_(d).add_(counts_K, alpha=1 - d)
        self.embedding_sum.mul_(d).add_(sums_KD, alpha=1 - d)
        self._refresh()
        return self.restart_dead_codes(x_MD)

    @torch.no_grad()
    def restart_dead_codes(self, x_MD: Tensor) -> int:
        """Replace every code used less than ``threshold`` of the uniform share by a random row of ``x``;
        its usage is reset to the uniform share. Returns how many were replaced."""
        if self.dead_code_threshold <= 0:
            return 0
        share = self.cluster_usage.sum() / self.codebook_size
        dead_K = self.cluster_usage < self.dead_code_threshold * share
        n_dead = int(dead_K.sum())
        if n_dead == 0:
            return 0
        new_KD = _sample_rows(x_MD.detach().to(self.embedding.dtype), self.codebook_size)
        self.embedding_sum.copy_(torch.where(dead_K[:, None], new_KD * share, self.embedding_sum))
        self.cluster_usage.copy_(torch.where(dead_K, share, self.cluster_usage))
        self._refresh()
        return n_dead

    def _refresh(self) -> None:
        """``embedding = embedding_sum / laplace(cluster_usage)``."""
        u, K = self.cluster_usage, self.codebook_size
        total = u.sum()
        smoothed = (u + self.eps) / (total + K * self.eps) * total
        self.embedding.copy_(self.embedding_sum / smoothed.clamp_min(self.eps)[:, None])

    def perplexity(self) -> float:
        """Perplexity of the EMA usage distribution (K = uniform, 1 = a single code)."""
        p = self.cluster_usage / self.cluster_usage.sum().clamp_min(self.eps)
        p = p[p > 0]
        return float((-(p * p.log()).sum()).exp())


# ---------------------------------------------------------------------- residual stack
@dataclass(frozen=True, slots=True)
class RVQOutput:
    """The result of quantising a latent with :class:`ResidualVQ`."""

    quantized_BDN: Tensor
    """Sum of each element's used levels, straight-through to ``z`` (value = the quantised latent)."""
    codes_BNQ: Tensor
    """long ``(B, N, n_levels)``: the code of every level (all computed, also those dropout skips)."""
    commit_loss: Tensor
    """Scalar ``mean ||r_l - sg(q_l)||^2`` over used (element, level) pairs; 0 without gradient."""
    level1_BDN: Tensor
    """Level 1's code vectors, straight-through to ``z`` (the semantic distillation input)."""
    n_q_B: Tensor
    """long ``(B,)``: levels each element's output uses (``n_levels`` unless quantiser dropout)."""
    restarted: list[int] = field(default_factory=list)
    """Per level: codes restarted by this call (training only)."""


class ResidualVQ(nn.Module):
    """Q EMA codebooks applied to successive residuals (see the module docstring)."""

    def __init__(self, cfg: AudioCodecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_levels, self.codebook_size, self.dim = cfg.n_levels, cfg.codebook_size, cfg.latent_dim
        self.levels = nn.ModuleList(
            EMACodebook(
                cfg.latent_dim,
                cfg.codebook_size,
                decay=cfg.ema_decay,
                eps=cfg.eps,
                dead_code_threshold=cfg.dead_code_threshold,
                kmeans_iters=cfg.kmeans_iters,
            )
            for _ in range(cfg.n_levels)
        )

    def _check_levels(self, n_levels: int | None) -> int:
        n = self.n_levels if n_levels is None else int(n_levels)
        if not 1 <= n <= self.n_levels:
            raise ValueError(f"n_levels={n} must be in [1, {self.n_levels}]")
        return n

    def _check_latent(self, z_BDN: Tensor) -> None:
        if z_BDN.ndim != 3 or z_BDN.shape[1] != self.dim:
            raise ValueError(f"latent must be (B, {self.dim}, N), got {tuple(z_BDN.shape)}")

    def forward(self, z_BDN: Tensor, n_levels: int | None = None) -> RVQOutput:
        """Quantise ``z (B, D, N)`` with the first ``n_levels`` levels (None = all).

        In training mode this also initialises (first call), updates the EMA codebooks, restarts dead
        codes and applies quantiser dropout; in eval mode it is a pure function of ``z``.
        """
        self._check_latent(z_BDN)
        n = self._check_levels(n_levels)
        B, D, N = z_BDN.shape
        training = self.training
        x_MD = z_BDN.transpose(1, 2).reshape(B * N, D)
        if training and self.cfg.quantizer_dropout > 0 and n > 1:
            drop_B = torch.rand(B) < self.cfg.quantizer_dropout
            n_q_B = torch.where(drop_B, torch.randint(1, n + 1, (B,)), n)
        else:
            n_q_B = torch.full((B,), n, dtype=torch.long)
        n_q_B = n_q_B.to(z_BDN.device)
        n_q_M = n_q_B.repeat_interleave(N)

        residual = x_MD.detach()
        out_MD = torch.zeros_like(residual)
        codes, restarted = [], []
        commit = z_BDN.new_zeros(())
        n_used = 0
        needs_grad = z_BDN.requires_grad
        level1_MD = None
        for level, book in enumerate(self.levels[:n]):
            if training and not bool(book.initialized):
                book.init_kmeans(residual)
            codes_M = book.quantize(residual)
            q_MD = book.lookup(codes_M).to(residual.dtype)
            used_M = (n_q_M > level).to(residual.dtype)
            if needs_grad:
                # r_l = z - sum_{j<l} sg(q_j): its gradient to z is the identity
                r_MD = x_MD - (x_MD.detach() - residual)
                se_M = (r_MD - q_MD).square().mean(dim=1)
                commit = commit + (se_M * used_M).sum()
                n_used += int(used_M.sum())
            if level == 0:
                level1_MD = q_MD
            if training:
                restarted.append(book.update(residual, codes_M))
            out_MD = out_MD + q_MD * used_M[:, None]
            residual = residual - q_MD
            codes.append(codes_M)
        if needs_grad and n_used:
            commit = commit / n_used
        quant_MD = x_MD + (out_MD - x_MD).detach()
        level1_MD = x_MD + (level1_MD - x_MD).detach()
        return RVQOutput(
            quantized_BDN=quant_MD.reshape(B, N, D).transpose(1, 2),
            codes_BNQ=torch.stack(codes, dim=1).reshape(B, N, n),
            commit_loss=commit,
            level1_BDN=level1_MD.reshape(B, N, D).transpose(1, 2),
            n_q_B=n_q_B,
            restarted=restarted,
        )

    @torch.no_grad()
    def encode(self, z_BDN: Tensor, n_levels: int | None = None) -> Tensor:
        """Codes ``(B, N, n_levels)`` (long) of ``z (B, D, N)``; never updates the codebooks."""
        self._check_latent(z_BDN)
        n = self._check_levels(n_levels)
        B, D, N = z_BDN.shape
        residual = z_BDN.transpose(1, 2).reshape(B * N, D)
        codes = []
        for book in self.levels[:n]:
            codes_M = book.quantize(residual)
            residual = residual - book.lookup(codes_M).to(residual.dtype)
            codes.append(codes_M)
        return torch.stack(codes, dim=1).reshape(B, N, n)

    def decode(self, codes_BNQ: Tensor, n_levels: int | None = None) -> Tensor:
        """Quantised latent ``(B, D, N)``: the sum of the code vectors of the first ``n_levels`` levels
        (None = all levels present in ``codes``)."""
        if codes_BNQ.ndim != 3 or not 1 <= codes_BNQ.shape[2] <= self.n_levels:
            raise ValueError(f"codes must be (B, N, Q<={self.n_levels}), got {tuple(codes_BNQ.shape)}")
        n = codes_BNQ.shape[2] if n_levels is None else int(n_levels)
        if not 1 <= n <= codes_BNQ.shape[2]:
            raise ValueError(f"n_levels={n} must be in [1, {codes_BNQ.shape[2]}] (levels in codes)")
        if codes_BNQ.dtype != torch.long:
            raise ValueError(f"codes must be long, got {codes_BNQ.dtype}")
        if codes_BNQ.numel() and (int(codes_BNQ.min()) < 0 or int(codes_BNQ.max()) >= self.codebook_size):
            raise ValueError(f"codes must be in [0, {self.codebook_size}), got values outside")
        B, N, _ = codes_BNQ.shape
        z_BND = sum(self.levels[q].lookup(codes_BNQ[:, :, q]) for q in range(n))
        return z_BND.transpose(1, 2)

    def perplexity(self) -> list[float]:
        """Per level: perplexity of the EMA code usage."""
        return [book.perplexity() for book in self.levels]
