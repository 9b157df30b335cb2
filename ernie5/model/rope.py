"""Uni-RoPE: rotary position embedding over three position axes (t, h, w) per token.

Each token carries a position triple. The head's rotary frequency pairs are split into three
contiguous sections; section ``t`` rotates by the temporal position, ``h`` and ``w`` by the spatial
ones. Text and audio tokens use ``t = h = w = index``, for which Uni-RoPE equals plain 1-D RoPE
exactly (every pair then sees the same position). Visual tokens use ``t = frame`` and
centre-aligned ``(h, w)`` grids (added with the vision issue).

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.2.3 (Uni-RoPE), §3.2 (base 1e6).
  * Qwen2-VL M-RoPE (arXiv 2409.12191) and ERNIE-4.5-VL 3D RoPE (transformers
    ``ernie4_5_vl_moe``), whose (h, w, t) = (22, 22, 20) split of 64 pairs is our default ratio.

Deviations:
  1. The report does not give the frequency split between axes; we use the ERNIE-4.5-VL ratio
     (configurable through ``model.rope_sections``), with the ``t`` section first.
"""

from __future__ import annotations

import torch


def inv_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Rotary inverse frequencies ``theta^(-2i/head_dim)``, shape ``(head_dim/2,)``, fp32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    return (1.0 / theta**exponent).float()


def text_positions(batch: int, seq_len: int, start: int = 0, device=None) -> torch.Tensor:
    """Positions of a text-only batch: ``t = h = w = start + index``; shape ``(3, B, T)``, int64."""
    idx = torch.arange(start, start + seq_len, device=device)
    return idx.view(1, 1, -1).expand(3, batch, seq_len)


def rope_cos_sin(
    pos_3BT: torch.Tensor, inv_freq: torch.Tensor, sections: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables for a batch of position triples.

    Args:
        pos_3BT: int positions, axis 0 = (t, h, w).
        inv_freq: ``(P,)`` with ``P = head_dim/2 = sum(sections)``.
        sections: pairs per axis, in (t, h, w) order.

    Returns:
        ``(cos_BTP, sin_BTP)`` in fp32.
    """
    # An expanded (B, T) tensor (stride 0 over the axes: text positions, a decoding step's) has
    # equal axes without comparing them.
    if pos_3BT.stride(0) == 0 or ((pos_3BT[0] == pos_3BT[1]).all() and (pos_3BT[0] == pos_3BT[2]).all()):
        angles_BTP = pos_3BT[0].float()[..., None] * inv_freq
    else:
        axis_P = torch.repeat_interleave(
            torch.arange(3, device=inv_freq.device), torch.tensor(sections, device=inv_freq.device)
        )
        pos_BTP = pos_3BT.permute(1, 2, 0).float()[..., axis_P]
        angles_BTP = pos_BTP * inv_freq
    return angles_BTP.cos(), angles_BTP.sin()


def apply_rope(x_BHTD: torch.Tensor, cos_BTP: torch.Tensor, sin_BTP: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (half-split pair layout) by the given tables, in ``x``'s dtype.

    The tables are computed in fp32 and rounded to ``x``'s dtype once (as Hugging Face does); the
    rotation then runs without fp32 copies of the activations.
    """
    x1, x2 = x_BHTD.chunk(2, dim=-1)
    cos = cos_BTP[:, None].to(x_BHTD.dtype)
    sin = sin_BTP[:, None].to(x_BHTD.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
