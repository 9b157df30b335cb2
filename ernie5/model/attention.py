"""Grouped-query attention with QK-norm, Uni-RoPE and a KV cache.

One forward: project ``x`` to queries, keys and values in one matrix product; RMS-normalise each
query and key head (QK-norm); rotate them by the Uni-RoPE tables; append keys and values to the
cache; attend under the (document, block) mask; project back. ``project`` and ``attend`` are the
two steps a fast path may replace (:mod:`ernie5.fast.attention`); what is written here is their
reference.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.2.3 (Uni-RoPE, unified multimodal attention).
  * GQA (arXiv 2305.13245), as ERNIE 4.5 uses; QK-norm as in Qwen3.

Deviations:
  1. The report does not disclose the attention type; we use GQA as ERNIE 4.5 does.
  2. QK-norm (per head, before RoPE, ``model.qk_norm``) is our choice for training stability; the
     report does not mention it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ernie5.model.config import ModelConfig
from ernie5.model.kv_cache import KVCache
from ernie5.model.mask import AttnMask
from ernie5.model.rope import apply_rope


@dataclass
class LayerContext:
    """What every layer of one forward shares: rotary tables, the mask and the KV cache."""

    cos_BTP: torch.Tensor
    sin_BTP: torch.Tensor
    mask: AttnMask
    cache: KVCache | None


def flex_attention(
    q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, block_mask: object
) -> torch.Tensor:
    """``flex_attention`` under a block mask (eager: it materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    with warnings.catch_warnings():  # eager flex warns that it is not compiled
        warnings.simplefilter("ignore")
        return flex(q_BHTD, k_BKSD, v_BKSD, block_mask=block_mask, enable_gqa=True)


class Attention(nn.Module):
    """Multi-head attention with ``n_kv_heads`` shared key/value heads."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.dim_head
        self.wqkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.dim_head, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.dim_head, cfg.d_model, bias=False)
        self.q_norm = nn.RMSNorm(cfg.dim_head, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.dim_head, eps=cfg.norm_eps) if cfg.qk_norm else None

    def project(
        self, qkv_BTND: torch.Tensor, cos_BTP: torch.Tensor, sin_BTP: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed ``(B, T, H + 2K, Dh)`` projections -> ``q (B, H, T, Dh)``, ``k, v (B, K, T, Dh)``,
        with q and k RMS-normalised per head and rotated."""
        h, k = self.n_heads, self.n_kv_heads
        q_BTHD, k_BTKD, v_BTKD = qkv_BTND.split([h, k, k], dim=2)
        if self.q_norm is not None:
            q_BTHD, k_BTKD = self.q_norm(q_BTHD), self.k_norm(k_BTKD)
        q_BHTD = apply_rope(q_BTHD.transpose(1, 2), cos_BTP, sin_BTP)
        k_BKTD = apply_rope(k_BTKD.transpose(1, 2), cos_BTP, sin_BTP)
        return q_BHTD, k_BKTD, v_BTKD.transpose(1, 2)

    def attend(
        self, q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask: AttnMask
    ) -> torch.Tensor:
        """Softmax attention of every query over the keys the mask allows, ``(B, H, T, Dh)``."""
        if mask.block_mask is not None:
            return flex_attention(q_BHTD, k_BKSD, v_BKSD, mask.block_mask)
        return F.scaled_dot_product_attention(
            q_BHTD, k_BKSD, v_BKSD, attn_mask=mask.dense_B1TS, is_causal=mask.is_causal, enable_gqa=True
        )

    def forward(self, x_BTD: torch.Tensor, ctx: LayerContext, layer: int = 0) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        qkv_BTND = self.wqkv(x_BTD).view(b, t, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q_BHTD, k_BKSD, v_BKSD = self.project(qkv_BTND, ctx.cos_BTP, ctx.sin_BTP)
        if ctx.cache is not None:
            k_BKSD, v_BKSD = ctx.cache.update(layer, k_BKSD, v_BKSD)
        o_BHTD = self.attend(q_BHTD, k_BKSD, v_BKSD, ctx.mask)
        return self.wo(o_BHTD.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
