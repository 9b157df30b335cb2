"""Bias-free linear layer whose decoding calls run the few-row kernel."""

from __future__ import annotations

import torch
from torch import nn

from ernie5.kernels import ops


class Linear(nn.Linear):
    """``nn.Linear(in_features, out_features, bias=False)`` (same parameter, same state dict) whose
    forward is :func:`ernie5.kernels.ops.linear`: up to 4 token rows that need no gradient (a
    decoding step) run the fused kernel, everything else ``F.linear``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return ops.linear(x, self.weight)
