"""Synthetic voices: eSpeak NG speech in many voices, and speech augmentation (speaker independence).

FSDD has four training speakers: a recogniser (or a codec) trained on them learns their voices as much as
their words. This module widens the voices two ways, so that what is learned is *what was said*:

* :func:`synthesize` speaks a text with eSpeak NG (formant synthesis, through the ``espeakng-loader``
  wheel, which ships the library and its voice data: no system package, no download). A :class:`Voice` is
  an English accent (:data:`ACCENTS`), an optional voice variant (eSpeak's ``!v`` folder: pitch contour,
  formant shifts, breathiness, ...), a rate, a pitch and a pitch range; :func:`random_voice` draws one from
  a seed, so the space of voices is large (7 accents x ~70 variants x prosody) and reproducible.
* :func:`augment_speech` perturbs any waveform the way rooms, microphones and speakers differ: speed
  (tempo and pitch together, as Kaldi's speed perturbation), a synthetic room impulse response
  (exponentially decaying noise, random RT60), a spectral tilt (one-tap pre-/de-emphasis), gain and
  additive white noise at a random SNR.

:func:`synthetic_digit_sequences` makes transcribed utterances of 1-5 spoken digits in random voices (the
FSDD vocabulary); they train the reference recogniser's teacher twin, the audio codec and the backbone's
speech understanding. No synthetic voice is used for speech *generation*, and no FSDD speaker is
imitated; the held-out FSDD speaker stays unheard.

References:
  * eSpeak NG, github.com/espeak-ng/espeak-ng (the synthesiser, its ``espeak_Synth`` API and voice
    variants); espeakng-loader, pypi.org/project/espeakng-loader (the packaged library and data).
  * T. Ko et al., "Audio augmentation for speech recognition", Interspeech 2015 (speed perturbation).
  * T. Ko et al., "A study on data augmentation of reverberant speech for robust speech recognition",
    ICASSP 2017 (simulated room impulse responses).

eSpeak NG's output is not bit-exact from one call to the next (its pitch jitter and frame timing move a
few samples, even with its random seed set), so a training corpus is synthesised once and read back from
a file: :func:`digit_corpus` keys the file by everything that made it, and a resumed run reads the same
waves it trained on.

Deviations:
  1. Formant synthesis is far from natural speech: it adds voice *variety* (pitch, formants, rate, accent)
     but not realism; it complements the recorded speakers, it does not replace them.
  2. Room impulse responses are exponentially decaying Gaussian noise (no image-source simulation) and the
     channel is a one-tap tilt, not measured microphone responses.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import random
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
from scipy.signal import fftconvolve, resample_poly

from ernie5.data.audio import DIGIT_WORDS, SAMPLE_RATE, Utterance

HOW_TO_GET = "pip install 'ernie5[voices]' (espeakng-loader: the eSpeak NG library and voices as a wheel)"
"""One-line instruction shown when eSpeak NG is not importable."""
ACCENTS: tuple[str, ...] = (
    "en",
    "en-us",
    "en-gb-scotland",
    "en-gb-x-rp",
    "en-gb-x-gbclan",
    "en-gb-x-gbcwmd",
    "en-029",
)
"""eSpeak NG's English accents (British, American, Scottish, Received Pronunciation, Lancastrian, West
Midlands, Caribbean)."""
ESPEAK_RATE = 22050
"""eSpeak NG's output sample rate (resampled to :data:`SAMPLE_RATE`)."""

_RATE, _PITCH, _RANGE, _WORDGAP = 1, 3, 4, 7  # espeak_PARAMETER values
_SYNCHRONOUS = 2  # AUDIO_OUTPUT_SYNCHRONOUS


class VoicesUnavailable(RuntimeError):
    """eSpeak NG cannot be loaded (the message is one line, with :data:`HOW_TO_GET`)."""


@dataclass(frozen=True)
class Voice:
    """One synthetic voice: accent, variant and prosody."""

    accent: str = "en"
    variant: str = ""
    """A name in eSpeak's ``voices/!v`` (``""`` = the accent's own voice)."""
    rate: int = 160
    """Words per minute."""
    pitch: int = 50
    """Base pitch, 0-100."""
    pitch_range: int = 50
    """Pitch range, 0-100 (0 = monotone)."""
    word_gap: int = 0
    """Extra pause between words, in units of 10 ms."""

    @property
    def name(self) -> str:
        """``accent+variant/rate/pitch/range/gap``: the voice's stable id."""
        v = f"{self.accent}+{self.variant}" if self.variant else self.accent
        return f"{v}/{self.rate}/{self.pitch}/{self.pitch_range}/{self.word_gap}"


