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
        (codes,) = audio_docs.encode_waves(audio_codec, [np.asarray(part.data, dtype=np.float32)])
        return [text_segment([BOA]), audio_docs.understanding_segment(codes), text_segment([EOA])]
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
