"""A prompt context (text and media parts) as one document of segments, as every consumer lays it out.

A context is a string, or a sequence whose items are strings or media parts: any object with
``modality`` (``"image"``, ``"video"`` or ``"audio"``), ``data`` (a numpy array: image ``(H, W[, C])``
uint8, clip ``(T, H, W[, C])``, waveform ``(samples,)`` float32) and ``meta`` (e.g. ``{"sample_rate":
8000}``). The evaluation harness (``evals.api.MediaPart``) and the RL rollout engine
(``train.rl.rollout_text``) both build their prompts here, so a model is asked the same way wherever it is
asked.

Layout: ``BOS``, then each part in order: text as its ids, an image or clip as ``BOI|BOV <understanding
positions> EOI|EOV``, audio as ``BOA <codec frames> EOA``. Every text position is context (its loss mask
is irrelevant: the document is a prompt).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ernie5.sequence import audio as audio_docs
from ernie5.sequence.segments import Segment, text_segment
from ernie5.sequence.vision import encode_media, media_markers, to_pixels, understanding_segment
from ernie5.tokenizers.special import BOA, BOS, EOA


class ContextError(ValueError):
    """A context part the given media models cannot read (one-line message)."""


def media_segments(part: Any, *, vision_tokenizer=None, vision_cfg=None, audio_codec=None) -> list[Segment]:
    """The segments of one media part (markers included)."""
    if part.modality == "audio":
        if audio_codec is None:
            raise ContextError("cannot read audio inputs (no audio codec or audio module)")
        rate = part.meta.get("sample_rate", audio_codec.sample_rate)
        if rate != audio_codec.sample_rate:
            raise ContextError(
                f"audio at {rate} Hz; this checkpoint's codec reads {audio_codec.sample_rate} Hz"
            )
        wave = [np.asarray(part.data, dtype=np.float32)]
        (codes,) = audio_docs.encode_waves(audio_codec, wave)
        encoder = getattr(audio_codec, "content_encoder", None)
        feats = audio_docs.content_features(encoder, audio_codec, wave)[0] if encoder is not None else None
        return [text_segment([BOA]), audio_docs.understanding_segment(codes, feats), text_segment([EOA])]
    if part.modality not in ("image", "video"):
        raise ContextError(f"cannot read {part.modality} inputs")
    if vision_tokenizer is None or vision_cfg is None:
        raise ContextError(f"cannot read {part.modality} inputs (no vision tokenizer or vision module)")
    clip = part.modality == "video"
    pixels = to_pixels(np.asarray(part.data), clip)
    enc = encode_media(vision_tokenizer, pixels, codes=False)
    begin, end = media_markers(pixels.shape[2] if clip else 1)
    und = understanding_segment(vision_cfg, enc.pixels[0], enc.cnn[0])
    return [text_segment([begin]), und, text_segment([end])]


def media_segments_many(
    parts: list[Any], *, vision_tokenizer=None, vision_cfg=None, audio_codec=None, batch_size: int = 64
) -> list[list[Segment]]:
    """The segments of each of ``parts``, as :func:`media_segments` gives them, with the images and
    clips of one shape encoded ``batch_size`` at a time: the vision tokenizer's convolutions run far
    faster over a batch than one item at a time (the harness reads hundreds of images per call).
    Audio is encoded one utterance at a time, as :func:`media_segments` does (a batch pads the
    shorter waves, and the codec's last frames would see the padding)."""
    out: list[list[Segment] | None] = [None] * len(parts)
    by_shape: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    for i, part in enumerate(parts):
        if part.modality not in ("image", "video") or vision_tokenizer is None or vision_cfg is None:
            out[i] = media_segments(
                part, vision_tokenizer=vision_tokenizer, vision_cfg=vision_cfg, audio_codec=audio_codec
            )
            continue
        pixels = to_pixels(np.asarray(part.data), part.modality == "video")
        by_shape.setdefault((part.modality, *pixels.shape), []).append((i, pixels))
    for (modality, *_), items in by_shape.items():
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            enc = encode_media(vision_tokenizer, torch.cat([px for _, px in chunk]), codes=False)
            begin, end = media_markers(enc.pixels.shape[2] if modality == "video" else 1)
            for k, (i, _) in enumerate(chunk):
                und = understanding_segment(vision_cfg, enc.pixels[k], enc.cnn[k])
                out[i] = [text_segment([begin]), und, text_segment([end])]
    return out  # type: ignore[return-value]


def context_document(
    context: Any, tokenizer, *, vision_tokenizer=None, vision_cfg=None, audio_codec=None
) -> list[Segment]:
    """``BOS`` then the context's text and media parts as the segments of one document."""
    segs = [text_segment([BOS])]
    for p in (context,) if isinstance(context, str) else context:
        if isinstance(p, str):
            if p:
                segs.append(text_segment(tokenizer.encode(p)))
        else:
            segs += media_segments(
                p, vision_tokenizer=vision_tokenizer, vision_cfg=vision_cfg, audio_codec=audio_codec
            )
    return segs
