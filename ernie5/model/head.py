"""The text output head and its weighted next-token cross-entropy.

``loss = sum_i w_i * CE(h_i W^T, t_i) / max(1, sum_i w_i)`` over positions with a target
(``IGNORE`` positions have weight 0 and NLL 0), with the per-position NLL alongside for
per-modality accounting. The same head, shared, scores the MTP depths.

What is written here computes fp32 logits for the whole batch and calls ``F.cross_entropy``: the
reference of the chunked, fused loss that training runs (:mod:`ernie5.fast.loss`).

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2 (modality-specific output heads), §2.1
    (next-token objective), §3.2 (per-modality loss weighting, which the per-position weights carry).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ernie5.model.inputs import IGNORE, Targets


def row_weights(targets_N: torch.Tensor, weights_N: torch.Tensor | None) -> torch.Tensor:
    """fp32 loss weight of every row: 0 without a target, else its weight (default 1)."""
    valid_N = (targets_N != IGNORE).float()
    return valid_N if weights_N is None else valid_N * weights_N.float()


class TextHead(nn.Linear):
    """``d_model -> vocab_size`` projection (no bias) with the next-token loss of its logits."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__(d_model, vocab_size, bias=False)

    def linear_cross_entropy(
        self, h_ND: torch.Tensor, targets_N: torch.Tensor, weights_N: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weighted mean NLL, fp32 NLL per row)`` of the logits ``h @ W^T``."""
        logits_NV = F.linear(h_ND, self.weight)
        nll_N = F.cross_entropy(logits_NV.float(), targets_N, ignore_index=IGNORE, reduction="none")
        w_N = row_weights(targets_N, weights_N)
        return (nll_N * w_N).sum() / w_N.sum().clamp_min(1.0), nll_N

    def loss(self, h_BTD: torch.Tensor, targets: Targets) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weighted mean NLL, per-position NLL (B, T))`` of normalised hidden states."""
        w_N = None if targets.weights_BT is None else targets.weights_BT.flatten()
        loss, nll_N = self.linear_cross_entropy(h_BTD.flatten(0, 1), targets.ids_BT.flatten(), w_N)
        return loss, nll_N.view_as(targets.ids_BT)
