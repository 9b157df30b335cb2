"""The unified sequence format: documents made of modality segments, packed into (B, T) batches.

A :class:`Segment` is a run of positions of one modality with either token ids or continuous
input embeddings, its Uni-RoPE positions (t, h, w), attention block ids, and a loss mask and
weight. A document is a list of segments; :func:`pack` lays documents into fixed-length rows with
per-token document ids (attention never crosses documents) and next-token targets.

The modality id of each position travels with the batch for *loss accounting only* (per-modality
loss logging and weighting); it never reaches the router.

Conventions:
  * Text and audio: ``t = h = w = running index`` inside the document; each token its own block.
  * Vision: ``t = frame`` and centre-aligned ``(h, w)``; one block per scale of a frame.
  * Audio: one position per codec frame (all RVQ levels summed into it), causal like text; a
    generated audio segment starts with one conditioning position (speaker or generic start) and
    carries Next-Codec-Prediction targets: every position predicts all levels of the next frame,
    the last frame predicts END.
  * Positions and block ids of a segment are *relative*; :func:`pack` offsets them by the
    document's running counters (``next position = max(t, h, w) + 1`` after a segment).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ernie5.model.audio import END_TARGET
from ernie5.model.inputs import IGNORE, AudioInputs, Inputs, Targets, VisionGen, VisionInputs, VisionUnd
from ernie5.tokenizers.special import PAD

MODALITIES = ("text", "image", "video", "audio")
MODALITY_ID = {m: i for i, m in enumerate(MODALITIES)}


@dataclass
class AudioSeg:
    """Codec frames of one audio segment (embedded by the model as the sum of level embeddings)."""

    codes_NQ: torch.Tensor
    """``(n, Q)`` int64 codec codes of the segment's frames (``n`` may be 0 for a bare start)."""
    start: bool = False
    """Prepend one conditioning position (speaker embedding or generic start) that predicts frame 1."""
    speaker: int = -1
    """Speaker id of the start position (``-1`` = the generic start)."""
    targets: bool = False
    """Carry NCP targets: each position predicts the next frame; the last frame predicts END."""
    end: bool = True
    """With ``targets``: the last frame's target is END (False: no target after the last frame)."""
    feats_NF: torch.Tensor | None = None
    """``(n, F)`` speech-content features of the frames (understanding segments of a model with
    ``audio.content_dim = F``); None = none."""

    def __len__(self) -> int:
        return int(self.codes_NQ.shape[0]) + int(self.start)


@dataclass
class Segment:
    """A run of positions of one modality: one of ``token_ids``, ``embeds``, ``und``, ``gen`` or ``audio``."""

    modality: str
    token_ids: torch.Tensor | None = None
    """``(n,)`` int64 text ids (or ``(n, Q)`` codes for audio, later)."""
    embeds: torch.Tensor | None = None
    """``(n, D)`` precomputed continuous inputs; no loss on these positions."""
    und: VisionUnd | None = None
    """Vision understanding inputs; the model turns them into ``n`` merged embeddings."""
    gen: VisionGen | None = None
    """Vision generation positions (inputs and bit targets)."""
    audio: AudioSeg | None = None
    """Audio codec frames (understanding input and/or NCP generation targets)."""
    n_positions: int = 0
    """Length of an ``und`` segment (the merger's group count)."""
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
        given = [x is not None for x in (self.token_ids, self.embeds, self.und, self.gen, self.audio)]
        if sum(given) != 1:
            raise ValueError("a segment has exactly one of token_ids, embeds, und, gen or audio")
        if self.und is not None and self.n_positions < 1:
            raise ValueError("an understanding segment needs n_positions >= 1")

    @property
    def kind(self) -> str:
        """``ids`` | ``embeds`` | ``und`` | ``gen`` | ``audio``."""
        if self.token_ids is not None:
            return "ids"
        if self.audio is not None:
            return "audio"
        return "embeds" if self.embeds is not None else ("und" if self.und is not None else "gen")

    def __len__(self) -> int:
        if self.token_ids is not None:
            return int(self.token_ids.shape[0])
        if self.embeds is not None:
            return int(self.embeds.shape[0])
        if self.gen is not None:
            return int(self.gen.inputs_PD.shape[0])
        if self.audio is not None:
            return len(self.audio)
        return self.n_positions


def text_segment(ids: list[int] | torch.Tensor, loss: bool = True, weight: float = 1.0) -> Segment:
    """A text segment; ``loss=False`` makes its tokens context only (e.g. a prompt)."""
    t = torch.as_tensor(ids, dtype=torch.long)
    return Segment("text", token_ids=t, loss_mask=torch.full((len(t),), loss), loss_weight=weight)


