"""Judges for generated speech and tones: a reference spoken-digit recogniser and an exact DTMF decoder.

The recogniser plays the role Whisper plays in Seed-TTS-eval: generated speech for a prompt such as
"seven three" is transcribed and scored by WER against the prompt. It is a small CTC model (log-mel 40 ->
two stride-2 convolutions -> bidirectional GRU -> 11 classes: the CTC blank and the ten digit words) that
the project trains itself, seeded and deterministic, on the FSDD *train* recordings, multi-digit sequences
built from them (:func:`ernie5.data.audio.fsdd_sequences`) and DTMF sequences of the keys 0-9 (whose
transcript is the digit words too), with gain, noise and padding augmentation. The first call trains it
(about a minute on two cores) and caches the weights under
``$ERNIE5_CACHE_DIR/judges/asr-v<ASR_JUDGE_VERSION>-<hash of the FSDD files and the recipe>.safetensors``
beside a JSON file with its held-out metrics: corpus WER and CER on multi-digit sequences built from the
FSDD *test* recordings only. Its version and WER are recorded with every result that uses it. Bump
``ASR_JUDGE_VERSION`` whenever the architecture or the training code changes (the recipe's numbers are
hashed already).

DTMF audio is judged analytically by :func:`ernie5.data.dtmf.goertzel_decode`.

References:
  - A. Graves et al., "Connectionist temporal classification", ICML 2006 (the loss and greedy decoding).
  - Seed-TTS-eval (github.com/BytedanceSpeech/seed-tts-eval): TTS intelligibility as the WER of a fixed
    reference ASR model on the generated speech.

Deviations:
  1. The reference recogniser knows only the ten digit words (FSDD's vocabulary), not open English; any
     other word in a reference counts as an error it cannot avoid.
  2. Held-out WER is measured on concatenated test recordings (the same construction as the training
     sequences), which is easier than connected speech.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ernie5.data.audio import DIGIT_WORDS, SAMPLE_RATE, Utterance, normalize_text
from ernie5.runtime.threads import num_threads
from ernie5.tokenizers.audio_features import log_mel

ASR_JUDGE_VERSION = 1
BLANK = 0
"""CTC blank class; class ``1 + d`` is the word of digit ``d``."""
VOCAB: tuple[str, ...] = ("<blank>", *DIGIT_WORDS)
"""The recogniser's output classes."""
N_FFT, HOP, N_MELS = 256, 80, 40
"""Log-mel front end (32 ms window, 10 ms hop at 8 kHz)."""
_WORD_ID = {w: i for i, w in enumerate(VOCAB)}


@dataclass(frozen=True)
class AsrRecipe:
    """Everything that determines the trained recogniser besides the FSDD files and the code."""

    hidden: int = 96
    channels: int = 96
    gru_layers: int = 1
    n_fsdd_seq: int = 1500
    seq_digits: tuple[int, int] = (2, 5)
    n_dtmf: int = 300
    epochs: int = 6
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 1e-2
    gain_db: tuple[float, float] = (-18.0, 6.0)
    noise_snr_db: tuple[float, float] = (15.0, 50.0)
    pad_s: tuple[float, float] = (0.0, 0.25)
    seed: int = 0
    threads: int = 1
    n_test_seq: int = 200
    test_seed: int = 1234


RECIPE = AsrRecipe()
"""The recipe :func:`load_digit_recognizer` trains with (tests may monkeypatch a tiny one)."""


def text_to_ids(text: str) -> list[int]:
    """Class ids of the digit words of ``normalize_text(text)``; other words are dropped."""
    return [_WORD_ID[w] for w in normalize_text(text).split() if w in _WORD_ID and w != VOCAB[BLANK]]


def ctc_greedy_decode(logits_BTC: torch.Tensor, lengths_B: torch.Tensor | None = None) -> list[str]:
    """Best-path CTC decoding: per frame argmax, merge repeats, drop blanks, words joined by spaces."""
    best_BT = logits_BTC.argmax(-1).cpu()
    lengths = [best_BT.shape[1]] * best_BT.shape[0] if lengths_B is None else lengths_B.tolist()
    out = []
    for row, n in zip(best_BT.tolist(), lengths):
        words, prev = [], BLANK
        for c in row[:n]:
            if c != prev and c != BLANK:
                words.append(VOCAB[c])
            prev = c
        out.append(" ".join(words))
    return out


