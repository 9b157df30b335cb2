"""Multi-token prediction: DeepSeek-V3's sequential MTP modules on the shared embedding and head.

Depth ``k`` (1-based) at position ``i`` combines the previous depth's hidden state ``h_i`` with the
embedding of the token ``t_{i+k}``, ``h'_i = W [RMSNorm(h_i); RMSNorm(Emb(t_{i+k}))]``, runs one
transformer block and predicts ``t_{i+k+1}`` through the shared text head. The training loss is
``lambda / D * sum_k L_k`` (the trainer applies ``lambda``). At decoding time depth 1 drafts the
token after next for self-speculative decoding (``ernie5.generation.text``).

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.1 (MTP), §3.2 (MTP loss weight 0.3 -> 0.1).
  * DeepSeek-V3 (arXiv 2412.19437) §2.2 (MTP modules) and §5.4.3 (MTP for speculative decoding).

Deviations:
  1. The MTP block uses a dense SwiGLU FFN (width ``d_ff``) rather than an MoE block, so the draft
     path does not depend on elastic width; DeepSeek-V3's MTP block is an MoE block.
  2. The report does not disclose the MTP depth; D = 1 by default, as in DeepSeek-V3.
"""

from __future__ import annotations

import torch
from torch import nn

from ernie5.model.attention import LayerContext
from ernie5.model.block import Block
from ernie5.model.config import ModelConfig
from ernie5.model.inputs import IGNORE


def shift_targets(targets_BT: torch.Tensor, next_ids_BT: torch.Tensor) -> torch.Tensor:
    """The targets of the next MTP depth: position ``i`` predicts what ``i + 1`` predicted, and
    only where the token it is fed (``next_ids``) is a real target too."""
    shifted_BT = torch.full_like(targets_BT, IGNORE)
    shifted_BT[:, :-1] = targets_BT[:, 1:]
    return shifted_BT.masked_fill(next_ids_BT == IGNORE, IGNORE)


class MTPModule(nn.Module):
    """One MTP depth: combine ``h_i`` with ``Emb(t_{i+k})``, one dense block; the caller applies
    ``norm_out`` and the shared head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_h = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.norm_e = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = Block(cfg, is_moe=False)
        self.norm_out = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(
        self, h_BTD: torch.Tensor, emb_BTD: torch.Tensor, ctx: LayerContext, layer: int = 0
    ) -> torch.Tensor:
        x_BTD = self.proj(torch.cat([self.norm_h(h_BTD), self.norm_e(emb_BTD)], dim=-1))
        x_BTD, _ = self.block(x_BTD, ctx, layer)
        return x_BTD
