"""Synthetic voices (eSpeak NG through espeakng-loader, in the test extra) and speech augmentation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ernie5.data import voices
from ernie5.data.audio import SAMPLE_RATE

needs_espeak = pytest.mark.skipif(not voices.available(), reason=voices.HOW_TO_GET)


@needs_espeak
def test_synthesize_speaks_in_the_voice() -> None:
    low = voices.synthesize("seven", voices.Voice("en-us", "", 140, 10, 30))
    high = voices.synthesize("seven", voices.Voice("en-us", "", 140, 90, 30))
    slow = voices.synthesize("one two three four", voices.Voice("en", "", 110))
    fast = voices.synthesize("one two three four", voices.Voice("en", "", 220))
    for w in (low, high, slow, fast):
        assert w.dtype == np.float32 and w.ndim == 1 and abs(np.abs(w).max() - 0.5) < 1e-3
    assert 0.3 * SAMPLE_RATE < len(low) < 1.5 * SAMPLE_RATE
    assert len(slow) > 1.4 * len(fast)  # rate is words per minute

    def spectrum(w: np.ndarray) -> np.ndarray:
        s = np.abs(np.fft.rfft(w, 16384))
        return s / np.linalg.norm(s)

    assert float(spectrum(low) @ spectrum(high)) < 0.9  # another pitch, another spectrum


@needs_espeak
def test_bad_voice_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="voice 'xx-nowhere': not an eSpeak NG voice"):
        voices.synthesize("one", voices.Voice("xx-nowhere"))


@needs_espeak
def test_random_voices_cover_accents_and_variants() -> None:
    rng = random.Random(0)
    drawn = [voices.random_voice(rng) for _ in range(400)]
    assert {v.accent for v in drawn} == set(voices.ACCENTS)
    assert len({v.variant for v in drawn}) > 50 and len(voices.variants()) > 50
    assert len({v.name for v in drawn}) == 400
    assert drawn == [voices.random_voice(r) for r in [random.Random(0)] for _ in range(400)]


@needs_espeak
def test_digit_sequences_are_transcribed_digit_words() -> None:
    utts = voices.synthetic_digit_sequences(6, min_digits=2, max_digits=3, seed=5)
    again = voices.synthetic_digit_sequences(6, min_digits=2, max_digits=3, seed=5)
    assert [u.text for u in utts] == [u.text for u in again] and [u.speaker for u in utts] == [
        u.speaker for u in again
    ]
    assert all(2 <= len(u.text.split()) <= 3 and u.source == "espeak" for u in utts)
    assert [u.uid for u in utts] == [f"espeak/5/{i}" for i in range(6)]
    with pytest.raises(ValueError, match="min_digits <= max_digits"):
        voices.synthetic_digit_sequences(1, min_digits=3, max_digits=2)


@needs_espeak
def test_digit_corpus_is_read_back_exactly(tmp_path, monkeypatch) -> None:
    path = tmp_path / "c" / "voices.npz"
    first = voices.digit_corpus(path, 4, seed=2)
    assert path.is_file() and not list(path.parent.glob(".*tmp*"))
    calls = []
    monkeypatch.setattr(voices, "synthetic_digit_sequences", lambda *a: calls.append(a) or [])
    again = voices.digit_corpus(path, 4, seed=2)  # read from the file: the same samples, bit for bit
    assert not calls
    assert all(
        np.array_equal(a.wave, b.wave) and (a.text, a.speaker, a.uid) == (b.text, b.speaker, b.uid)
        for a, b in zip(first, again)
    )
    voices.digit_corpus(path, 5, seed=2)  # other arguments: made again
    assert calls == [(5, 1, 5, 2)]


def test_digit_corpus_without_espeak(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(voices, "available", lambda: False)

    def refuse():
        raise voices.VoicesUnavailable(f"eSpeak NG is not installed; to get it: {voices.HOW_TO_GET}")

    monkeypatch.setattr(voices, "_engine", refuse)
    with pytest.raises(voices.VoicesUnavailable, match=r"ernie5\[voices\]"):
        voices.digit_corpus(tmp_path / "v.npz", 2)


def test_augment_speech_is_seeded_bounded_and_changes_the_wave() -> None:
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    wave = (0.4 * np.sin(2 * np.pi * 220 * t) * (t < 0.6)).astype(np.float32)
    a = voices.augment_speech(wave, np.random.default_rng(1))
    b = voices.augment_speech(wave, np.random.default_rng(1))
    c = voices.augment_speech(wave, np.random.default_rng(2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.dtype == np.float32 and np.abs(a).max() <= 1.0
    off = voices.SpeechAugment(speed_p=0, room_p=0, tilt_p=0, noise_p=0, gain_db=(0.0, 0.0))
    same = voices.augment_speech(wave, np.random.default_rng(0), off)
    np.testing.assert_allclose(same, wave / np.abs(wave).max() * 0.5, atol=1e-6)  # only the level
    fast = voices.SpeechAugment(speed_p=1, speed=(1.25, 1.25), room_p=0, tilt_p=0, noise_p=0)
    assert len(voices.augment_speech(wave, np.random.default_rng(0), fast)) == round(len(wave) / 1.25)
    noisy = voices.SpeechAugment(
        speed_p=0, room_p=0, tilt_p=0, noise_p=1, snr_db=(10.0, 10.0), gain_db=(0.0, 0.0)
    )
    n = voices.augment_speech(wave, np.random.default_rng(0), noisy) - same
    snr = 10 * np.log10(np.mean(same**2) / np.mean(n**2))
    assert abs(snr - 10.0) < 0.5
