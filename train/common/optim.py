"""The optimizer every trainer uses: one AdamW config and one parameter-group rule.

Weight decay applies to the parameters with at least ``min_ndim`` dimensions whose names contain none
of ``no_decay``; the rest (norms, biases, and whatever the caller names) are not decayed. The rule's
arguments are what the trainers differ in: the backbone decays matrices but not its routers
(:data:`BACKBONE_DECAY`), the audio codec and the refiner decay conv and linear weights
(``min_ndim=2``), the vision tokenizer only its conv kernels (``min_ndim=4``, so its code radii stay
undecayed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ernie5.config import check


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """AdamW."""

    lr: float = 3e-3
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (norms, router and biases are not decayed)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    fused: bool = True
    """Fused AdamW kernel (about 8x faster than the default for-loop on CPU)."""

    def __post_init__(self) -> None:
        check(self.lr > 0, f"lr={self.lr} must be > 0")
        check(all(0 <= b < 1 for b in self.betas), f"betas={list(self.betas)} must be in [0, 1)")
        check(self.eps > 0, f"eps={self.eps} must be > 0")
        check(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0")
        check(self.grad_clip >= 0, f"grad_clip={self.grad_clip} must be >= 0")


BACKBONE_DECAY: dict[str, Any] = {"min_ndim": 2, "no_decay": ("router",)}
"""The backbone's rule: matrices decayed, the routers, norms and biases not."""


def decayed(name: str, p: torch.Tensor, *, min_ndim: int, no_decay: tuple[str, ...] = ()) -> bool:
    """Whether parameter ``name`` gets weight decay (the module docstring's rule)."""
    return p.dim() >= min_ndim and not any(s in name for s in no_decay)


def param_groups(
    module: nn.Module, weight_decay: float, *, min_ndim: int, no_decay: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Two AdamW groups of ``module``'s parameters, in their order: decayed (``weight_decay``), then the
    rest (0)."""
    decay, rest = [], []
    for name, p in module.named_parameters():
        (decay if decayed(name, p, min_ndim=min_ndim, no_decay=no_decay) else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def make_adamw(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``groups`` with ``cfg``'s learning rate, betas, epsilon and kernel choice."""
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=cfg.fused)


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """The backbone's AdamW (pretraining, SFT, RL): its parameters grouped by :data:`BACKBONE_DECAY`."""
    return make_adamw(param_groups(model, cfg.weight_decay, **BACKBONE_DECAY), cfg)
