"""The unified sequence format: documents made of modality segments, packed into (B, T) batches.

A :class:`Segment` is a run of positions of one modality with either token ids or continuous
input embeddings, its Uni-RoPE positions (t, h, w), attention block ids, and a loss mask and
weight. A document is a list of segments; :func:`pack` lays documents into fixed-length rows with
per-token document ids (attention never crosses documents) and next-token targets.

The modality id of each position travels with the batch for *loss accounting only* (per-modality
loss logging and weighting); it never reaches the router.

Conventions:
  * Text and audio: ``t = h = w = running index`` inside the document; each token its own block.
  * Vision (later): ``t = frame`` and centre-aligned ``(h, w)``; one block per scale of a frame.
  * Positions and block ids of a segment are *relative*; :func:`pack` offsets them by the
    document's running counters (``next position = max(t, h, w) + 1`` after a segment).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ernie5.model.model import IGNORE
from ernie5.tokenizers.special import PAD

MODALITIES = ("text", "image", "video", "audio")
MODALITY_ID = {m: i for i, m in enumerate(MODALITIES)}


@dataclass
class Segment:
    """A run of positions of one modality."""

    modality: str
    token_ids: torch.Tensor | None = None
    """``(n,)`` int64 text ids (or ``(n, Q)`` codes for audio, later)."""
    embeds: torch.Tensor | None = None
    """``(n, D)`` continuous inputs (e.g. merged vision features); no loss on these positions."""
    positions: torch.Tensor | None = None
    """``(3, n)`` relative (t, h, w); default ``t = h = w = 0..n-1``."""
    block_ids: torch.Tensor | None = None
    """``(n,)`` relative block ids; default ``0..n-1`` (causal)."""
    loss_mask: torch.Tensor | None = None
    """``(n,)`` bool: whether each position is a prediction *target*; default True for ids."""
    loss_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise ValueError(f"segment modality {self.modality!r} is not one of {MODALITIES}")
        if (self.token_ids is None) == (self.embeds is None):
            raise ValueError("a segment has exactly one of token_ids or embeds")

    def __len__(self) -> int:
        src = self.token_ids if self.token_ids is not None else self.embeds
        return int(src.shape[0])


def text_segment(ids: list[int] | torch.Tensor, loss: bool = True, weight: float = 1.0) -> Segment:
    """A text segment; ``loss=False`` makes its tokens context only (e.g. a prompt)."""
    t = torch.as_tensor(ids, dtype=torch.long)
    return Segment("text", token_ids=t, loss_mask=torch.full((len(t),), loss), loss_weight=weight)


@dataclass
class Batch:
    """A packed batch in the model's input format (all tensors ``(B, T)`` unless noted)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    """``(3, B, T)``."""
    doc_ids: torch.Tensor
    block_ids: torch.Tensor
    modality: torch.Tensor
    """int8 modality id per position (loss accounting only)."""
    targets: torch.Tensor
    """Next-token target per position, ``IGNORE`` where none."""
    loss_weights: torch.Tensor
    embeds: torch.Tensor | None = None
    """``(M, D)`` continuous inputs, in row-major order of ``embed_mask``."""
    embed_mask: torch.Tensor | None = None

    def model_inputs(self) -> dict:
        """Keyword arguments of ``Ernie5Model.forward``."""
        return {
            "input_ids_BT": self.input_ids,
            "positions_3BT": self.positions,
            "doc_ids_BT": self.doc_ids,
            "block_ids_BT": self.block_ids,
            "input_embeds_MD": self.embeds,
            "embed_mask_BT": self.embed_mask,
            "targets_BT": self.targets,
            "loss_weights_BT": self.loss_weights,
        }

    def to(self, device: torch.device | str) -> Batch:
        """Move every tensor to ``device``."""
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return Batch(**kw)


