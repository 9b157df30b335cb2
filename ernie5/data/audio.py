"""Speech from the data root (FSDD spoken digits, an LJSpeech sample) in the project's audio format.

The project's audio format: an :class:`Utterance` holds a ``float32`` mono waveform in [-1, 1] at
:data:`SAMPLE_RATE` (8 kHz, FSDD's native rate) and its transcript in the one fixed normalised form of
:func:`normalize_text`, which every ASR/TTS score in the project uses on both sides.

Layout (relative to the root): ``fsdd/recordings/{digit}_{speaker}_{index}.wav`` (index 0..49) and
``ljspeech_mini/metadata.csv`` (``id|duration_s|text``, a header line) with ``ljspeech_mini/wavs/<id>.wav``.

:func:`fsdd_sequences` builds multi-digit utterances ("four one nine") by joining recordings of one
speaker from one split with short random silences, so a test sequence contains only test recordings.

Speakers: :data:`FSDD_UNSEEN_SPEAKER` (``theo``) is held out of training entirely. The ``train`` and
``test`` splits hold the other speakers (:data:`FSDD_TRAIN_SPEAKERS`, the "seen" speakers) only; the
``unseen`` split is every recording (all indices 0..49) of the held-out speaker. Everything that trains on
FSDD (the pretraining mixture, the audio codec, the reference recogniser) reads ``train``, so the held-out
speaker's voice is never trained on, and the harness can report recognition of a speaker the model has
never heard next to the seen speakers' test split.

References:
  - Z. Jackson et al., Free Spoken Digit Dataset, github.com/Jakobovski/free-spoken-digit-dataset (the
    standard split: index 0-4 test, 5-49 train; ``metadata.py`` there gives each speaker's accent).
  - K. Ito and L. Johnson, The LJ Speech Dataset, 2017 (keithito.com/LJ-Speech-Dataset).

Deviations:
  1. Only the five speakers of :data:`FSDD_SPEAKERS` are read (the shared copy has no ``lucas``); other
     files under ``fsdd/recordings`` are ignored, so a fuller FSDD checkout gives the same splits.
  2. One speaker (:data:`FSDD_UNSEEN_SPEAKER`) is taken out of both standard splits and kept for
     unseen-speaker evaluation, so ``train`` has 4 x 450 and ``test`` 4 x 50 recordings in the shared copy
     (the standard split is per utterance: every speaker is in train and test).
  3. FSDD has no multi-digit utterances; :func:`fsdd_sequences` synthesises them by concatenation
     (silences of 50-150 ms between the words), which has none of the coarticulation of connected speech.
  4. LJSpeech clips are resampled from 22.05 kHz to 8 kHz (telephone band), which removes everything
     above 4 kHz; transcripts are normalised, so numbers are read digit by digit ("1884" is
     "one eight eight four"), not as spoken ("eighteen eighty-four").
"""

from __future__ import annotations

import hashlib
import random
import re
import unicodedata
import wave as wavelib
from dataclasses import dataclass
from math import gcd
from pathlib import Path
from typing import Literal

import numpy as np
from scipy.signal import resample_poly

from ernie5.data.root import DataMissing, require_file
from ernie5.data.text import DataCorrupt

SAMPLE_RATE = 8000
"""Sample rate (Hz) of every :class:`Utterance`."""
DIGIT_WORDS: tuple[str, ...] = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
)
"""The word for each digit 0..9, as :func:`normalize_text` spells it."""
FSDD_SPEAKERS: tuple[str, ...] = ("george", "jackson", "nicolas", "theo", "yweweler")
"""The FSDD speakers read by :func:`fsdd_utterances` (see Deviations); the order fixes TTS speaker ids."""
FSDD_UNSEEN_SPEAKER = "theo"
"""The speaker held out of training entirely (split ``unseen``), for unseen-speaker evaluation.

Chosen by a fixed rule over :data:`FSDD_SPEAKERS` and their accents (FSDD ``metadata.py``: george GRC,
jackson USA, nicolas BEL/French, theo USA, yweweler DEU): hold out a speaker whose accent another speaker
shares, so training keeps every accent of the data and the unseen-speaker score measures a new *voice*
rather than a never-heard accent; USA/neutral (jackson, theo) is the only shared accent, and of the two
the later name in sorting order is held out."""
FSDD_TRAIN_SPEAKERS: tuple[str, ...] = tuple(s for s in FSDD_SPEAKERS if s != FSDD_UNSEEN_SPEAKER)
"""The "seen" speakers: those of the ``train`` and ``test`` splits (the only ones with TTS speaker ids)."""
FSDD_DIR = "fsdd/recordings"
FSDD_INDICES = 50
"""Recordings per speaker and digit (index 0..49)."""
FSDD_TEST_INDICES = range(0, 5)
"""Indices of the standard FSDD test split; 5..49 are train."""
FSDD_HOW_TO_GET = (
    "git clone https://github.com/Jakobovski/free-spoken-digit-dataset and copy its recordings/*.wav "
    "-> <root>/fsdd/recordings/"
)
"""One-line instruction shown when FSDD is missing."""
LJSPEECH_METADATA = "ljspeech_mini/metadata.csv"
LJSPEECH_HOW_TO_GET = (
    "LJ001-0001..0032.wav from github.com/coqui-ai/TTS tests/data/ljspeech/wavs "
    "-> <root>/ljspeech_mini/wavs/ and their transcripts as "
    "id|duration_s|text -> <root>/ljspeech_mini/metadata.csv"
)
"""One-line instruction shown when the LJSpeech sample is missing."""

