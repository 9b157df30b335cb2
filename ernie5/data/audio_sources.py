"""Speech and tone documents for the pretraining mixture (recognition, synthesis, understanding).

Every source draws one :class:`AudioDoc` per call from a seeded generator: a waveform (8 kHz) and
the text around it. The stream encodes a micro-batch's waveforms with the frozen codec in one call
and lays them out as audio segments. The prompt and answer formats are the ones the harness's audio
tasks use (the ``evals/tasks/audio_*.py`` modules import them from here), so training and evaluation agree:

  * recognition: ``BOA <frames> EOA Transcript: seven three`` (the frames are input only);
  * synthesis (TTS): ``Say: seven three. BOA <speaker> <frames> EOA`` with Next-Codec-Prediction
    targets on the frames (``Dial: five star.`` for keypad tones, which have no speaker);
  * understanding: ``BOA <frames> EOA Question: Which digit is spoken?\\nAnswer: seven`` and
    ``Who is speaking?``.

Sources: ``dtmf`` (procedural keypad tones: always available, what a fresh machine trains on) and
``fsdd`` (the FSDD train split: single digits and multi-digit sequences of one speaker built with
a seed; the test split, which the harness scores, is never read, and neither is any recording of the
held-out speaker ``ernie5.data.audio.FSDD_UNSEEN_SPEAKER``, whose voice the harness's unseen-speaker
scores are measured on).

Two sources widen the voices the understanding documents are heard in (speaker independence; no
generation document is ever in a synthetic or perturbed voice, so TTS still imitates real speakers):
``fsdd_varied`` draws ``fsdd``'s documents but passes the waveform of every recognition and
spoken-digit document through :func:`ernie5.data.voices.augment_speech` (speed, room, tilt, gain,
noise); ``espeak`` asks for the transcript or the digit of eSpeak NG speech in random accents, voice
variants and prosody (:func:`ernie5.data.voices.digit_corpus`: ``ESPEAK_UTTERANCES`` utterances made
once into ``$ERNIE5_CACHE_DIR/voices/``, so every run and resume hears the same waves), augmented too.

Speaker ids (the TTS ``<speaker>`` start position) are the seen speakers' positions in
``FSDD_SPEAKERS`` (unchanged by the hold-out, so the rows of the seen speakers stay where they were);
the held-out speaker has none (:func:`speaker_id` gives -1 for it).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPEAKER_QUESTION = "Who is speaking?"
DIGIT_SPOKEN_QUESTION = "Which digit is spoken?"


@dataclass
class AudioDoc:
    """One audio document before tokenization."""

    kind: str
    """``und`` (audio then text) or ``gen`` (prompt then audio with NCP targets)."""
    wave: np.ndarray
    """float32 ``(S,)`` at 8 kHz in [-1, 1]."""
    prompt: str = ""
    text: str = ""
    speaker: int = -1
    """Speaker id of a ``gen`` document's start position (-1 = generic start)."""


def speaker_id(name: str) -> int:
    """The speaker-embedding row of a seen FSDD speaker (its index in ``FSDD_SPEAKERS``); -1 for anything
    else: DTMF, unknown names and the held-out ``FSDD_UNSEEN_SPEAKER``, which is never trained on."""
    from ernie5.data.audio import FSDD_SPEAKERS, FSDD_TRAIN_SPEAKERS

    return FSDD_SPEAKERS.index(name) if name in FSDD_TRAIN_SPEAKERS else -1


def transcript_text(text: str) -> str:
    """What follows recognised audio: ``Transcript: <normalised words>``."""
    return f"Transcript: {text}\n"


TRANSCRIPT_PREFIX = "Transcript:"


def say_prompt(text: str) -> str:
    """The TTS prompt of speech."""
    return f"Say: {text}."


def dial_prompt(text: str) -> str:
    """The TTS prompt of keypad tones (``text`` is the normalised key words)."""
    return f"Dial: {text}."


def _qa(question: str, answer: str) -> str:
    from ernie5.data.vision_sources import qa_text

    return qa_text(question, answer)


def _dtmf(rng: random.Random, _data) -> AudioDoc:
    from ernie5.data.dtmf import DTMF_KEYS, dtmf_utterance

    keys = "".join(rng.choice(DTMF_KEYS) for _ in range(rng.randint(1, 5)))
    u = dtmf_utterance(keys, rng)
    if rng.random() < 0.5:
        return AudioDoc("gen", u.wave, prompt=dial_prompt(u.text))
    return AudioDoc("und", u.wave, text=transcript_text(u.text))