class _Engine:
    """The process's eSpeak NG library (initialised once; synthesis is serialised by a lock)."""

    _CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)

    def __init__(self) -> None:
        try:
            import espeakng_loader
        except ImportError:
            raise VoicesUnavailable(f"eSpeak NG is not installed; to get it: {HOW_TO_GET}") from None
        self.data_path = espeakng_loader.get_data_path()
        try:
            lib = ctypes.CDLL(espeakng_loader.get_library_path())
        except OSError as e:
            raise VoicesUnavailable(
                f"eSpeak NG library does not load ({e}); to get it: {HOW_TO_GET}"
            ) from None
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        rate = lib.espeak_Initialize(_SYNCHRONOUS, 0, str(self.data_path).encode(), 0)
        if rate != ESPEAK_RATE:
            raise VoicesUnavailable(f"eSpeak NG did not initialise (rate {rate}); to get it: {HOW_TO_GET}")
        self._chunks: list[np.ndarray] = []
        self._callback = self._CALLBACK(self._collect)  # kept referenced for the library's lifetime
        lib.espeak_SetSynthCallback(self._callback)
        self.lib = lib
        self.lock = threading.Lock()

    def _collect(self, wav, n: int, _events) -> int:
        if n > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0

    def speak(self, text: str, voice: Voice) -> np.ndarray:
        """int16 samples at :data:`ESPEAK_RATE`."""
        with self.lock:
            self._chunks = []
            name = f"{voice.accent}+{voice.variant}" if voice.variant else voice.accent
            if self.lib.espeak_SetVoiceByName(name.encode()) != 0:
                raise ValueError(f"voice {name!r}: not an eSpeak NG voice")
            for param, value in ((_RATE, voice.rate), (_PITCH, voice.pitch), (_RANGE, voice.pitch_range)):
                self.lib.espeak_SetParameter(param, value, 0)
            self.lib.espeak_SetParameter(_WORDGAP, voice.word_gap, 0)
            data = (text + "\0").encode()
            self.lib.espeak_Synth(data, len(data), 0, 0, 0, 0, None, None)
            self.lib.espeak_Synchronize()
            chunks, self._chunks = self._chunks, []
        return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)


@cache
def _engine() -> _Engine:
    return _Engine()


def available() -> bool:
    """Whether eSpeak NG can be loaded here."""
    try:
        _engine()
    except VoicesUnavailable:
        return False
    return True


@cache
def variants() -> tuple[str, ...]:
    """The voice variants eSpeak NG ships (names in its ``voices/!v`` folder), sorted."""
    folder = os.path.join(_engine().data_path, "voices", "!v")
    return tuple(sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f))))


def random_voice(rng: random.Random) -> Voice:
    """A voice drawn from ``rng``: a uniform accent, a variant (or the accent's own voice, 1 in 8), rate
    110-220 wpm, pitch 10-90, range 10-90, word gap 0-12 (x 10 ms)."""
    accent = rng.choice(ACCENTS)
    pool = variants()
    variant = "" if rng.random() < 1 / 8 else rng.choice(pool)
    return Voice(
        accent, variant, rng.randint(110, 220), rng.randint(10, 90), rng.randint(10, 90), rng.randint(0, 12)
    )


