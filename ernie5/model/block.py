"""One transformer layer of the backbone: pre-norm attention, then a dense or MoE SwiGLU FFN.

``x = x + Attn(RMSNorm(x))``; ``x = x + FFN(RMSNorm(x))``, where the FFN of an MoE layer also
returns its routing decisions. The elastic sub-model reaches the block as arguments (top-k and the
mask of available experts); skipped layers are simply not called.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.1 (every layer an MoE layer by default).
"""

from __future__ import annotations

import torch
from torch import nn

from ernie5.model.attention import Attention, LayerContext
from ernie5.model.config import ModelConfig
from ernie5.model.moe import MoE, RouterOutput, SwiGLU


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a dense or MoE SwiGLU FFN."""

    def __init__(self, cfg: ModelConfig, is_moe: bool) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn: MoE | SwiGLU = MoE(cfg.d_model, cfg.moe) if is_moe else SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(
        self,
        x_BTD: torch.Tensor,
        ctx: LayerContext,
        layer: int,
        top_k: int | None = None,
        expert_mask_E: torch.Tensor | None = None,
        forced_ids_BTA: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RouterOutput | None]:
        """``(x_BTD, routing)`` after this layer; ``layer`` indexes the KV cache.
        ``forced_ids_BTA`` replays an MoE layer's expert selection (:class:`~ernie5.model.moe.MoE`)."""
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), ctx, layer)
        h_BTD = self.ffn_norm(x_BTD)
        if isinstance(self.ffn, MoE):
            if forced_ids_BTA is None:
                y_BTD, r = self.ffn(h_BTD, top_k, expert_mask_E)
            else:
                y_BTD, r = self.ffn(h_BTD, top_k, expert_mask_E, forced_ids_BTA)
            return x_BTD + y_BTD, r
        if forced_ids_BTA is not None:
            raise ValueError(f"routing replay: layer {layer} is a dense layer (no experts to replay)")
        return x_BTD + self.ffn(h_BTD), None