@dataclass
class Batch:
    """A packed batch: the model's inputs and text targets, and each position's modality."""

    inputs: Inputs
    targets: Targets
    """Next-token target per position (``IGNORE`` where none) and its loss weight."""
    modality: torch.Tensor
    """``(B, T)`` int8 modality id per position (loss accounting only; never reaches routing)."""

    def to(self, device: torch.device | str) -> Batch:
        """Move every tensor to ``device``."""
        return Batch(self.inputs.to(device), self.targets.to(device), self.modality.to(device))


_KIND = {"ids": 0, "embeds": 1, "und": 2, "gen": 3, "audio": 4}


def _flatten(doc: list[Segment]) -> dict:
    """Concatenate a document's segments with absolute positions and block ids."""
    ids, pos, blk, mod, lmask, lw, kind = [], [], [], [], [], [], []
    emb, und, gen = [], [], []
    a_codes, a_start, a_spk, a_tgt, a_feat = [], [], [], [], []
    next_pos, next_blk = 0, 0
    for seg in doc:
        n = len(seg)
        p = seg.positions if seg.positions is not None else torch.arange(n).expand(3, n)
        b = seg.block_ids if seg.block_ids is not None else torch.arange(n)
        pos.append(p + next_pos)
        blk.append(b + next_blk)
        next_pos += int(p.max()) + 1 if n else 0
        next_blk += int(b.max()) + 1 if n else 0
        k = seg.kind
        ids.append(seg.token_ids if k == "ids" else torch.full((n,), PAD, dtype=torch.long))
        kind.append(torch.full((n,), _KIND[k], dtype=torch.int8))
        if k == "embeds":
            emb.append(seg.embeds)
        elif k == "und":
            und.append(seg.und)
        elif k == "gen":
            gen.append(seg.gen)
        elif k == "audio":
            c, st, spk, tg = _audio_rows(seg.audio)
            a_codes.append(c)
            a_start.append(st)
            a_spk.append(spk)
            a_tgt.append(tg)
            a_feat.append(_audio_feats(seg.audio))
        mod.append(torch.full((n,), MODALITY_ID[seg.modality], dtype=torch.int8))
        lmask.append(seg.loss_mask if seg.loss_mask is not None else torch.full((n,), k == "ids"))
        lw.append(torch.full((n,), float(seg.loss_weight)))
    return {
        "ids": torch.cat(ids),
        "pos": torch.cat(pos, dim=1),
        "blk": torch.cat(blk),
        "mod": torch.cat(mod),
        "lmask": torch.cat(lmask),
        "lw": torch.cat(lw),
        "kind": torch.cat(kind),
        "emb": emb,
        "und": und,
        "gen": gen,
        "a_codes": a_codes,
        "a_start": a_start,
        "a_spk": a_spk,
        "a_tgt": a_tgt,
        "a_feat": a_feat,
    }


def _audio_feats(a: AudioSeg) -> torch.Tensor | None:
    """Per position of an audio segment: its frame's content features (zeros at the start), or None."""
    if a.feats_NF is None:
        return None
    n, f = a.feats_NF.shape
    if n != a.codes_NQ.shape[0]:
        raise ValueError(f"audio segment has {a.codes_NQ.shape[0]} frames and {n} feature rows")
    return torch.cat([torch.zeros(int(a.start), f), a.feats_NF.float()])


