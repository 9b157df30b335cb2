"""Training of the audio codec (:mod:`ernie5.tokenizers.audio_codec`) with level-1 semantic distillation.

Data (8 kHz mono, random crops of ``crop_s`` seconds, one length per batch, each element from a source
drawn by ``*_weight``; sources absent from the data root are dropped and the weights renormalised):

* ``dtmf``: fresh procedural DTMF key sequences (:func:`ernie5.data.dtmf.dtmf_sequences`), always
  available, so a machine without data still trains a codec;
* ``fsdd``: FSDD train recordings (single spoken digits), when the data root has them;
* ``fsdd_seq``: multi-digit sequences of FSDD train recordings (:func:`ernie5.data.audio.fsdd_sequences`);
* ``ljspeech``: the LJSpeech sample (off by default: ``ljspeech_weight = 0``; read speech resampled to
  8 kHz, it has no held-out split here);
* ``espeak``: eSpeak NG digit sequences in random voices (off by default; the cached corpus of
  :func:`ernie5.data.voices.digit_corpus` that the backbone's ``espeak`` source reads), so that the
  encoder, and level 1 above all, meets more voices than FSDD's four.

Speech crops (every source but DTMF) pass through :func:`ernie5.data.voices.augment_speech` with
probability ``augment_p`` (0 by default): speed, room, tilt and noise widen the voices further.

A crop shorter than its source is a random window; a longer crop holds the whole utterance at a random
offset in silence. Every crop gets a random gain of ``+-gain_db`` (scaled down if it would clip).

Loss: ``stft_weight * MR-STFT + mel_weight * log-mel L1 + wave_weight * waveform L1
+ commit_weight * commitment + codec.distill_weight * distillation``, where MR-STFT is the mean over
``stft_resolutions`` of spectral convergence plus log-magnitude L1, the log-mel is
:func:`ernie5.tokenizers.audio_features.log_mel` (256-point FFT, hop 80, 40 mels) and the distillation is the
teacher's loss on level 1 (:mod:`ernie5.tokenizers.audio_teacher`; the MFCC k-means teacher is fitted on
``teacher_fit_crops`` training crops before the first step). AdamW, linear warmup + cosine decay,
gradient clipping; seeded (weights, data, k-means, quantiser dropout) and deterministic on CPU.

The defaults are tuned for a few CPU minutes (one thread, 8 crops of 0.5-1 s per step, about 0.12 s a
step on a busy 2-core machine). Measured on DTMF-only runs of about 980 steps, the held-out DTMF
round-trip exactness was 0.25 / 0.7 / 1.0 at peak learning rates 1e-3 / 2e-3 / 4e-3, and 0.0 with 16
crops per step (half the steps): steps and a high learning rate matter most. The waveform L1 weight
10 (against 1) raised it from 0.06 to 0.25 at 1e-3. The log floor 1e-2 keeps near-silent frames
(zero-padded crops) from dominating the log-spectral losses; with 1e-5 an ELU codec only learned to
output silence.

One output folder::

    out_dir/config.yaml     the AudioCodecTrainConfig
    out_dir/meta.json       provenance (git hash, versions, machine, seed)
    out_dir/metrics.jsonl   one record per log_every steps: loss terms, train SNR, per-level perplexity,
                            restarted codes, semantic accuracy
    out_dir/codec/          the trained codec (AudioCodec.save)
    out_dir/teacher/        the fitted teacher (when it has state: the MFCC k-means teacher)
    out_dir/summary.json    held-out quality per number of levels, code usage, speed, parameter count

Held-out evaluation: the FSDD test split (speakers' recordings 0-4, never trained on) and DTMF
sequences from a different seed: mean per-utterance SNR (dB) and log-mel L1 distance when decoding the
first 1, 2, ..., Q levels (the residual property: more levels, lower error), per-level code usage, and
DTMF round-trip exactness (share of utterances whose decoded waveform :func:`goertzel_decode` s to the
dialled keys), measured by :mod:`train.side.audio_codec_eval`. The metric functions
:func:`~ernie5.tokenizers.audio_codec.snr_db` and :func:`~ernie5.tokenizers.audio_codec.mel_distance`
live in :mod:`ernie5.tokenizers.audio_codec`.

Deviations:
  1. No GAN discriminator (EnCodec / SoundStream / Mimi train adversarially; none is implemented here):
     a few CPU minutes are far too few for one to help, so the codec is trained with spectral and
     waveform losses only. Its waveform is not phase-accurate (held-out SNR stays near or below 0 dB
     after minutes of training) while its spectra, which the mel distance and the DTMF decoder measure,
     are learned first.
  2. Tiny data (FSDD digits, DTMF tones) and a CPU-minutes budget instead of large speech corpora.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ernie5.config import check, dump
from ernie5.data.root import resolve_data_dir
from ernie5.store.runs import append_jsonl, provenance, write_json
from ernie5.tokenizers.audio_codec import AudioCodec, snr_db
from ernie5.tokenizers.audio_config import AudioCodecConfig
from ernie5.tokenizers.audio_features import log_mel
from ernie5.tokenizers.audio_teacher import KMeansTeacher, SemanticTeacher, build_teacher
from train.common.optim import OptimConfig, make_adamw, param_groups
from train.common.schedule import ScheduleConfig, cosine_progress, lr_at
from train.side.audio_codec_eval import codec_speed, evaluate_codec, heldout_sets
from train.side.resume import ResumeConfig, side_run

SOURCES = ("dtmf", "fsdd", "fsdd_seq", "ljspeech", "espeak")
"""Training sources, in the order their weights are listed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AudioCodecTrainConfig:
    """Everything :func:`train_audio_codec` needs."""

    codec: AudioCodecConfig = field(default_factory=AudioCodecConfig)
    """The codec to train (its ``teacher`` and ``distill_weight`` set the semantic distillation)."""
    steps: int = 4000
    """Optimizer steps (a time budget may stop earlier)."""
    batch_size: int = 8
    """Crops per step."""
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=4e-3, betas=(0.8, 0.99), weight_decay=0.0, fused=False)
    )
    """AdamW (torch's own step, ``fused`` off); weight decay on conv and linear weights only (biases
    never decayed)."""
    schedule: ScheduleConfig = field(
        default_factory=lambda: ScheduleConfig(kind="cosine", warmup_steps=100, min_lr_ratio=0.05)
    )
    """Linear warmup, then a half cosine to ``min_lr_ratio * lr`` at the last step (``kind`` must be
    ``cosine``: a time budget drives its progress)."""
    crop_s: tuple[float, float] = (0.5, 1.0)
    """Range of the crop length (seconds, uniform per batch, rounded up to whole frames)."""
    stft_weight: float = 1.0
    """Weight of the multi-resolution STFT loss (spectral convergence + log-magnitude L1)."""
    stft_resolutions: tuple[tuple[int, int], ...] = ((64, 16), (128, 32), (256, 64), (512, 128))
    """``(n_fft, hop)`` of each STFT resolution (Hann windows of ``n_fft``)."""
    mel_weight: float = 1.0
    """Weight of the log-mel L1 loss."""
    log_floor: float = 1e-2
    """Floor added before every log of the spectral losses: to the STFT magnitudes and to the mel powers
    (a larger floor stops near-silent frames from dominating the log-spectral losses)."""
    wave_weight: float = 10.0
    """Weight of the waveform L1 loss."""
    commit_weight: float = 1.0
    """Weight of the RVQ commitment loss."""
    dtmf_weight: float = 0.4
    """Share of DTMF crops (always available)."""
    fsdd_weight: float = 0.3
    """Share of FSDD train recordings (when present)."""
    fsdd_seq_weight: float = 0.3
    """Share of FSDD train multi-digit sequences (when present)."""
    ljspeech_weight: float = 0.0
    """Share of LJSpeech sample crops (when present; 0 = off)."""
    espeak_weight: float = 0.0
    """Share of eSpeak NG digit-sequence crops (when eSpeak NG is available; 0 = off)."""
    augment_p: float = 0.0
    """Probability that a speech crop's utterance passes through ``augment_speech`` first."""
    fsdd_seq_pool: int = 600
    """FSDD train sequences generated once (2-4 digits each) for the ``fsdd_seq`` source."""
    gain_db: float = 6.0
    """Random gain range (+-dB) of every crop."""
    teacher_fit_crops: int = 512
    """Training crops whose pooled features fit the MFCC k-means teacher."""
    teacher_iters: int = 50
    """Lloyd iterations of the teacher's k-means."""
    content_encoder: str = ""
    """Folder of a trained speech-content encoder (:mod:`train.side.speech_content`) for
    ``codec.teacher == "content_kmeans"``."""
    whisper_source: str = ""
    """Whisper model id or folder for ``codec.teacher == "whisper"`` (needs transformers and the weights)."""
    eval_fsdd: int = 0
    """FSDD test utterances evaluated (0 = all 250)."""
    eval_dtmf: int = 100
    """Held-out DTMF utterances evaluated."""
    log_every: int = 25
    """Steps between metrics.jsonl records."""
    seed: int = 0
    """Seeds the weights, the data, the teacher and the held-out DTMF set (``seed + 1_000_003``)."""
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    """Resume states and preemption (:mod:`train.side.resume`)."""

    def __post_init__(self) -> None:
        check(self.steps >= 1, f"steps={self.steps} must be >= 1")
        check(self.batch_size >= 1, f"batch_size={self.batch_size} must be >= 1")
        lo, hi = self.crop_s
        check(0 < lo <= hi, f"crop_s={list(self.crop_s)} must satisfy 0 < low <= high")
        check(self.schedule.kind == "cosine", f"schedule.kind={self.schedule.kind!r}: expected 'cosine'")
        weights = (self.stft_weight, self.mel_weight, self.wave_weight, self.commit_weight)
        check(all(w >= 0 for w in weights), "loss weights must be >= 0")
        check(
            all(n >= 2 and 1 <= h <= n for n, h in self.stft_resolutions),
            f"stft_resolutions={[list(r) for r in self.stft_resolutions]}: need n_fft >= 2 and "
            "1 <= hop <= n_fft",
        )
        shares = (
            self.dtmf_weight,
            self.fsdd_weight,
            self.fsdd_seq_weight,
            self.ljspeech_weight,
            self.espeak_weight,
        )
        check(all(w >= 0 for w in shares), "source weights must be >= 0")
        check(self.dtmf_weight > 0, f"dtmf_weight={self.dtmf_weight} must be > 0 (the data-free source)")
        check(self.fsdd_seq_pool >= 1, f"fsdd_seq_pool={self.fsdd_seq_pool} must be >= 1")
        check(self.gain_db >= 0, f"gain_db={self.gain_db} must be >= 0")
        check(0.0 <= self.augment_p <= 1.0, f"augment_p={self.augment_p} must be in [0, 1]")
        check(
            self.codec.teacher != "content_kmeans" or bool(self.content_encoder),
            "codec.teacher='content_kmeans' needs content_encoder (a trained speech-content encoder folder)",
        )
        check(
            self.teacher_fit_crops >= 1 and self.teacher_iters >= 1,
            "teacher_fit_crops and teacher_iters must be >= 1",
        )
        check(self.eval_fsdd >= 0 and self.eval_dtmf >= 1, "eval_fsdd must be >= 0 and eval_dtmf >= 1")
        check(self.log_every >= 1, f"log_every={self.log_every} must be >= 1")
        check(
            self.codec.teacher != "whisper" or bool(self.whisper_source),
            "codec.teacher='whisper' needs whisper_source (a Whisper model id or folder)",
        )