_FSDD_NAME = re.compile(r"^(\d)_([a-z]+)_(\d+)\.wav$")
_SYMBOL_WORDS = {"*": " star ", "#": " pound "} | {str(d): f" {w} " for d, w in enumerate(DIGIT_WORDS)}


@dataclass(frozen=True, eq=False)
class Utterance:
    """A transcribed mono waveform: ``wave`` ``float32 (S,)`` in [-1, 1] at :data:`SAMPLE_RATE`, ``text``
    normalised (:func:`normalize_text`), ``source`` one of ``fsdd | fsdd_seq | ljspeech | dtmf``, ``uid``
    a stable id (the same data and seed give the same uid). Compared and hashed by identity (``eq=False``:
    field-wise ``==`` on arrays is ambiguous); compare ``uid`` or the arrays explicitly."""

    wave: np.ndarray
    text: str
    speaker: str
    source: str
    uid: str

    @property
    def duration_s(self) -> float:
        """Length in seconds at :data:`SAMPLE_RATE`."""
        return len(self.wave) / SAMPLE_RATE


def normalize_text(s: str) -> str:
    """The one text normaliser for ASR/TTS scoring (applied to references and hypotheses alike).

    In order: Unicode NFKD with accents dropped (``café`` -> ``cafe``); lowercase; every digit 0-9 becomes
    its own word (``"42"`` -> ``"four two"``, ``"3rd"`` -> ``"three rd"``), ``*`` becomes ``star`` and ``#``
    becomes ``pound`` (DTMF keys); apostrophes are deleted (``don't`` -> ``dont``); every other character
    that is not ``a-z`` (punctuation, hyphens, symbols) becomes a space; runs of whitespace collapse to one
    space and the ends are stripped. Idempotent: ``normalize_text(normalize_text(s)) == normalize_text(s)``.
    """
    s = unicodedata.normalize("NFKD", s)
    s = "".join(c for c in s if not unicodedata.combining(c)).lower()
    s = "".join(_SYMBOL_WORDS.get(c, c) for c in s)
    s = re.sub(r"['\u2019]", "", s)
    s = re.sub(r"[^a-z]+", " ", s)
    return s.strip()