def _conv_len(lengths_B: torch.Tensor) -> torch.Tensor:
    return (lengths_B + 1) // 2  # kernel 5, stride 2, padding 2


def _mask(x_BCT: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    keep_BT = torch.arange(x_BCT.shape[-1], device=x_BCT.device)[None] < lengths_B[:, None]
    return x_BCT * keep_BT[:, None].to(x_BCT.dtype)


class CtcDigitNet(nn.Module):
    """Log-mel -> 2 x (Conv1d k5 s2 + GELU) -> BiGRU -> linear to :data:`VOCAB`; 40 ms per output frame.

    Frames beyond each utterance's length are zeroed before every convolution and the GRU runs on packed
    sequences, so an utterance's output does not depend on what else is in its batch.
    """

    def __init__(self, channels: int = 96, hidden: int = 96, gru_layers: int = 1) -> None:
        super().__init__()
        self.register_buffer("feat_mean", torch.zeros(N_MELS, 1))
        self.register_buffer("feat_std", torch.ones(N_MELS, 1))
        self.conv1 = nn.Conv1d(N_MELS, channels, 5, stride=2, padding=2)
        self.conv2 = nn.Conv1d(channels, channels, 5, stride=2, padding=2)
        self.gru = nn.GRU(channels, hidden, num_layers=gru_layers, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, len(VOCAB))

    @staticmethod
    def frame_lengths(samples_B: torch.Tensor) -> torch.Tensor:
        """Output frames for waves of ``samples_B`` samples."""
        return _conv_len(_conv_len(1 + samples_B // HOP))

    def encode(self, wave_BS: torch.Tensor, samples_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GRU outputs ``(B, T', 2 * hidden)`` (zero beyond each length) and the lengths ``T'``."""
        feat_BMT = (log_mel(wave_BS, SAMPLE_RATE, N_FFT, HOP, N_MELS) - self.feat_mean) / self.feat_std
        lengths_B = 1 + samples_B // HOP
        x_BCT = _mask(feat_BMT, lengths_B)
        lengths_B = _conv_len(lengths_B)
        x_BCT = _mask(F.gelu(self.conv1(x_BCT)), lengths_B)
        lengths_B = _conv_len(lengths_B)
        x_BCT = F.gelu(self.conv2(x_BCT))
        packed = pack_padded_sequence(
            x_BCT.transpose(1, 2), lengths_B.cpu(), batch_first=True, enforce_sorted=False
        )
        h_BTH, _ = pad_packed_sequence(self.gru(packed)[0], batch_first=True, total_length=x_BCT.shape[-1])
        return h_BTH, lengths_B

    def forward(self, wave_BS: torch.Tensor, samples_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``(B, T', len(VOCAB))`` and output lengths ``(B,)``."""
        h_BTH, lengths_B = self.encode(wave_BS, samples_B)
        return self.out(h_BTH), lengths_B


def _pad_batch(waves: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    samples = [len(w) for w in waves]
    out = np.zeros((len(waves), max(max(samples), 1)), dtype=np.float32)
    for i, w in enumerate(waves):
        out[i, : len(w)] = w
    return torch.from_numpy(out), torch.tensor(samples, dtype=torch.long)


def _batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (sorted by length, stable)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


@dataclass
class DigitRecognizer:
    """A trained reference spoken-digit recogniser (see the module docstring)."""

    net: CtcDigitNet
    version: int
    wer: float
    cer: float
    n_params: int
    path: Path | None = None
    metrics: dict = dataclasses.field(default_factory=dict)
    threads: int = 1
    """Torch threads used while transcribing (fixed, so results do not depend on the caller's setting)."""

    @property
    def name(self) -> str:
        """What results record about the judge."""
        return f"asr-v{self.version}"

    def _run(self, waves: list[np.ndarray], batch_size: int, fn) -> list:
        arrays = [np.asarray(w, dtype=np.float32).reshape(-1) for w in waves]
        out: list = [None] * len(arrays)
        with num_threads(self.threads), torch.inference_mode():
            for idx in _batches([len(a) for a in arrays], batch_size):
                wave_BS, samples_B = _pad_batch([arrays[i] for i in idx])
                for i, item in zip(idx, fn(wave_BS, samples_B)):
                    out[i] = item
        return out

    def transcribe(self, waves: list[np.ndarray], batch_size: int = 32) -> list[str]:
        """Normalised digit-word transcripts of 8 kHz mono float waves (``""`` when no digit is heard)."""

        def fn(wave_BS, samples_B):
            logits_BTC, lengths_B = self.net(wave_BS, samples_B)
            return ctc_greedy_decode(logits_BTC, lengths_B)

        return self._run(waves, batch_size, fn)

    def features(self, waves: list[np.ndarray], batch_size: int = 32) -> list[np.ndarray]:
        """Per-utterance GRU outputs ``float32 (T', 2 * hidden)``, one per 40 ms (for a semantic teacher)."""

        def fn(wave_BS, samples_B):
            h_BTH, lengths_B = self.net.encode(wave_BS, samples_B)
            return [h_BTH[b, :n].numpy().copy() for b, n in enumerate(lengths_B.tolist())]

        return self._run(waves, batch_size, fn)


def _cache_dir() -> Path:
    return Path(os.environ.get("ERNIE5_CACHE_DIR", Path.home() / ".cache" / "ernie5")) / "judges"


def _augment(wave: np.ndarray, recipe: AsrRecipe, rng: np.random.Generator) -> np.ndarray:
    """Random gain, silence padding at both ends and white noise at a random SNR; clipped to [-1, 1]."""
    lead, trail = (round(rng.uniform(*recipe.pad_s) * SAMPLE_RATE) for _ in range(2))
    x = np.concatenate([np.zeros(lead, np.float32), wave, np.zeros(trail, np.float32)])
    x = x * np.float32(10.0 ** (rng.uniform(*recipe.gain_db) / 20.0))
    power = float(np.mean(x.astype(np.float64) ** 2))
    sigma = math.sqrt(power / 10.0 ** (rng.uniform(*recipe.noise_snr_db) / 10.0))
    return np.clip(x + rng.standard_normal(len(x)).astype(np.float32) * np.float32(sigma), -1, 1)


def training_set(data_dir: str | Path | None, recipe: AsrRecipe) -> list[Utterance]:
    """FSDD train recordings, ``recipe.n_fsdd_seq`` train sequences and ``recipe.n_dtmf`` DTMF sequences
    of the keys 0-9 (all seeded by ``recipe.seed``)."""
    from ernie5.data.audio import fsdd_sequences, fsdd_utterances
    from ernie5.data.dtmf import dtmf_sequences

    singles = fsdd_utterances(data_dir, "train")
    lo, hi = recipe.seq_digits
    seqs = fsdd_sequences(data_dir, "train", recipe.n_fsdd_seq, lo, hi, seed=recipe.seed)
    tones = dtmf_sequences(recipe.n_dtmf, lo, hi, seed=recipe.seed, keys="0123456789")
    return singles + seqs + tones


def heldout_set(data_dir: str | Path | None, recipe: AsrRecipe) -> list[Utterance]:
    """Multi-digit sequences of FSDD *test* recordings only (the WER/CER reported for the judge)."""
    from ernie5.data.audio import fsdd_sequences

    lo, hi = recipe.seq_digits
    return fsdd_sequences(data_dir, "test", recipe.n_test_seq, lo, hi, seed=recipe.test_seed)


def train_recognizer(train: list[Utterance], recipe: AsrRecipe) -> CtcDigitNet:
    """A :class:`CtcDigitNet` trained with CTC on ``train`` (seeded; ``recipe.threads`` torch threads)."""
    with num_threads(recipe.threads):
        torch.manual_seed(recipe.seed)
        rng = np.random.default_rng(recipe.seed)
        order_rng = random.Random(recipe.seed)
        net = CtcDigitNet(recipe.channels, recipe.hidden, recipe.gru_layers)
        with torch.no_grad():  # global feature normalisation from the clean training set
            sample = [train[i].wave for i in order_rng.sample(range(len(train)), min(len(train), 512))]
            wave_BS, samples_B = _pad_batch(sample)
            feat_BMT = log_mel(wave_BS, SAMPLE_RATE, N_FFT, HOP, N_MELS)
            keep_BT = torch.arange(feat_BMT.shape[-1])[None] < (1 + samples_B // HOP)[:, None]
            frames_NM = feat_BMT.transpose(1, 2)[keep_BT]
            net.feat_mean.copy_(frames_NM.mean(0)[:, None])
            net.feat_std.copy_(frames_NM.std(0).clamp_min(1e-3)[:, None])
        targets = [text_to_ids(u.text) for u in train]
        batches = _batches([len(u.wave) for u in train], recipe.batch_size)
        opt = torch.optim.AdamW(net.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
        total = max(1, recipe.epochs * len(batches))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=recipe.lr, total_steps=total, pct_start=0.15)
        net.train()
        for _ in range(recipe.epochs):
            order_rng.shuffle(batches)
            for idx in batches:
                wave_BS, samples_B = _pad_batch([_augment(train[i].wave, recipe, rng) for i in idx])
                logits_BTC, lengths_B = net(wave_BS, samples_B)
                tgt = [targets[i] for i in idx]
                loss = F.ctc_loss(
                    logits_BTC.log_softmax(-1).transpose(0, 1),
                    torch.tensor([c for t in tgt for c in t], dtype=torch.long),
                    lengths_B,
                    torch.tensor([len(t) for t in tgt], dtype=torch.long),
                    blank=BLANK,
                    zero_infinity=True,
                )
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                sched.step()
    return net.eval()


def evaluate(recognizer: DigitRecognizer, utterances: list[Utterance]) -> dict[str, float]:
    """Corpus WER and CER (jiwer) of ``recognizer`` on ``utterances`` and the share transcribed exactly."""
    import jiwer

    refs = [u.text for u in utterances]
    hyps = recognizer.transcribe([u.wave for u in utterances])
    return {
        "wer": float(jiwer.wer(refs, hyps)),
        "cer": float(jiwer.cer(refs, hyps)),
        "exact": float(np.mean([r == h for r, h in zip(refs, hyps)])),
        "n": len(refs),
    }


def _digest(data_dir: str | Path | None, recipe: AsrRecipe) -> str:
    from ernie5.data.audio import fsdd_files

    h = hashlib.sha256(json.dumps(dataclasses.asdict(recipe), sort_keys=True).encode())
    for split in ("train", "test"):
        for _, _, _, path in fsdd_files(data_dir, split):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _write_atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    tmp.replace(path)


def load_digit_recognizer(data_dir: str | Path | None, recipe: AsrRecipe | None = None) -> DigitRecognizer:
    """The cached reference recogniser for this data root's FSDD, training it first if needed (~1 min).

    Raises:
        DataMissing: no FSDD recordings under ``data_dir``.
    """
    recipe = RECIPE if recipe is None else recipe
    digest = _digest(data_dir, recipe)
    path = _cache_dir() / f"asr-v{ASR_JUDGE_VERSION}-{digest}.safetensors"
    meta_path = path.with_suffix(".json")
    net = CtcDigitNet(recipe.channels, recipe.hidden, recipe.gru_layers)
    metrics: dict = {}
    if path.is_file():
        net.load_state_dict(load_file(path))
        net.eval()
        try:
            metrics = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            metrics = {}
    else:
        start = time.perf_counter()
        net = train_recognizer(training_set(data_dir, recipe), recipe)
        metrics["train_seconds"] = round(time.perf_counter() - start, 1)
        _write_atomic(path, lambda tmp: save_file(net.state_dict(), str(tmp)))
    n_params = sum(p.numel() for p in net.parameters())
    judge = DigitRecognizer(net, ASR_JUDGE_VERSION, 0.0, 0.0, n_params, path, metrics, recipe.threads)
    if not {"wer", "cer"} <= metrics.keys():
        metrics.update(evaluate(judge, heldout_set(data_dir, recipe)))
        metrics.update(version=ASR_JUDGE_VERSION, n_params=n_params, recipe=dataclasses.asdict(recipe))
        _write_atomic(meta_path, lambda tmp: tmp.write_text(json.dumps(metrics, indent=1, sort_keys=True)))
    judge.wer, judge.cer = float(metrics["wer"]), float(metrics["cer"])
    return judge


def dtmf_transcribe(waves: list[np.ndarray]) -> list[str]:
    """Normalised transcripts (``"four pound"``) of 8 kHz DTMF waves by the exact Goertzel decoder."""
    from ernie5.data.dtmf import goertzel_decode

    return [normalize_text(goertzel_decode(np.asarray(w, dtype=np.float32))) for w in waves]