def synthesize(text: str, voice: Voice) -> np.ndarray:
    """``text`` spoken in ``voice``: ``float32 (S,)`` at :data:`SAMPLE_RATE`, peak-normalised to 0.5,
    leading and trailing silence trimmed to 50 ms.

    Raises:
        VoicesUnavailable: eSpeak NG cannot be loaded.
        ValueError: ``voice`` names no eSpeak NG voice.
    """
    pcm = _engine().speak(text, voice).astype(np.float32) / 32768.0
    g = math.gcd(SAMPLE_RATE, ESPEAK_RATE)
    wave = resample_poly(pcm, SAMPLE_RATE // g, ESPEAK_RATE // g).astype(np.float32)
    loud = np.flatnonzero(np.abs(wave) > 0.01 * (np.abs(wave).max() + 1e-9))
    if loud.size:
        pad = SAMPLE_RATE // 20
        wave = wave[max(0, loud[0] - pad) : loud[-1] + pad]
    return (wave / (np.abs(wave).max() + 1e-9) * 0.5).astype(np.float32)


def synthetic_digit_sequences(
    n: int, min_digits: int = 1, max_digits: int = 5, seed: int = 0
) -> list[Utterance]:
    """``n`` utterances of ``min_digits..max_digits`` random digit words, each in a :func:`random_voice`
    (seeded); source ``espeak``, speaker the voice's name, uid ``espeak/{seed}/{i}``."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = " ".join(DIGIT_WORDS[rng.randrange(10)] for _ in range(rng.randint(min_digits, max_digits)))
        voice = random_voice(rng)
        out.append(Utterance(synthesize(text, voice), text, voice.name, "espeak", f"espeak/{seed}/{i}"))
    return out


CORPUS_FORMAT = 1


def _corpus_args(n: int, min_digits: int, max_digits: int, seed: int) -> dict:
    return {
        "format": CORPUS_FORMAT,
        "n": n,
        "min_digits": min_digits,
        "max_digits": max_digits,
        "seed": seed,
        "sample_rate": SAMPLE_RATE,
    }


def voice_corpus_path(n: int, seed: int = 0) -> Path:
    """Where the ``n``-utterance digit corpus of ``seed`` is cached:
    ``$ERNIE5_CACHE_DIR/voices/digits-{n}-s{seed}.npz`` (default cache ``~/.cache/ernie5``)."""
    cache = Path(os.environ.get("ERNIE5_CACHE_DIR", Path.home() / ".cache" / "ernie5"))
    return cache / "voices" / f"digits-{n}-s{seed}.npz"


def digit_corpus(
    path: str | Path, n: int, min_digits: int = 1, max_digits: int = 5, seed: int = 0
) -> list[Utterance]:
    """:func:`synthetic_digit_sequences`, synthesised once into ``path`` (an ``.npz``) and read back
    from it afterwards, so that every run (and every resume) with the same arguments hears the same waves.

    The file records its arguments and the eSpeak NG package version; a file made with others is
    rewritten. It is written to a temporary name and renamed, so a crash leaves no partial corpus.

    Raises:
        VoicesUnavailable: the corpus is not on disk and eSpeak NG cannot be loaded.
    """
    from importlib.metadata import version

    path = Path(path)
    args = _corpus_args(n, min_digits, max_digits, seed)
    key = {**args, "espeakng_loader": version("espeakng-loader")} if available() else None
    if path.is_file():
        with np.load(path, allow_pickle=False) as f:
            stored = json.loads(str(f["key"]))
            same_args = {k: v for k, v in stored.items() if k != "espeakng_loader"} == args
            if stored == key or (key is None and same_args):  # without eSpeak: any version's file
                lengths = f["lengths"]
                waves = np.split(f["samples"], np.cumsum(lengths)[:-1]) if len(lengths) else []
                return [
                    Utterance(w.astype(np.float32), t, s, "espeak", f"espeak/{seed}/{i}")
                    for i, (w, t, s) in enumerate(zip(waves, f["texts"].tolist(), f["speakers"].tolist()))
                ]
    if key is None:
        _engine()  # raises VoicesUnavailable with how to get it
    utts = synthetic_digit_sequences(n, min_digits, max_digits, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
    try:
        np.savez(
            tmp,
            key=json.dumps(key, sort_keys=True),
            samples=np.concatenate([u.wave for u in utts]) if utts else np.zeros(0, np.float32),
            lengths=np.array([len(u.wave) for u in utts], np.int64),
            texts=np.array([u.text for u in utts], dtype=str),
            speakers=np.array([u.speaker for u in utts], dtype=str),
        )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return utts


@dataclass(frozen=True)
class SpeechAugment:
    """Probabilities and ranges of :func:`augment_speech` (the defaults are the measured recipe)."""

    speed_p: float = 0.8
    speed: tuple[float, float] = (0.8, 1.25)
    """Speed factor range (> 1 = faster and higher)."""
    room_p: float = 0.5
    rt60_s: tuple[float, float] = (0.1, 0.6)
    tilt_p: float = 0.5
    tilt: float = 0.9
    """Largest pre-emphasis coefficient magnitude (positive brightens, negative darkens)."""
    noise_p: float = 0.7
    snr_db: tuple[float, float] = (10.0, 40.0)
    gain_db: tuple[float, float] = (-12.0, 3.0)


def augment_speech(
    wave: np.ndarray, rng: np.random.Generator, aug: SpeechAugment = SpeechAugment()
) -> np.ndarray:
    """``wave`` (float32, :data:`SAMPLE_RATE`) through a random speed, room, tilt, noise and gain; float32
    in [-1, 1]. The same ``rng`` state gives the same output."""
    x = np.asarray(wave, dtype=np.float64)
    if rng.random() < aug.speed_p:
        factor = rng.uniform(*aug.speed)
        x = resample_poly(x, 100, max(1, round(100 * factor)))
    if rng.random() < aug.room_p:
        n = max(2, int(rng.uniform(*aug.rt60_s) * SAMPLE_RATE))
        ir = rng.standard_normal(n) * np.exp(-6.9 * np.arange(n) / n)  # -60 dB at RT60
        ir[0] = 0.0
        ir = ir / (np.sqrt(np.sum(ir**2)) + 1e-9) * rng.uniform(0.2, 0.8)
        ir[0] = 1.0  # the direct path
        x = fftconvolve(x, ir)[: len(x)]
    if rng.random() < aug.tilt_p:
        a = rng.uniform(-aug.tilt, aug.tilt)
        x = x - a * np.concatenate([[0.0], x[:-1]])
    x = x / (np.abs(x).max() + 1e-9) * 0.5 * 10.0 ** (rng.uniform(*aug.gain_db) / 20.0)
    if rng.random() < aug.noise_p:
        power = float(np.mean(x**2)) + 1e-12
        x = x + rng.standard_normal(len(x)) * math.sqrt(power / 10.0 ** (rng.uniform(*aug.snr_db) / 10.0))
    return np.clip(x, -1.0, 1.0).astype(np.float32)