# ---------------------------------------------------------------------- data
def crop(wave: np.ndarray, length: int, rng: random.Random) -> np.ndarray:
    """A ``length``-sample window of ``wave`` at a random offset; a shorter wave is placed whole at a
    random offset in zeros."""
    wave = np.asarray(wave, dtype=np.float32)
    out = np.zeros(length, dtype=np.float32)
    if len(wave) >= length:
        start = rng.randrange(len(wave) - length + 1)
        out[:] = wave[start : start + length]
    else:
        start = rng.randrange(length - len(wave) + 1)
        out[start : start + len(wave)] = wave
    return out


@dataclass
class AudioCrops:
    """The training mixture: pools of the sources the data root has, DTMF always (generated fresh)."""

    pools: dict[str, list[np.ndarray]]
    """Waveforms of each available data source (``fsdd``, ``fsdd_seq``, ``ljspeech``)."""
    weights: dict[str, float]
    """Normalised share of every available source, ``dtmf`` included."""
    hop: int
    sample_rate: int
    crop_s: tuple[float, float]
    gain_db: float
    augment_p: float = 0.0

    @classmethod
    def open(cls, cfg: AudioCodecTrainConfig, root: Path | None) -> AudioCrops:
        """Load the pools from the data root (absent sources are skipped)."""
        from ernie5.data.audio_sources import speech_pools

        wanted = {
            "fsdd": cfg.fsdd_weight,
            "fsdd_seq": cfg.fsdd_seq_weight,
            "ljspeech": cfg.ljspeech_weight,
            "espeak": cfg.espeak_weight,
        }
        utts = speech_pools(
            root, {k for k, w in wanted.items() if w > 0}, fsdd_seq_pool=cfg.fsdd_seq_pool, seed=cfg.seed
        )
        pools = {k: [u.wave for u in utts[k]] for k in wanted if k in utts}  # the weights' order
        raw = {"dtmf": cfg.dtmf_weight, **{k: wanted[k] for k in pools}}
        total = sum(raw.values())
        return cls(
            pools=pools,
            weights={k: v / total for k, v in raw.items()},
            hop=cfg.codec.hop,
            sample_rate=cfg.codec.sample_rate,
            crop_s=cfg.crop_s,
            gain_db=cfg.gain_db,
            augment_p=cfg.augment_p,
        )

    def batch(self, n: int, rng: random.Random) -> tuple[torch.Tensor, list[str]]:
        """``n`` crops ``float32 (n, S)`` of one random length (whole frames) and their sources."""
        from ernie5.data.dtmf import dtmf_sequences

        frames = math.ceil(rng.uniform(*self.crop_s) * self.sample_rate / self.hop)
        length = frames * self.hop
        names = list(self.weights)
        sources = rng.choices(names, weights=[self.weights[k] for k in names], k=n)
        n_dtmf = sources.count("dtmf")
        dtmf = iter(dtmf_sequences(n_dtmf, 2, 6, seed=rng.getrandbits(32)) if n_dtmf else [])
        out = np.zeros((n, length), dtype=np.float32)
        for i, src in enumerate(sources):
            wave = next(dtmf).wave if src == "dtmf" else self.pools[src][rng.randrange(len(self.pools[src]))]
            if src != "dtmf" and self.augment_p > 0 and rng.random() < self.augment_p:
                from ernie5.data.voices import augment_speech

                wave = augment_speech(wave, np.random.default_rng(rng.getrandbits(63)))
            x = crop(wave, length, rng) * 10.0 ** (rng.uniform(-self.gain_db, self.gain_db) / 20.0)
            peak = float(np.abs(x).max(initial=0.0))
            out[i] = x / peak * 0.99 if peak > 0.99 else x
        return torch.from_numpy(out), sources