def _audio_rows(a: AudioSeg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position of an audio segment: input codes (-1 at the start), start flag, speaker, targets."""
    codes = a.codes_NQ.long()
    n, q = codes.shape
    s = int(a.start)
    inp = torch.full((n + s, q), -1, dtype=torch.long)
    inp[s:] = codes
    is_start = torch.zeros(n + s, dtype=torch.bool)
    is_start[:s] = True
    spk = torch.full((n + s,), -1, dtype=torch.long)
    spk[:s] = a.speaker
    tgt = torch.full((n + s, q), IGNORE, dtype=torch.long)
    if a.targets:
        # position j predicts frame j+1 of the segment: with a start, row j <- frame j.
        tgt[: n + s - 1] = codes[1 - s :] if n else tgt[:0]
        if a.end:
            tgt[n + s - 1, 0] = END_TARGET  # resolved to the model's end code by its audio head
    return inp, is_start, spk, tgt


def _cat_gen(items: list[VisionGen]) -> VisionGen:
    def cat(name: str):
        parts = [getattr(g, name) for g in items]
        return None if any(p is None for p in parts) else torch.cat(parts)

    gen = VisionGen(cat("inputs_PD"), cat("scale_P"), cat("start_P"), cat("targets_PD"), None, cat("cell_P"))
    if gen.targets_PD is not None:
        gen.weights_P = torch.cat(
            [g.weights_P if g.weights_P is not None else torch.ones(len(g.scale_P)) for g in items]
        )
    return gen


def pack(
    docs: list[list[Segment]], seq_len: int, n_rows: int | None = None, one_per_row: bool = False
) -> Batch:
    """Pack documents into rows of ``seq_len`` (first fit in order; ``one_per_row``: row i = doc i).

    Text documents longer than ``seq_len`` are cut; a document with vision positions must fit whole.
    Targets: position ``i`` predicts the token at ``i + 1`` when both are in the same document, the
    next position is a text token and its loss mask is set. Vision generation positions carry bit
    targets instead (``Batch.vision.gen``).
    """
    rows: list[list[dict]] = [[]]
    used = 0
    for doc in docs:
        flat = _flatten(doc)
        n = len(flat["ids"])
        if n == 0:
            continue
        if n > seq_len:
            if bool((flat["kind"] != 0).any()):
                raise ValueError(
                    f"a document with {n} positions (vision included) does not fit seq_len={seq_len}"
                )
            flat = {k: (v[..., :seq_len] if isinstance(v, torch.Tensor) else v) for k, v in flat.items()}
            n = seq_len
        if used + n > seq_len or (one_per_row and rows[-1]):
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
        "kind": torch.zeros(b, seq_len, dtype=torch.int8),
    }
    emb, und, gen = [], [], []
    a_codes, a_start, a_spk, a_tgt, a_feat = [], [], [], [], []
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
            out["kind"][r, sl] = flat["kind"]
            is_target = flat["lmask"][1:] & (flat["kind"][1:] == 0)
            tgt = torch.where(is_target, flat["ids"][1:], torch.full_like(flat["ids"][1:], IGNORE))
            out["tgt"][r, at : at + n - 1] = tgt
            out["lw"][r, at : at + n - 1] = flat["lw"][1:]
            emb += flat["emb"]
            und += flat["und"]
            gen += flat["gen"]
            a_codes += flat["a_codes"]
            a_start += flat["a_start"]
            a_spk += flat["a_spk"]
            a_tgt += flat["a_tgt"]
            a_feat += flat["a_feat"]
            at += n
        if at < seq_len:  # padding: its own document, one block per position, no loss
            out["blk"][r, at:] = torch.arange(at, seq_len)
    kind = out["kind"]
    vision = None
    if und or gen:
        vision = VisionInputs(
            und_items=und,
            und_mask_BT=(kind == _KIND["und"]) if und else None,
            gen=_cat_gen(gen) if gen else None,
            gen_mask_BT=(kind == _KIND["gen"]) if gen else None,
        )
    audio = None
    if a_codes:
        codes, starts, spk, tgt = (torch.cat(x) for x in (a_codes, a_start, a_spk, a_tgt))
        is_audio = kind == _KIND["audio"]
        frame_mask = is_audio.clone()
        frame_mask[is_audio] = ~starts
        start_mask = is_audio.clone()
        start_mask[is_audio] = starts
        has_tgt = (tgt != IGNORE).any(dim=1)
        pred_mask = is_audio.clone()
        pred_mask[is_audio] = has_tgt
        feats = None
        widths = {f.shape[1] for f in a_feat if f is not None}
        if len(widths) > 1:
            raise ValueError(f"audio segments with content features of widths {sorted(widths)} in one batch")
        if widths and bool((~starts).any()):
            (width,) = widths
            rows_ = [f if f is not None else torch.zeros(len(c), width) for f, c in zip(a_feat, a_codes)]
            feats = torch.cat(rows_)[~starts]
        audio = AudioInputs(
            frame_codes_MQ=codes[~starts] if bool((~starts).any()) else None,
            frame_mask_BT=frame_mask if bool((~starts).any()) else None,
            start_speaker_S=spk[starts] if bool(starts.any()) else None,
            start_mask_BT=start_mask if bool(starts.any()) else None,
            targets_PQ=tgt[has_tgt] if bool(has_tgt.any()) else None,
            pred_mask_BT=pred_mask if bool(has_tgt.any()) else None,
            frame_feats_MF=feats,
        )
    inputs = Inputs(
        ids_BT=out["ids"],
        positions_3BT=out["pos"],
        doc_ids_BT=out["doc"],
        block_ids_BT=out["blk"],
        embeds_MD=torch.cat(emb) if emb else None,
        embed_mask_BT=(kind == _KIND["embeds"]) if emb else None,
        vision=vision,
        audio=audio,
    )
    return Batch(inputs, Targets(out["tgt"], out["lw"]), out["mod"])
