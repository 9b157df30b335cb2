"""DTMF world: tones at the keypad frequencies, seeded sequences, and the exact Goertzel decoder."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ernie5.data.audio import SAMPLE_RATE, fsdd_utterances, normalize_text
from ernie5.data.dtmf import (
    COL_FREQS,
    DTMF_KEYS,
    KEY_FREQS,
    ROW_FREQS,
    dtmf_sequences,
    dtmf_tone,
    dtmf_utterance,
    frame_keys,
    goertzel_decode,
    goertzel_power,
)


def test_keypad_frequencies():
    assert KEY_FREQS["1"] == (697.0, 1209.0) and KEY_FREQS["0"] == (941.0, 1336.0)
    assert KEY_FREQS["*"] == (941.0, 1209.0) and KEY_FREQS["#"] == (941.0, 1477.0)
    assert KEY_FREQS["9"] == (852.0, 1477.0) and KEY_FREQS["D"] == (941.0, 1633.0)
    assert set(DTMF_KEYS) == set("0123456789*#")


@pytest.mark.parametrize("key", list(DTMF_KEYS))
def test_tone_spectrum_and_level(key):
    x = dtmf_tone(key, 0.1, amplitude=0.5, twist_db=2.0)
    assert x.dtype == np.float32 and x.shape == (800,) and np.abs(x).max() <= 0.5 + 1e-6
    spec = np.abs(np.fft.rfft(x, 8000))  # 1 Hz bins
    low, high = 600 + int(np.argmax(spec[600:1100])), 1100 + int(np.argmax(spec[1100:1800]))
    assert (low, high) == tuple(int(f) for f in KEY_FREQS[key])
    assert spec[high] / spec[low] == pytest.approx(10 ** (2 / 20), rel=0.05)  # twist: column 2 dB louder
    assert x[0] == pytest.approx(0, abs=0.01) and x[-1] == pytest.approx(0, abs=0.01)  # faded ends
    with pytest.raises(ValueError):
        dtmf_tone("x", 0.1)


def test_goertzel_power_is_amplitude_squared():
    t = np.arange(160) / SAMPLE_RATE
    frames = np.stack([0.3 * np.sin(2 * np.pi * 770 * t + 1.0), np.zeros(160)])
    p = goertzel_power(frames, ROW_FREQS, SAMPLE_RATE)
    assert p.shape == (2, 4) and p[0, 1] == pytest.approx(0.09, rel=0.02) and p[1].max() == 0
    assert p[0, 1] > 10 * max(p[0, 0], p[0, 2], p[0, 3])


def test_utterance_and_sequences_are_seeded():
    u = dtmf_utterance("4#0", random.Random(5))
    assert u.text == "four pound zero" and u.speaker == u.source == "dtmf"
    assert u.wave.dtype == np.float32 and np.abs(u.wave).max() <= 1
    assert np.array_equal(u.wave, dtmf_utterance("4#0", random.Random(5)).wave)
    seqs = dtmf_sequences(30, 2, 5, seed=1)
    assert [s.uid for s in seqs] == [f"dtmf/1/{i}" for i in range(30)]
    assert all(2 <= len(s.text.split()) <= 5 for s in seqs)
    again = dtmf_sequences(30, 2, 5, seed=1)
    assert all(np.array_equal(a.wave, b.wave) for a, b in zip(seqs, again))
    assert [s.text for s in dtmf_sequences(30, 2, 5, seed=2)] != [s.text for s in seqs]
    digits_only = dtmf_sequences(50, seed=0, keys="0123456789")
    assert all(w not in ("star", "pound") for s in digits_only for w in s.text.split())
    clean = dtmf_utterance("5", random.Random(0), snr_db=None, gap_s=(0.05, 0.05))
    assert np.all(clean.wave[:400] == 0) and np.all(clean.wave[-400:] == 0)
    with pytest.raises(ValueError):
        dtmf_utterance("12x", random.Random(0))


def test_goertzel_decodes_every_sequence_exactly():
    """Exact on 600 seeded utterances: 1-8 keys, repeated keys, clean, 30 dB and 10 dB SNR."""
    n_exact = total = 0
    for seed, snr in ((0, 30.0), (1, None), (2, 10.0)):
        for u in dtmf_sequences(200, 1, 8, seed=seed, snr_db=snr):
            n_exact += normalize_text(goertzel_decode(u.wave)) == u.text
            total += 1
    assert n_exact == total == 600


def test_goertzel_repeated_keys_and_edge_cases():
    rng = random.Random(0)
    assert goertzel_decode(dtmf_utterance("1111", rng).wave) == "1111"
    assert goertzel_decode(dtmf_utterance("*#*#", rng, tone_s=(0.05, 0.05)).wave) == "*#*#"
    assert goertzel_decode(dtmf_tone("D", 0.1)) == "D"  # the fourth column is measured, not misread
    assert goertzel_decode(np.zeros(0)) == "" and frame_keys(np.zeros(50)) == []


def test_goertzel_rejects_silence_noise_and_chords():
    noise = np.random.default_rng(0)
    assert goertzel_decode(np.zeros(SAMPLE_RATE)) == ""
    for sigma in (1e-3, 0.05, 0.5):
        assert goertzel_decode(np.clip(noise.standard_normal(5 * SAMPLE_RATE) * sigma, -1, 1)) == ""
    t = np.arange(SAMPLE_RATE // 5) / SAMPLE_RATE
    single = 0.4 * np.sin(2 * np.pi * ROW_FREQS[0] * t)  # one tone only: not a key
    chord = sum(0.2 * np.sin(2 * np.pi * f * t) for f in ROW_FREQS[:2] + COL_FREQS[:1])  # two rows
    quiet = dtmf_tone("5", 0.2, amplitude=0.005)  # below min_amplitude
    assert goertzel_decode(single) == goertzel_decode(chord) == goertzel_decode(quiet) == ""


def test_goertzel_hears_no_keys_in_speech(data_root):
    if not (data_root / "fsdd" / "recordings").is_dir():
        pytest.skip(f"no FSDD under {data_root}")
    assert all(goertzel_decode(u.wave) == "" for u in fsdd_utterances(data_root, "test"))