# ---------------------------------------------------------------------- losses
def stft_loss(
    x_BS: torch.Tensor, y_BS: torch.Tensor, n_fft: int, hop: int, floor: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(spectral convergence, log-magnitude L1)`` of estimate ``y`` against reference ``x`` at one
    resolution (Hann window ``n_fft``, centred, zero-padded)."""
    window = torch.hann_window(n_fft, dtype=x_BS.dtype, device=x_BS.device)

    def mag(w: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(w, n_fft, hop, window=window, center=True, pad_mode="constant", return_complex=True)
        return (spec.real.square() + spec.imag.square() + 1e-12).sqrt()

    mx, my = mag(x_BS), mag(y_BS)
    sc = torch.linalg.norm(mx - my) / torch.linalg.norm(mx).clamp_min(1e-8)
    log_l1 = ((mx + floor).log() - (my + floor).log()).abs().mean()
    return sc, log_l1


def multi_resolution_stft_loss(
    x_BS: torch.Tensor, y_BS: torch.Tensor, resolutions: tuple[tuple[int, int], ...], floor: float = 1e-5
) -> torch.Tensor:
    """Mean over resolutions of spectral convergence + log-magnitude L1 (Yamamoto et al. 2020)."""
    total = x_BS.new_zeros(())
    for n_fft, hop in resolutions:
        sc, log_l1 = stft_loss(x_BS, y_BS, n_fft, hop, floor)
        total = total + sc + log_l1
    return total / len(resolutions)


def codec_loss(
    codec: AudioCodec,
    wave_BS: torch.Tensor,
    cfg: AudioCodecTrainConfig,
    teacher: SemanticTeacher | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """One forward pass of the codec on a batch and the weighted training loss.

    Returns ``(loss, terms)``: ``terms`` holds every unweighted loss term, the train SNR (dB, over the
    batch), the batch's per-level perplexity and restarted codes, and (with a teacher) the level-1
    semantic accuracy (k-means teacher).
    """
    out = codec(wave_BS)
    rec = out.wave_BS
    stft = multi_resolution_stft_loss(wave_BS, rec, cfg.stft_resolutions, cfg.log_floor)
    sr = codec.sample_rate
    mel = (log_mel(wave_BS, sr, eps=cfg.log_floor) - log_mel(rec, sr, eps=cfg.log_floor)).abs().mean()
    wave_l1 = (wave_BS - rec).abs().mean()
    loss = (
        cfg.stft_weight * stft
        + cfg.mel_weight * mel
        + cfg.wave_weight * wave_l1
        + cfg.commit_weight * out.commit_loss
    )
    terms: dict[str, Any] = {
        "stft": stft.item(),
        "mel": mel.item(),
        "wave_l1": wave_l1.item(),
        "commit": out.commit_loss.item(),
        "train_snr_db": round(snr_db(wave_BS.detach(), rec.detach()), 3),
        "perplexity": [round(p, 2) for p in out.usage["perplexity"]],
    }
    if "restarted" in out.usage:
        terms["restarted"] = [int(r) for r in out.usage["restarted"]]
    if teacher is not None and codec.semantic_head is not None:
        targets = codec.teacher_targets(teacher, wave_BS)
        pred = codec.semantic(out.level1_BDN)
        distill = teacher.loss(pred, targets)
        loss = loss + codec.cfg.distill_weight * distill
        terms["distill"] = distill.item()
        if isinstance(teacher, KMeansTeacher):
            terms["semantic_acc"] = round(teacher.accuracy(pred.detach(), targets), 4)
    return loss, terms


# ---------------------------------------------------------------------- teacher
def fit_teacher(
    codec: AudioCodec, data: AudioCrops, cfg: AudioCodecTrainConfig, rng: random.Random
) -> SemanticTeacher | None:
    """The codec config's teacher; the MFCC k-means one fitted on ``teacher_fit_crops`` training crops
    pooled to the codec's frames."""
    teacher = build_teacher(
        cfg.codec.teacher, cfg.codec.teacher_dim, cfg.whisper_source or None, cfg.content_encoder or None
    )
    if isinstance(teacher, KMeansTeacher):
        feats = []
        left = cfg.teacher_fit_crops
        while left > 0:
            n = min(left, 64)
            wave, _ = data.batch(n, rng)
            feats.append(codec.teacher_targets(teacher, wave).reshape(-1, teacher.feature_dim))
            left -= n
        feats_MD = torch.cat(feats)
        if feats_MD.shape[0] < teacher.n_clusters:
            raise ValueError(
                f"teacher_fit_crops={cfg.teacher_fit_crops} give {feats_MD.shape[0]} frames, fewer than "
                f"the {teacher.n_clusters} clusters"
            )
        teacher.fit(feats_MD, seed=cfg.seed, iters=cfg.teacher_iters)
    return teacher


# ---------------------------------------------------------------------- entry
def train_audio_codec(
    cfg: AudioCodecTrainConfig,
    out_dir: str | Path,
    data_dir: str | Path | None = None,
    time_budget_s: float | None = None,
) -> dict[str, Any]:
    """Train the audio codec and evaluate it on held-out FSDD and DTMF.

    Args:
        cfg: the run configuration.
        out_dir: the output folder (created; see the module docstring for its layout).
        data_dir: the data root (FSDD, LJSpeech); None = ``$ERNIE5_DATA_DIR``; without data, DTMF only.
        time_budget_s: optional wall-clock cap on the training steps (teacher fitting included); the run
            then stops early, says so and still evaluates and saves. With a budget the cosine schedule
            follows whichever is further along, steps or the budget's wall clock, so
            a budgeted run is not bitwise reproducible.

    Returns:
        The summary written to ``summary.json``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with side_run(out, dump(cfg), cfg.resume) as run:
        write_json(out / "meta.json", provenance(seed=cfg.seed))
        torch.manual_seed(cfg.seed)
        rng = random.Random(cfg.seed)
        root = resolve_data_dir(data_dir)
        data = AudioCrops.open(cfg, root)
        codec = AudioCodec(cfg.codec)
        summary: dict[str, Any] = {
            "n_params": sum(p.numel() for p in codec.parameters()),
            "n_params_encoder": sum(p.numel() for p in codec.encoder.parameters()),
            "n_params_decoder": sum(p.numel() for p in codec.decoder.parameters()),
            "hop": codec.hop,
            "frame_rate": codec.frame_rate,
            "n_levels": codec.n_levels,
            "codebook_size": codec.codebook_size,
            "codes_per_s_audio": codec.frame_rate * codec.n_levels,
            "bitrate_bps": cfg.codec.bitrate,
            "sources": {k: round(v, 4) for k, v in data.weights.items()},
        }
        t0 = time.perf_counter()
        teacher = fit_teacher(codec, data, cfg, random.Random(cfg.seed + 7))
        summary["teacher"] = {"kind": cfg.codec.teacher, "fit_s": round(time.perf_counter() - t0, 2)}
        opt = make_adamw(param_groups(codec, cfg.optim.weight_decay, min_ndim=2), cfg.optim)
        codec.train()
        state = {"codec": codec, "opt": opt, "rng": rng}
        steps_run = start = run.restore("codec", state)[0]
        for step in range(start, cfg.steps):
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                summary["stopped_early_at_step"] = step
                break
            wave, sources = data.batch(cfg.batch_size, rng)
            used = 0.0 if not time_budget_s else (time.perf_counter() - t0) / time_budget_s
            progress = max(cosine_progress(step, cfg.steps, cfg.schedule.warmup_steps), used)
            lr = lr_at(step, cfg.steps, cfg.optim.lr, cfg.schedule, progress)
            for group in opt.param_groups:
                group["lr"] = lr
            loss, terms = codec_loss(codec, wave, cfg, teacher)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                codec.parameters(), cfg.optim.grad_clip or float("inf")
            )
            opt.step()
            steps_run = step + 1
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                record = {"step": step, "lr": lr, "loss": loss.item(), **terms, "grad_norm": float(grad_norm)}
                record["crop_s"] = round(wave.shape[1] / codec.sample_rate, 3)
                record["elapsed_s"] = round(time.perf_counter() - t0, 2)
                append_jsonl(out / "metrics.jsonl", record)
                summary["last_log"] = record
            if steps_run < cfg.steps:
                run.step_done("codec", steps_run, state)
        summary["steps"] = steps_run
        summary["train_s"] = round(time.perf_counter() - t0, 1)
        summary["ema_perplexity"] = [round(p, 2) for p in codec.ema_perplexity()]

        t1 = time.perf_counter()
        summary["eval"] = {
            name: evaluate_codec(codec, waves, keys, teacher)
            for name, (waves, keys) in heldout_sets(
                root, eval_dtmf=cfg.eval_dtmf, eval_fsdd=cfg.eval_fsdd, seed=cfg.seed
            ).items()
        }
        summary["eval_s"] = round(time.perf_counter() - t1, 1)
        summary["speed"] = codec_speed(codec)
        codec.save(out / "codec", meta={"steps": steps_run, "seed": cfg.seed})
        if isinstance(teacher, KMeansTeacher):
            teacher.save(out / "teacher")
        write_json(out / "summary.json", summary)
        run.finish()
    return summary
