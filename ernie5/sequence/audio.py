"""Audio documents in the unified sequence: waveforms -> codec codes -> audio segments.

Shared by the pretraining stream, the harness adapter and the CLI, so every consumer lays audio out
the same way: ``BOA <frames> EOA`` for recognition/understanding (frames are input only) and
``BOA <start/speaker> <frames> EOA`` with Next-Codec-Prediction targets for synthesis.
"""

from __future__ import annotations

import numpy as np
import torch

from ernie5.sequence.chat import context_segment
from ernie5.sequence.segments import AudioSeg, Segment, text_segment
from ernie5.tokenizers.special import BOA, BOS, EOA, EOS


def _padded_chunk(codec, waves: list[np.ndarray]) -> tuple[list[np.ndarray], torch.Tensor]:
    """The waveforms as float32 arrays, and zero-padded to whole codec frames ``(B, S)`` (at least one)."""
    chunk = [np.asarray(w, dtype=np.float32).reshape(-1) for w in waves]
    longest = max(len(w) for w in chunk)
    wave_BS = torch.zeros(len(chunk), max(codec.hop, -(-longest // codec.hop) * codec.hop))
    for i, w in enumerate(chunk):
        wave_BS[i, : len(w)] = torch.from_numpy(w)
    return chunk, wave_BS


@torch.inference_mode()
def encode_waves(codec, waves: list[np.ndarray], batch_size: int = 64) -> list[torch.Tensor]:
    """Codes ``(n_frames, Q)`` of each waveform (float32 at the codec's rate), batched and zero-padded."""
    out: list[torch.Tensor] = []
    for start in range(0, len(waves), batch_size):
        chunk, wave_BS = _padded_chunk(codec, waves[start : start + batch_size])
        codes_BNQ = codec.encode(wave_BS)
        for i, w in enumerate(chunk):
            out.append(codes_BNQ[i, : max(1, codec.n_frames(len(w)))].long().cpu())
    return out


@torch.inference_mode()
def content_features(encoder, codec, waves: list[np.ndarray], batch_size: int = 64) -> list[torch.Tensor]:
    """Speech-content features ``(n_frames, F)`` of each waveform, on the codec's frame grid (the frames
    :func:`encode_waves` gives it): the frozen encoder's 50 Hz features of the waveform (statistics over
    its own samples only), average-pooled to the codec's frames."""
    from ernie5.tokenizers.audio_teacher import pool_to_frames

    out: list[torch.Tensor] = []
    for start in range(0, len(waves), batch_size):
        chunk, wave_BS = _padded_chunk(codec, waves[start : start + batch_size])
        lengths_B = torch.tensor([max(1, len(w)) for w in chunk])
        feats_BTF = encoder.features(wave_BS, lengths_B).float()
        for i, w in enumerate(chunk):
            n_frames = max(1, codec.n_frames(len(w)))
            # the encoder frames that cover the codec's padded frames: 2 hops of 10 ms per 50 Hz frame
            t = max(1, min(feats_BTF.shape[1], -(-n_frames * codec.hop // (2 * encoder.cfg.hop))))
            out.append(pool_to_frames(feats_BTF[i : i + 1, :t], n_frames)[0].cpu())
    return out


@torch.inference_mode()
def decode_codes(codec, codes: list[torch.Tensor]) -> list[np.ndarray]:
    """Waveforms (float32) of code sequences ``(n_frames, Q)``; empty sequences give empty waves."""
    waves = []
    for c in codes:
        if len(c) == 0:
            waves.append(np.zeros(0, dtype=np.float32))
            continue
        waves.append(codec.decode(c[None].long()).reshape(-1).float().cpu().numpy())
    return waves


def understanding_segment(codes_NQ: torch.Tensor, feats_NF: torch.Tensor | None = None) -> Segment:
    """An input-only audio segment (recognition, understanding), with the frames' content features
    when the model reads them."""
    return Segment("audio", audio=AudioSeg(codes_NQ, feats_NF=feats_NF))


def generation_segment(codes_NQ: torch.Tensor, speaker: int = -1) -> Segment:
    """A synthesis segment: a start (speaker) position, the frames, NCP targets and END."""
    return Segment("audio", audio=AudioSeg(codes_NQ, start=True, speaker=speaker, targets=True))


def audio_document(
    segment: Segment,
    kind: str,
    prompt: list[int],
    answer: list[int],
    *,
    context: list[int] | tuple[int, ...] = (),
) -> list[Segment]:
    """The segments of one audio document: ``BOS <prompt> BOA <segment> EOA EOS`` for synthesis
    (``kind == "gen"``), else ``BOS BOA <segment> EOA`` then ``answer`` with EOS (audio modality).

    ``context``: ids without loss before the scored text (instruction tuning): for understanding
    between EOA and ``answer`` (the ``Transcript:`` or question cue; BOA then carries no loss either),
    for synthesis right after BOS (an untargeted prompt; ``prompt`` then usually empty). Empty (the
    default) adds no segment.
    """
    if kind == "gen":
        if context:
            head = [context_segment("text", [BOS, *context]), text_segment([*prompt, BOA])]
        else:
            head = [text_segment([BOS, *prompt, BOA])]
        return [*head, segment, text_segment([EOA, EOS])]
    answer_seg = Segment("audio", token_ids=torch.tensor([*answer, EOS]))
    if context:  # the whole document before the answer is context, BOA included
        head, cue = context_segment("text", [BOS, BOA]), [context_segment("audio", context)]
    else:
        head, cue = text_segment([BOS, BOA]), []
    return [head, segment, text_segment([EOA], loss=False), *cue, answer_seg]