def _fsdd(rng: random.Random, data) -> AudioDoc:
    from ernie5.data.audio import concat_utterances

    by_speaker, speakers = data
    spk = rng.choice(speakers)
    pool = by_speaker[spk]
    single = rng.random() < 0.5
    parts = [rng.choice(pool)] if single else rng.sample(pool, rng.randint(2, 4))
    u = parts[0] if single else concat_utterances(parts, rng)
    pick = rng.random()
    if pick < 0.4:
        return AudioDoc("gen", u.wave, prompt=say_prompt(u.text), speaker=speaker_id(spk))
    if pick < 0.8 or not single:
        return AudioDoc("und", u.wave, text=transcript_text(u.text))
    if pick < 0.9:
        return AudioDoc("und", u.wave, text=_qa(DIGIT_SPOKEN_QUESTION, u.text))
    return AudioDoc("und", u.wave, text=_qa(SPEAKER_QUESTION, spk))


def _heard(rng: random.Random, wave: np.ndarray) -> np.ndarray:
    from ernie5.data.voices import augment_speech

    return augment_speech(wave, np.random.default_rng(rng.randrange(2**63)))


def _fsdd_varied(rng: random.Random, data) -> AudioDoc:
    doc = _fsdd(rng, data)
    if doc.kind == "gen" or SPEAKER_QUESTION in doc.text:
        return doc  # the voice is what these documents are about
    return AudioDoc("und", _heard(rng, doc.wave), text=doc.text)


def _espeak(rng: random.Random, corpus) -> AudioDoc:
    u = rng.choice(corpus)
    single = len(u.text.split()) == 1
    text = _qa(DIGIT_SPOKEN_QUESTION, u.text) if single and rng.random() < 0.3 else transcript_text(u.text)
    return AudioDoc("und", _heard(rng, u.wave), text=text)


ESPEAK_UTTERANCES = 3000
"""Synthetic utterances in the ``espeak`` source (1-5 digits each; ~2 ms each to make)."""


def _espeak_corpus(_data_dir: Path | None):
    from ernie5.data.voices import digit_corpus, voice_corpus_path

    return digit_corpus(voice_corpus_path(ESPEAK_UTTERANCES), ESPEAK_UTTERANCES, seed=0)


def speech_pools(
    root: Path | None,
    names: set[str],
    *,
    fsdd_seq_pool: int,
    seed: int,
    espeak_utterances: int = ESPEAK_UTTERANCES,
) -> dict:
    """Training utterances of the speech sources in ``names`` that the data root (or eSpeak NG) has, for
    the side-model trainers (codec, speech-content encoder); absent ones are left out:

    * ``fsdd``: the FSDD train split (seen speakers only); ``fsdd_seq``: ``fsdd_seq_pool`` sequences of
      2-4 of one speaker's train recordings (seeded by ``seed``; the recordings are read once);
    * ``espeak``: the cached eSpeak NG digit corpus of ``espeak_utterances`` (seed 0);
    * ``ljspeech``: the LJSpeech sample.

    Returns ``{name: [Utterance, ...]}``.
    """
    import contextlib

    from ernie5.data.audio import fsdd_utterances, ljspeech_utterances, sequences_from
    from ernie5.data.root import DataMissing
    from ernie5.data.voices import VoicesUnavailable, digit_corpus, voice_corpus_path

    pools: dict = {}
    if names & {"fsdd", "fsdd_seq"}:
        with contextlib.suppress(DataMissing):
            train = fsdd_utterances(root, "train")
            if "fsdd" in names:
                pools["fsdd"] = train
            if "fsdd_seq" in names:
                pools["fsdd_seq"] = sequences_from(train, fsdd_seq_pool, 2, 4, seed=seed)
    if "espeak" in names:
        with contextlib.suppress(VoicesUnavailable):
            pools["espeak"] = digit_corpus(voice_corpus_path(espeak_utterances), espeak_utterances, seed=0)
    if "ljspeech" in names:
        with contextlib.suppress(DataMissing):
            pools["ljspeech"] = ljspeech_utterances(root)
    return pools


def _fsdd_train(data_dir: Path | None):
    from ernie5.data.audio import fsdd_utterances

    by_speaker: dict[str, list] = {}
    # seen speakers' train split only: the harness scores their test split and the held-out speaker
    for u in fsdd_utterances(data_dir, "train"):
        by_speaker.setdefault(u.speaker, []).append(u)
    return by_speaker, sorted(by_speaker)


AUDIO_SOURCES: dict[str, tuple[Callable, Callable | None]] = {
    "dtmf": (_dtmf, None),
    "fsdd": (_fsdd, _fsdd_train),
    "fsdd_varied": (_fsdd_varied, _fsdd_train),
    "espeak": (_espeak, _espeak_corpus),
}
"""Source name -> (document function, loader of the data it needs or None)."""


def open_audio_source(name: str, data_dir: Path | None) -> Callable[[random.Random], AudioDoc]:
    """A document function for ``name`` (raises ``DataMissing`` when its data is absent)."""
    fn, loader = AUDIO_SOURCES[name]
    data = loader(data_dir) if loader is not None else None
    return lambda rng: fn(rng, data)
