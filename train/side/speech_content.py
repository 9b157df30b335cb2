"""Training of the speech-content encoder (:mod:`ernie5.tokenizers.speech_content`) with CTC on many voices.

The encoder is the codec's level-1 teacher (``content_kmeans``), so what it learns to ignore, level 1 is
taught to ignore: it is trained to transcribe, in every voice the project can make, and never hears
the held-out FSDD speaker.

Data (8 kHz, whole utterances, each from a source drawn by ``*_weight``; absent sources are dropped
and the weights renormalised):

* ``fsdd``: FSDD train recordings of the seen speakers (single digits);
* ``fsdd_seq``: 2-4 of one seen speaker's train recordings joined (:func:`ernie5.data.audio.sequences_from`);
* ``espeak``: eSpeak NG digit sequences in random voices, variants, pitches and rates
  (:func:`ernie5.data.voices.digit_corpus`, the same cached corpus the backbone's ``espeak`` source reads);
* ``ljspeech``: the LJSpeech sample (read English, one more real voice).

Every utterance goes through :func:`ernie5.data.voices.augment_speech` (speed, room, tilt, noise, gain)
with probability ``augment_p``. Loss: CTC over characters (blank 0), AdamW, linear warmup + cosine decay,
gradient clipping; seeded and deterministic on CPU.

Held-out evaluation (written to ``summary.json``): corpus WER and CER (jiwer) of the greedy transcripts
on FSDD's test split (seen speakers' recordings 0-4) and on every recording of the held-out speaker.

One output folder::

    out_dir/config.yaml     the SpeechContentTrainConfig
    out_dir/meta.json       provenance
    out_dir/metrics.jsonl   one record per log_every steps (loss, lr)
    out_dir/encoder/        the trained encoder (SpeechContentEncoder.save)
    out_dir/summary.json    held-out WER/CER, parameters, sources, steps/s

Deviations:
  1. Digit-domain data (FSDD, eSpeak digits) plus a 32-utterance read-speech sample, not a speech corpus.
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ernie5.config import check, dump
from ernie5.data.root import DataMissing, resolve_data_dir
from ernie5.store.runs import append_jsonl, provenance, write_json
from ernie5.tokenizers.speech_content import SpeechContentConfig, SpeechContentEncoder, encode_text
from train.common.optim import OptimConfig, make_adamw, param_groups
from train.common.schedule import ScheduleConfig, lr_at
from train.side.resume import ResumeConfig, side_run

SOURCES = ("fsdd", "fsdd_seq", "espeak", "ljspeech")


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeechContentTrainConfig:
    """Everything :func:`train_speech_content` needs."""

    encoder: SpeechContentConfig = field(default_factory=SpeechContentConfig)
    steps: int = 4000
    """Optimizer steps (held-out WER of the unseen speaker 0.268 after 1500, 0.234 after 4000; about
    8 minutes on 2 cores)."""
    batch_size: int = 16
    """Utterances per step."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-3, weight_decay=0.01, fused=False))
    schedule: ScheduleConfig = field(
        default_factory=lambda: ScheduleConfig(kind="cosine", warmup_steps=100, min_lr_ratio=0.05)
    )
    fsdd_weight: float = 0.3
    fsdd_seq_weight: float = 0.2
    espeak_weight: float = 0.48
    ljspeech_weight: float = 0.02
    """LJSpeech is a small share: its utterances are 7 s on average, the rest about 1 s."""
    fsdd_seq_pool: int = 600
    """FSDD train sequences made once for ``fsdd_seq``."""
    espeak_utterances: int = 3000
    """Size of the eSpeak NG corpus (the backbone's ``espeak`` source uses 3000, seed 0)."""
    augment_p: float = 0.8
    """Probability that an utterance is passed through ``augment_speech``."""
    log_every: int = 50
    seed: int = 0
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    """Resume states and preemption (:mod:`train.side.resume`)."""

    def __post_init__(self) -> None:
        check(self.steps >= 1, f"steps={self.steps} must be >= 1")
        check(self.batch_size >= 1, f"batch_size={self.batch_size} must be >= 1")
        check(self.schedule.kind == "cosine", f"schedule.kind={self.schedule.kind!r}: expected 'cosine'")
        shares = (self.fsdd_weight, self.fsdd_seq_weight, self.espeak_weight, self.ljspeech_weight)
        check(all(w >= 0 for w in shares) and sum(shares) > 0, "source weights must be >= 0, one > 0")
        check(0.0 <= self.augment_p <= 1.0, f"augment_p={self.augment_p} must be in [0, 1]")
        check(self.fsdd_seq_pool >= 1 and self.espeak_utterances >= 1, "pools must be >= 1")
        check(self.log_every >= 1, f"log_every={self.log_every} must be >= 1")