def resample(x: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Band-limited resampling of a 1-D signal (``scipy.signal.resample_poly``, Kaiser-windowed FIR);
    returns ``float32``. ``len(out) == ceil(len(x) * target_sr / orig_sr)``."""
    x = np.asarray(x, dtype=np.float32)
    if orig_sr == target_sr:
        return x
    g = gcd(int(orig_sr), int(target_sr))
    return resample_poly(x, target_sr // g, orig_sr // g).astype(np.float32)


MIN_RATE, MAX_RATE = 1000, 384_000
"""The sample rates :func:`read_wav` accepts: the resampled clip is then at most ``target_sr / 1000``
times the file's samples (a header claiming 2 GHz asked for a 128 GiB array)."""


def read_wav(path: str | Path, target_sr: int = SAMPLE_RATE) -> np.ndarray:
    """A PCM WAV file as ``float32 (S,)`` in [-1, 1] at ``target_sr``.

    Reads 8-bit (unsigned), 16-, 24- and 32-bit (signed) integer PCM with the stdlib :mod:`wave` module;
    several channels are averaged to mono; other rates are resampled with :func:`resample`.

    Raises:
        DataCorrupt: not a readable PCM WAV file (e.g. float or compressed samples).
    """
    path = Path(path)
    try:
        with wavelib.open(str(path), "rb") as f:
            n_channels, width, rate, n_frames = (
                f.getnchannels(),
                f.getsampwidth(),
                f.getframerate(),
                f.getnframes(),
            )
            raw = f.readframes(n_frames)
    except (wavelib.Error, EOFError, RuntimeError, ValueError) as e:  # wave's seek raises RuntimeError
        raise DataCorrupt(path, None, f"not a readable PCM WAV file ({e or type(e).__name__})") from None
    if not MIN_RATE <= rate <= MAX_RATE or n_channels < 1:
        raise DataCorrupt(
            path,
            None,
            f"a header of {n_channels} channel(s) at {rate} Hz (expected {MIN_RATE}-{MAX_RATE} Hz)",
        )
    if width in (1, 2, 3, 4) and len(raw) % width:
        raise DataCorrupt(path, None, f"{len(raw)} data bytes are not whole {width}-byte samples")
    if width == 1:
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = (np.frombuffer(raw, dtype="<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
    else:
        raise DataCorrupt(path, None, f"unsupported sample width {width} bytes")
    if len(x) % n_channels:
        raise DataCorrupt(path, None, f"{len(x)} samples do not divide into {n_channels} channels")
    x = x.reshape(-1, n_channels).mean(axis=1, dtype=np.float32)
    return np.clip(resample(x, rate, target_sr), -1.0, 1.0)


def _fsdd_dir(root: str | Path | None) -> Path:
    if root is None or not (Path(root) / FSDD_DIR).is_dir():
        raise DataMissing(FSDD_DIR + "/", None if root is None else Path(root), FSDD_HOW_TO_GET)
    return Path(root) / FSDD_DIR


FsddSplit = Literal["train", "test", "unseen"]
"""``train`` (seen speakers, index 5-49), ``test`` (seen speakers, index 0-4), ``unseen`` (every recording
of :data:`FSDD_UNSEEN_SPEAKER`)."""


def fsdd_files(root: str | Path | None, split: FsddSplit) -> list[tuple[int, str, int, Path]]:
    """``(digit, speaker, index, path)`` of every FSDD recording of ``split`` (:data:`FsddSplit`), sorted by
    (digit, speaker, index). Raises :class:`DataMissing` when the directory or all of its files are absent."""
    if split not in ("train", "test", "unseen"):
        raise ValueError(f"FSDD split={split!r}: expected train|test|unseen")
    folder = _fsdd_dir(root)
    out = []
    for p in folder.iterdir():
        m = _FSDD_NAME.match(p.name)
        if m is None or m.group(2) not in FSDD_SPEAKERS:
            continue
        digit, speaker, index = int(m.group(1)), m.group(2), int(m.group(3))
        if split == "unseen":
            keep = speaker == FSDD_UNSEEN_SPEAKER
        else:
            keep = speaker != FSDD_UNSEEN_SPEAKER and (index in FSDD_TEST_INDICES) == (split == "test")
        if keep:
            out.append((digit, speaker, index, p))
    if not out:
        raise DataMissing(f"{FSDD_DIR}/*_<speaker>_<index>.wav", Path(root), FSDD_HOW_TO_GET)
    return sorted(out)


def fsdd_utterances(root: str | Path | None, split: FsddSplit) -> list[Utterance]:
    """Every FSDD recording of ``split`` (seen speakers' index 0-4 test, 5-49 train; ``unseen``: the held-out
    speaker's every recording, see :data:`FsddSplit`) as an :class:`Utterance` with text the
    digit word, source ``fsdd`` and uid ``fsdd/{digit}_{speaker}_{index}``; sorted by (digit, speaker, index).

    Raises:
        DataMissing: no FSDD recordings under ``root``.
        DataCorrupt: a recording is not a readable PCM WAV.
    """
    return [
        Utterance(read_wav(p), DIGIT_WORDS[d], spk, "fsdd", f"fsdd/{d}_{spk}_{i}")
        for d, spk, i, p in fsdd_files(root, split)
    ]


def concat_utterances(
    parts: list[Utterance], rng: random.Random, gap_s: tuple[float, float] = (0.05, 0.15)
) -> Utterance:
    """``parts`` joined in order, with a silence of ``rng.uniform(*gap_s)`` seconds between neighbours.

    The text is the parts' texts joined by spaces; the speaker is the common speaker (else the sorted
    distinct speakers joined by ``+``); the source is ``fsdd_seq`` when every part is ``fsdd``, else the
    common source, else ``mixed``; the uid is ``concat-`` and a hash of the part uids and gap lengths.
    """
    if not parts:
        raise ValueError("concat_utterances needs at least one part")
    lo, hi = gap_s
    if not 0 <= lo <= hi:
        raise ValueError(f"gap_s must satisfy 0 <= low <= high, got {gap_s}")
    gaps = [round(rng.uniform(lo, hi) * SAMPLE_RATE) for _ in parts[1:]]
    pieces: list[np.ndarray] = [np.asarray(parts[0].wave, dtype=np.float32)]
    for gap, part in zip(gaps, parts[1:]):
        pieces += [np.zeros(gap, dtype=np.float32), np.asarray(part.wave, dtype=np.float32)]
    speakers = sorted({p.speaker for p in parts})
    sources = {p.source for p in parts}
    source = "fsdd_seq" if sources == {"fsdd"} else (sources.pop() if len(sources) == 1 else "mixed")
    key = "|".join(p.uid for p in parts) + "|" + ",".join(map(str, gaps))
    return Utterance(
        wave=np.concatenate(pieces),
        text=" ".join(p.text for p in parts if p.text),
        speaker="+".join(speakers),
        source=source,
        uid="concat-" + hashlib.sha1(key.encode()).hexdigest()[:12],
    )


def sequences_from(
    utterances: list[Utterance],
    n: int,
    min_digits: int = 2,
    max_digits: int = 4,
    seed: int = 0,
    gap_s: tuple[float, float] = (0.05, 0.15),
    uid_prefix: str = "seq",
) -> list[Utterance]:
    """``n`` concatenations of ``min_digits..max_digits`` distinct utterances of one speaker each (the
    speaker drawn uniformly, then the utterances), seeded by ``seed``; uid ``{uid_prefix}/{i}``."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    by_speaker: dict[str, list[Utterance]] = {}
    for u in utterances:
        by_speaker.setdefault(u.speaker, []).append(u)
    speakers = sorted(by_speaker)
    if not speakers:
        raise ValueError("sequences_from needs at least one utterance")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pool = by_speaker[rng.choice(speakers)]
        k = min(rng.randint(min_digits, max_digits), len(pool))
        seq = concat_utterances(rng.sample(pool, k), rng, gap_s)
        out.append(Utterance(seq.wave, seq.text, seq.speaker, seq.source, f"{uid_prefix}/{i}"))
    return out


def fsdd_sequences(
    root: str | Path | None,
    split: FsddSplit,
    n: int,
    min_digits: int = 2,
    max_digits: int = 4,
    seed: int = 0,
) -> list[Utterance]:
    """``n`` multi-digit utterances ("four one nine"), each ``min_digits..max_digits`` distinct recordings
    of ONE speaker from ``split`` joined with 50-150 ms silences (:func:`concat_utterances`). Source
    ``fsdd_seq``, uid ``fsdd_seq/{split}/{seed}/{i}``; the same root, arguments and seed give the same list.

    Raises:
        DataMissing: no FSDD recordings under ``root``.
    """
    utts = fsdd_utterances(root, split)
    return sequences_from(utts, n, min_digits, max_digits, seed, uid_prefix=f"fsdd_seq/{split}/{seed}")


def ljspeech_utterances(root: str | Path | None) -> list[Utterance]:
    """The LJSpeech sample in ``metadata.csv`` order, resampled to 8 kHz, text normalised, speaker
    ``ljspeech``, source ``ljspeech``, uid the LJSpeech id (``LJ001-0001``).

    Raises:
        DataMissing: ``metadata.csv`` or a listed WAV is not under ``root``.
        DataCorrupt: a metadata line is not ``id|duration_s|text`` or a WAV is unreadable.
    """
    meta = require_file(root, LJSPEECH_METADATA, LJSPEECH_HOW_TO_GET)
    out = []
    for line_no, line in enumerate(meta.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or (line_no == 1 and line.startswith("id|")):
            continue
        fields = line.split("|")
        if len(fields) < 3:
            raise DataCorrupt(meta, line_no, f"expected id|duration_s|text, got {len(fields)} field(s)")
        uid, text = fields[0].strip(), "|".join(fields[2:])
        wav = require_file(root, f"ljspeech_mini/wavs/{uid}.wav", LJSPEECH_HOW_TO_GET)
        out.append(Utterance(read_wav(wav), normalize_text(text), "ljspeech", "ljspeech", uid))
    return out
