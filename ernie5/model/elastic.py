"""Elastic sub-models as the forward runs them: which layers run, which routed experts are available,
and top-k.

A :class:`Subnet` is a concrete sub-model of one model (kept layer indices, kept experts per MoE
layer, top-k) that ``Ernie5Model.forward`` takes as an argument. The model is never mutated;
``Subnet.full`` runs exactly the plain forward. What a user writes (a ``SubnetSpec`` such as
``d0.75-w0.5-k2``) and its resolution into a :class:`Subnet` live in :mod:`ernie5.subnets.spec`.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §3.3 (elastic depth, width, sparsity), §6.4.2.
  * Once-for-All (arXiv 1908.09791).

Deviations:
  1. Hidden-size elasticity is not supported (the report does not use it either).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ernie5.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Subnet:
    """A concrete sub-model of one model: what ``Ernie5Model.forward`` runs."""

    layers: tuple[int, ...]
    """Kept layer indices, ascending."""
    experts: tuple[tuple[int, ...] | None, ...]
    """Per layer: the routed experts available, or None for all of them."""
    top_k: int
    """Active routed experts per token."""
    name: str = "full"
    """Compact spec this came from, or a description of a sampled subnet."""
    _masks: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @staticmethod
    def full(cfg: ModelConfig) -> Subnet:
        """The whole model."""
        return Subnet(tuple(range(cfg.n_layers)), (None,) * cfg.n_layers, cfg.moe.top_k, "full")

    def is_full_for(self, cfg: ModelConfig) -> bool:
        """True when this subnet is the whole of ``cfg``'s model."""
        return (
            self.layers == tuple(range(cfg.n_layers))
            and all(e is None for e in self.experts)
            and self.top_k == cfg.moe.top_k
        )

    def expert_mask(self, layer: int, n_experts: int, device: torch.device) -> torch.Tensor | None:
        """Boolean availability mask of ``layer``'s routed experts (None = all available)."""
        kept = self.experts[layer]
        if kept is None:
            return None
        key = (layer, str(device))
        if key not in self._masks:
            mask = torch.zeros(n_experts, dtype=torch.bool, device=device)
            mask[list(kept)] = True
            self._masks[key] = mask
        return self._masks[key]

    def n_experts_kept(self, layer: int, n_experts: int) -> int:
        """Routed experts available at ``layer``."""
        kept = self.experts[layer]
        return n_experts if kept is None else len(kept)