def open_pools(cfg: SpeechContentTrainConfig, root: Path | None) -> dict[str, list[tuple[np.ndarray, str]]]:
    """``(wave, normalised text)`` pools of the sources with a weight and data (absent ones left out)."""
    from ernie5.data.audio_sources import speech_pools

    names = {k for k in SOURCES if getattr(cfg, f"{k}_weight") > 0}
    utts = speech_pools(
        root, names, fsdd_seq_pool=cfg.fsdd_seq_pool, seed=cfg.seed, espeak_utterances=cfg.espeak_utterances
    )
    pools = {k: [(u.wave, u.text) for u in utts[k]] for k in SOURCES if k in utts}
    return pools


def pad_batch(waves: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Waveforms zero-padded to the longest: ``(float32 (B, S), long lengths (B,))``."""
    S = max(len(w) for w in waves)
    out = np.zeros((len(waves), S), dtype=np.float32)
    for i, w in enumerate(waves):
        out[i, : len(w)] = w
    return torch.from_numpy(out), torch.tensor([len(w) for w in waves])


def ctc_loss(model: SpeechContentEncoder, wave_BS: torch.Tensor, lengths_B: torch.Tensor, texts: list[str]):
    """Mean per-utterance CTC loss (normalised by target length, as ``reduction='mean'``)."""
    logp_BTV = model(wave_BS, lengths_B)
    targets = [torch.tensor(encode_text(t)) for t in texts]
    in_len = torch.as_tensor(model.n_frames(lengths_B)).clamp(max=logp_BTV.shape[1])
    return F.ctc_loss(
        logp_BTV.transpose(0, 1),
        torch.cat(targets),
        in_len,
        torch.tensor([len(t) for t in targets]),
        blank=0,
        zero_infinity=True,
    )


@torch.no_grad()
def heldout_wer(model: SpeechContentEncoder, items: list[tuple[np.ndarray, str]], batch: int = 32) -> dict:
    """Corpus WER, CER (jiwer) and exact share of greedy transcripts of ``items``."""
    import jiwer

    model.eval()
    hyps: list[str] = []
    for i in range(0, len(items), batch):
        wave, n = pad_batch([w for w, _ in items[i : i + batch]])
        hyps += model.transcribe(wave, n)
    refs = [t for _, t in items]
    return {
        "n": len(items),
        "wer": round(float(jiwer.wer(refs, [h or "<empty>" for h in hyps])), 4),
        "cer": round(float(jiwer.cer(refs, [h or "<empty>" for h in hyps])), 4),
        "exact": round(sum(h == r for h, r in zip(hyps, refs)) / max(1, len(refs)), 4),
    }


def heldout_sets(root: Path | None) -> dict[str, list[tuple[np.ndarray, str]]]:
    """FSDD's seen-speaker test split and the held-out speaker (empty without FSDD)."""
    from ernie5.data.audio import fsdd_utterances

    sets: dict[str, list[tuple[np.ndarray, str]]] = {}
    with contextlib.suppress(DataMissing):
        sets["fsdd_seen"] = [(u.wave, u.text) for u in fsdd_utterances(root, "test")]
        sets["fsdd_unseen"] = [(u.wave, u.text) for u in fsdd_utterances(root, "unseen")]
    return sets


def train_speech_content(
    cfg: SpeechContentTrainConfig,
    out_dir: str | Path,
    data_dir: str | Path | None = None,
    time_budget_s: float | None = None,
) -> dict[str, Any]:
    """Train the content encoder into ``out_dir`` (layout in the module docstring); returns the summary.
    ``time_budget_s`` caps the training steps' wall clock (the run then stops early, says so in the
    summary, and still evaluates and saves).

    Raises:
        DataMissing: no source has data (FSDD, eSpeak NG and LJSpeech all absent).
        RunError: the held-out WER's jiwer is not installed (before any step).
    """
    from ernie5.data.voices import augment_speech
    from ernie5.runtime.packages import missing_reason
    from train.common.run_folder import RunError

    if why := missing_reason("jiwer"):
        raise RunError(f"the speech-content encoder's held-out WER {why}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with side_run(out, dump(cfg), cfg.resume) as run:
        write_json(out / "meta.json", provenance(seed=cfg.seed))
        torch.manual_seed(cfg.seed)
        rng = random.Random(cfg.seed)
        aug_rng = np.random.default_rng(cfg.seed)
        root = resolve_data_dir(data_dir)
        pools = open_pools(cfg, root)
        if not pools:
            raise DataMissing("fsdd/recordings/ or eSpeak NG (espeakng-loader)", root, "see README: Data")
        raw = {k: getattr(cfg, f"{k}_weight") for k in pools}
        names, weights = list(raw), [raw[k] / sum(raw.values()) for k in raw]
        model = SpeechContentEncoder(cfg.encoder)
        opt = make_adamw(param_groups(model, cfg.optim.weight_decay, min_ndim=2), cfg.optim)
        state = {"model": model, "opt": opt, "rng": rng, "aug_rng": aug_rng}
        done, _ = run.restore("ctc", state)
        t0 = time.perf_counter()
        steps_run = done
        for step in range(done + 1, cfg.steps + 1):
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                break
            steps_run = step
            model.train()
            lr = lr_at(step - 1, cfg.steps, cfg.optim.lr, cfg.schedule)
            for g in opt.param_groups:
                g["lr"] = lr
            waves, texts = [], []
            for src in rng.choices(names, weights=weights, k=cfg.batch_size):
                wave, text = pools[src][rng.randrange(len(pools[src]))]
                waves.append(augment_speech(wave, aug_rng) if rng.random() < cfg.augment_p else wave)
                texts.append(text)
            wave_BS, n_B = pad_batch(waves)
            loss = ctc_loss(model, wave_BS, n_B, texts)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            opt.step()
            if step % cfg.log_every == 0 or step == cfg.steps:
                append_jsonl(
                    out / "metrics.jsonl",
                    {
                        "step": step,
                        "loss": round(loss.item(), 4),
                        "grad_norm": round(float(grad_norm), 3),
                        "lr": lr,
                    },
                )
            if step < cfg.steps:
                run.step_done("ctc", step, state)
        train_s = time.perf_counter() - t0
        model.eval()
        heldout = {name: heldout_wer(model, items) for name, items in heldout_sets(root).items()}
        model.save(out / "encoder", meta={"trained_steps": steps_run, "heldout": heldout})
        summary = {
            "n_params": sum(p.numel() for p in model.parameters()),
            "sources": {k: round(w, 4) for k, w in zip(names, weights)},
            "steps": steps_run,
            "stopped_early": steps_run < cfg.steps,
            "train_s": round(train_s, 1),
            "steps_per_s": round(steps_run / max(train_s, 1e-9), 3),
            "heldout": heldout,
        }
        write_json(out / "summary.json", summary)
        run.finish()
    return summary
