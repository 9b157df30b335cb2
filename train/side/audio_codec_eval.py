"""Held-out evaluation of a trained audio codec (:mod:`train.side.audio_codec`): quality per number of
decoded levels, code usage, DTMF round-trip exactness, semantic accuracy and encode/decode speed."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ernie5.data.root import DataMissing
from ernie5.tokenizers.audio_codec import AudioCodec, mel_distance, snr_db
from ernie5.tokenizers.audio_quant import code_usage
from ernie5.tokenizers.audio_teacher import KMeansTeacher, SemanticTeacher

_DTMF_WORDS = {"star": "*", "pound": "#"} | {
    w: str(d)
    for d, w in enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"))
}


def dtmf_keys(text: str) -> str:
    """The keys of a DTMF utterance's normalised transcript (``"four pound"`` -> ``"4#"``)."""
    return "".join(_DTMF_WORDS[w] for w in text.split())


@torch.no_grad()
def evaluate_codec(
    codec: AudioCodec,
    waves: list[np.ndarray],
    keys: list[str] | None = None,
    teacher: SemanticTeacher | None = None,
    batch_size: int = 32,
) -> dict[str, Any]:
    """Held-out quality of a codec on whole utterances, decoding 1..Q levels.

    Returns ``levels[str(n)] = {snr_db, mel_distance}`` (means over utterances), ``usage`` (per-level
    perplexity and used fraction of the codes of all utterances), with ``keys`` (DTMF) also
    ``levels[n]["dtmf_exact"]`` (share whose decoded audio :func:`goertzel_decode` s to ``keys``) and
    ``dtmf_reference_exact`` (the same for the original audio), with a k-means teacher
    ``semantic_acc`` (level-1 head accuracy). Batches are zero-padded at the end, which for a causal
    codec leaves every utterance's codes and audio unchanged.
    """
    from ernie5.data.dtmf import goertzel_decode

    was_training = codec.training
    codec.eval()
    sr, Q = codec.sample_rate, codec.n_levels
    snr: dict[int, list[float]] = {n: [] for n in range(1, Q + 1)}
    mel: dict[int, list[float]] = {n: [] for n in range(1, Q + 1)}
    exact: dict[int, list[bool]] = {n: [] for n in range(1, Q + 1)}
    all_codes, sem_hits, sem_total = [], 0.0, 0
    step = batch_size if codec.cfg.causal else 1
    try:
        for i in range(0, len(waves), step):
            chunk = waves[i : i + step]
            lengths = [len(w) for w in chunk]
            x = torch.zeros(len(chunk), max(lengths))
            for j, w in enumerate(chunk):
                x[j, : len(w)] = torch.from_numpy(np.asarray(w, dtype=np.float32))
            codes = codec.encode(x)
            for j, n_frames in enumerate(codec.n_frames(n) for n in lengths):
                all_codes.append(codes[j, :n_frames])
            if isinstance(teacher, KMeansTeacher) and codec.semantic_head is not None:
                z_q = codec.codes_to_latent(codes[..., :1])
                targets = codec.teacher_targets(teacher, x)
                ids = teacher.assign(targets)
                hits = codec.semantic(z_q).argmax(-1) == ids
                for j, n in enumerate(lengths):
                    f = codec.n_frames(n)
                    sem_hits += float(hits[j, :f].sum())
                    sem_total += f
            for n in range(1, Q + 1):
                rec = codec.decode(codes, n_levels=n)
                for j, length in enumerate(lengths):
                    ref, est = x[j, :length], rec[j, :length]
                    snr[n].append(snr_db(ref, est))
                    mel[n].append(mel_distance(ref, est, sr))
                    if keys is not None:
                        exact[n].append(goertzel_decode(est.numpy(), sr) == keys[i + j])
    finally:
        codec.train(was_training)
    levels: dict[str, Any] = {}
    for n in range(1, Q + 1):
        finite = [s for s in snr[n] if math.isfinite(s)]
        entry = {
            "snr_db": round(float(np.mean(finite)), 3) if finite else None,
            "mel_distance": round(float(np.mean(mel[n])), 4),
        }
        if keys is not None:
            entry["dtmf_exact"] = round(float(np.mean(exact[n])), 4)
        levels[str(n)] = entry
    usage = code_usage(torch.cat(all_codes)[None], codec.codebook_size)
    result: dict[str, Any] = {
        "n_utterances": len(waves),
        "duration_s": round(sum(len(w) for w in waves) / sr, 2),
        "levels": levels,
        "usage": {k: [round(v, 3) for v in vals] for k, vals in usage.items()},
    }
    if keys is not None:
        result["dtmf_reference_exact"] = round(
            float(np.mean([goertzel_decode(np.asarray(w), sr) == k for w, k in zip(waves, keys)])), 4
        )
    if sem_total:
        result["semantic_acc"] = round(sem_hits / sem_total, 4)
    return result


@torch.no_grad()
def codec_speed(codec: AudioCodec, seconds: float = 1.0, reps: int = 20) -> dict[str, float]:
    """Median wall times (ms) of encoding and decoding ``seconds`` of random audio (batch 1, eval mode, the
    current torch thread count) and the derived rates."""
    x = torch.randn(1, round(seconds * codec.sample_rate)) * 0.1
    was_training = codec.training
    codec.eval()
    try:
        codes = codec.encode(x)
        codec.decode(codes)
        enc, dec = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            codes = codec.encode(x)
            t1 = time.perf_counter()
            codec.decode(codes)
            enc.append((t1 - t0) * 1000)
            dec.append((time.perf_counter() - t1) * 1000)
    finally:
        codec.train(was_training)
    enc_ms, dec_ms = float(np.median(enc)), float(np.median(dec))
    return {
        "threads": torch.get_num_threads(),
        "audio_s": seconds,
        "encode_ms": round(enc_ms, 3),
        "decode_ms": round(dec_ms, 3),
        "realtime_factor": round(seconds * 1000 / (enc_ms + dec_ms), 1),
        "encode_codes_per_s": round(codes.numel() / (enc_ms / 1000)),
    }


def heldout_sets(
    root: Path | None, *, eval_dtmf: int, eval_fsdd: int, seed: int
) -> dict[str, tuple[list[np.ndarray], list[str] | None]]:
    """The held-out sets: ``eval_dtmf`` DTMF sequences of seed ``seed + 1_000_003`` (with their keys)
    and, when the data root has it, the FSDD test split (``eval_fsdd`` of it evenly spaced; 0 = all)."""
    from ernie5.data.audio import fsdd_utterances
    from ernie5.data.dtmf import dtmf_sequences

    dtmf = dtmf_sequences(eval_dtmf, 2, 6, seed=seed + 1_000_003)
    sets: dict[str, tuple[list[np.ndarray], list[str] | None]] = {
        "dtmf_heldout": ([u.wave for u in dtmf], [dtmf_keys(u.text) for u in dtmf])
    }
    try:
        test = fsdd_utterances(root, "test")
    except DataMissing:
        return sets
    if eval_fsdd:
        test = test[:: max(1, len(test) // eval_fsdd)][:eval_fsdd]
    sets["fsdd_test"] = ([u.wave for u in test], None)
    return sets
