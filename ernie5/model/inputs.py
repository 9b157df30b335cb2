"""What the backbone reads: one packed sequence with its optional media parts, and its targets.

:class:`Inputs` is a ``(B, T)`` batch of positions. Every position has a text id; positions whose
input is continuous (precomputed embeddings, merged image features, NFSP generation inputs,
summed codec frames) are marked by a mask and their vectors are listed in row-major order of that
mask. :class:`Targets` are the next-token targets of the text head; the vision and audio parts
carry their own targets (bits of NFSP positions, codes of NCP positions), because teacher forcing
feeds them back into the forward.

``ernie5.sequence.segments.pack`` builds these from documents; a bare ``(B, T)`` tensor of ids is
shorthand for ``Inputs(ids_BT)``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

IGNORE = -100
"""Target value of positions without a loss."""


def _moved(obj, device: torch.device | str):
    """A copy of the dataclass ``obj`` with every tensor (and nested ``.to``-able part) on ``device``."""
    values = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if v is not None and hasattr(v, "to"):
            v = v.to(device)
        elif isinstance(v, list):
            v = [x.to(device) for x in v]
        values[f.name] = v
    return type(obj)(**values)


@dataclass
class VisionUnd:
    """Inputs of one image or clip for the understanding path (embedded by the model)."""

    pixels_CTHW: torch.Tensor
    """Frames in [-1, 1]."""
    cnn_CThw: torch.Tensor
    """The tokenizer encoder's pre-quantisation features."""

    def to(self, device: torch.device | str) -> VisionUnd:
        """Move every tensor to ``device``."""
        return _moved(self, device)


@dataclass
class VisionGen:
    """NFSP generation positions of one or more images or clips (embedded by the model)."""

    inputs_PD: torch.Tensor
    """Per position: the VAR input (downsampled sum of coarser scales); zeros at start positions."""
    scale_P: torch.Tensor
    start_P: torch.Tensor
    """Positions that get the learned start embedding (first scale of the first frame)."""
    targets_PD: torch.Tensor | None = None
    """Bits to predict at each position, in {0, 1} (None at inference)."""
    weights_P: torch.Tensor | None = None
    """Per-position bit-loss weights (coarse scales up-weighted)."""
    cell_P: torch.Tensor | None = None
    """Index of each position's cell within its frame (0 .. tokens_per_frame-1)."""

    def to(self, device: torch.device | str) -> VisionGen:
        """Move every tensor to ``device``."""
        return _moved(self, device)


@dataclass
class VisionInputs:
    """The vision parts of a packed batch, in row-major order of their masks."""

    und_items: list[VisionUnd]
    und_mask_BT: torch.Tensor | None
    gen: VisionGen | None
    gen_mask_BT: torch.Tensor | None

    def to(self, device: torch.device | str) -> VisionInputs:
        """Move every tensor to ``device``."""
        return _moved(self, device)


@dataclass
class AudioInputs:
    """The audio parts of a packed batch, in row-major order of their masks."""

    frame_codes_MQ: torch.Tensor | None
    """Codes of every input frame position."""
    frame_mask_BT: torch.Tensor | None
    start_speaker_S: torch.Tensor | None
    """Speaker id (or -1) of every start position."""
    start_mask_BT: torch.Tensor | None
    targets_PQ: torch.Tensor | None = None
    """NCP targets of every prediction position (``IGNORE`` where none); None at inference."""
    pred_mask_BT: torch.Tensor | None = None
    """Positions whose NCP heads run (with targets in training; sampled at inference)."""
    frame_feats_MF: torch.Tensor | None = None
    """Speech-content features of every input frame, in the order of ``frame_codes_MQ`` (zeros for
    frames without them: generated ones); None when no frame has any."""

    def to(self, device: torch.device | str) -> AudioInputs:
        """Move every tensor to ``device``."""
        return _moved(self, device)


@dataclass
class Inputs:
    """One packed batch of positions (all tensors ``(B, T)`` unless noted)."""

    ids_BT: torch.Tensor
    """Text token ids (any value where a continuous input replaces the embedding)."""
    positions_3BT: torch.Tensor | None = None
    """Uni-RoPE ``(t, h, w)`` positions; default ``t = h = w = cache offset + index``."""
    doc_ids_BT: torch.Tensor | None = None
    """Document id per position (attention never crosses documents); default one per row."""
    block_ids_BT: torch.Tensor | None = None
    """Attention block id per position; default the position index (causal)."""
    embeds_MD: torch.Tensor | None = None
    """Precomputed continuous input embeddings, in row-major order of ``embed_mask_BT``."""
    embed_mask_BT: torch.Tensor | None = None
    vision: VisionInputs | None = None
    """Image/clip understanding inputs and NFSP generation positions."""
    audio: AudioInputs | None = None
    """Codec frames, start positions and NCP prediction positions."""

    def to(self, device: torch.device | str) -> Inputs:
        """Move every tensor to ``device``."""
        return _moved(self, device)


@dataclass
class Targets:
    """Next-token targets of the text head."""

    ids_BT: torch.Tensor
    """Target id per position, ``IGNORE`` where the position has no loss."""
    weights_BT: torch.Tensor | None = None
    """Per-position loss weights (default 1), e.g. per-modality weighting."""

    def to(self, device: torch.device | str) -> Targets:
        """Move every tensor to ``device``."""
        return _moved(self, device)