def _flatten(doc: list[Segment]) -> dict[str, torch.Tensor]:
    """Concatenate a document's segments with absolute positions and block ids."""
    ids, pos, blk, mod, lmask, lw, emb, emask = [], [], [], [], [], [], [], []
    next_pos, next_blk = 0, 0
    for seg in doc:
        n = len(seg)
        p = seg.positions if seg.positions is not None else torch.arange(n).expand(3, n)
        b = seg.block_ids if seg.block_ids is not None else torch.arange(n)
        pos.append(p + next_pos)
        blk.append(b + next_blk)
        next_pos += int(p.max()) + 1 if n else 0
        next_blk += int(b.max()) + 1 if n else 0
        if seg.token_ids is not None:
            ids.append(seg.token_ids)
            emask.append(torch.zeros(n, dtype=torch.bool))
        else:
            ids.append(torch.full((n,), PAD, dtype=torch.long))
            emask.append(torch.ones(n, dtype=torch.bool))
            emb.append(seg.embeds)
        mod.append(torch.full((n,), MODALITY_ID[seg.modality], dtype=torch.int8))
        default = seg.token_ids is not None
        lmask.append(seg.loss_mask if seg.loss_mask is not None else torch.full((n,), default))
        lw.append(torch.full((n,), float(seg.loss_weight)))
    return {
        "ids": torch.cat(ids),
        "pos": torch.cat(pos, dim=1),
        "blk": torch.cat(blk),
        "mod": torch.cat(mod),
        "lmask": torch.cat(lmask),
        "lw": torch.cat(lw),
        "emask": torch.cat(emask),
        "emb": torch.cat(emb) if emb else None,
    }


def pack(docs: list[list[Segment]], seq_len: int, n_rows: int | None = None) -> Batch:
    """Pack documents into rows of ``seq_len`` (first fit in order; overlong documents are cut).

    Targets: position ``i`` predicts the token at ``i + 1`` when both are in the same document,
    the next position is a text token and its loss mask is set.
    """
    rows: list[list[dict]] = [[]]
    used = 0
    for doc in docs:
        flat = _flatten(doc)
        n = len(flat["ids"])
        if n == 0:
            continue
        if n > seq_len:
            flat = {k: (v[..., :seq_len] if v is not None and k != "emb" else v) for k, v in flat.items()}
            if flat["emb"] is not None:
                flat["emb"] = flat["emb"][: int(flat["emask"].sum())]
            n = seq_len
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(flat)
        used += n
    if n_rows is not None:
        if len(rows) > n_rows:
            raise ValueError(f"{len(docs)} documents need {len(rows)} rows of {seq_len}, more than {n_rows}")
        rows += [[] for _ in range(n_rows - len(rows))]
    b = len(rows)
    out = {
        "ids": torch.full((b, seq_len), PAD, dtype=torch.long),
        "pos": torch.zeros(3, b, seq_len, dtype=torch.long),
        "doc": torch.full((b, seq_len), -1, dtype=torch.long),
        "blk": torch.zeros(b, seq_len, dtype=torch.long),
        "mod": torch.zeros(b, seq_len, dtype=torch.int8),
        "tgt": torch.full((b, seq_len), IGNORE, dtype=torch.long),
        "lw": torch.zeros(b, seq_len),
        "emask": torch.zeros(b, seq_len, dtype=torch.bool),
    }
    embeds = []
    for r, row in enumerate(rows):
        at = 0
        for d, flat in enumerate(row):
            n = len(flat["ids"])
            sl = slice(at, at + n)
            out["ids"][r, sl] = flat["ids"]
            out["pos"][:, r, sl] = flat["pos"]
            out["doc"][r, sl] = d
            out["blk"][r, sl] = flat["blk"]
            out["mod"][r, sl] = flat["mod"]
            out["emask"][r, sl] = flat["emask"]
            is_target = flat["lmask"][1:] & ~flat["emask"][1:]
            tgt = torch.where(is_target, flat["ids"][1:], torch.full_like(flat["ids"][1:], IGNORE))
            out["tgt"][r, at : at + n - 1] = tgt
            out["lw"][r, at : at + n - 1] = flat["lw"][1:]
            if flat["emb"] is not None:
                embeds.append(flat["emb"])
            at += n
        if at < seq_len:  # padding: its own document, one block per position, no loss
            out["blk"][r, at:] = torch.arange(at, seq_len)
    has_emb = bool(out["emask"].any())
    return Batch(
        input_ids=out["ids"],
        positions=out["pos"],
        doc_ids=out["doc"],
        block_ids=out["blk"],
        modality=out["mod"],
        targets=out["tgt"],
        loss_weights=out["lw"],
        embeds=torch.cat(embeds) if has_emb else None,
        embed_mask=out["emask"] if has_emb else None,
    )
