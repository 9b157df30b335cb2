"""Speech readers: the text normaliser, WAV decoding and resampling, FSDD splits and sequences, LJSpeech."""

from __future__ import annotations

import random
import wave
from pathlib import Path

import numpy as np
import pytest

from ernie5.data.audio import (
    DIGIT_WORDS,
    FSDD_SPEAKERS,
    FSDD_TRAIN_SPEAKERS,
    FSDD_UNSEEN_SPEAKER,
    SAMPLE_RATE,
    Utterance,
    concat_utterances,
    fsdd_files,
    fsdd_sequences,
    fsdd_utterances,
    ljspeech_utterances,
    normalize_text,
    read_wav,
    resample,
)
from ernie5.data.root import DataMissing
from ernie5.data.text import DataCorrupt


def _write_wav(path: Path, frames: np.ndarray, rate: int, width: int, channels: int = 1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(frames.tobytes())
    return path


@pytest.fixture(scope="module")
def fsdd_root(data_root) -> Path:
    if not (data_root / "fsdd" / "recordings").is_dir():
        pytest.skip(f"no FSDD under {data_root}")
    return data_root


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Seven 3", "seven three"),
        ("42", "four two"),
        ("call 555-1234 now!", "call five five five one two three four now"),
        ("*#0", "star pound zero"),
        ("Don't  stop,\tbelieving.", "dont stop believing"),
        ("Café in 1884; 3rd", "cafe in one eight eight four three rd"),
        ("  ", ""),
        ("twenty-one", "twenty one"),
    ],
)
def test_normalize_text(raw, expected):
    assert normalize_text(raw) == expected
    assert normalize_text(expected) == expected  # idempotent


def test_read_wav_formats_stereo_and_resampling(tmp_path):
    t = np.arange(800) / SAMPLE_RATE
    ref = 0.5 * np.sin(2 * np.pi * 440 * t)
    pcm16 = np.round(ref * 32767).astype("<i2")
    x = read_wav(_write_wav(tmp_path / "a16.wav", pcm16, SAMPLE_RATE, 2))
    assert x.dtype == np.float32 and x.shape == (800,)
    np.testing.assert_allclose(x, ref, atol=1e-4)
    pcm8 = np.round(ref * 127 + 128).astype(np.uint8)
    np.testing.assert_allclose(
        read_wav(_write_wav(tmp_path / "a8.wav", pcm8, SAMPLE_RATE, 1)), ref, atol=1e-2
    )
    pcm32 = np.round(ref * (2**31 - 1)).astype("<i4")
    np.testing.assert_allclose(
        read_wav(_write_wav(tmp_path / "a32.wav", pcm32, SAMPLE_RATE, 4)), ref, atol=1e-6
    )
    stereo = np.stack([pcm16, np.zeros_like(pcm16)], axis=1)  # left = tone, right = silence
    np.testing.assert_allclose(
        read_wav(_write_wav(tmp_path / "st.wav", stereo, SAMPLE_RATE, 2, 2)), ref / 2, atol=1e-4
    )
    # 22.05 kHz -> 8 kHz keeps a 1 kHz tone at 1 kHz and its level; a 6 kHz tone is filtered out
    t22 = np.arange(22050) / 22050
    for f, level in ((1000, 0.5), (6000, 0.0)):
        pcm = np.round(0.5 * np.sin(2 * np.pi * f * t22) * 32767).astype("<i2")
        y = read_wav(_write_wav(tmp_path / f"r{f}.wav", pcm, 22050, 2))
        assert len(y) == SAMPLE_RATE
        rms = np.sqrt(np.mean(y[400:-400] ** 2)) * np.sqrt(2)
        assert rms == pytest.approx(level, abs=0.01)
    assert resample(np.ones(10), 8000, 8000).dtype == np.float32


def test_read_wav_rejects_non_wav(tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not a wave file at all")
    with pytest.raises(DataCorrupt):
        read_wav(bad)


def test_fsdd_missing_is_data_missing(tmp_path):
    for root in (None, tmp_path):
        with pytest.raises(DataMissing, match="fsdd"):
            fsdd_utterances(root, "train")
        with pytest.raises(DataMissing):
            fsdd_sequences(root, "test", 3)
    (tmp_path / "fsdd" / "recordings").mkdir(parents=True)
    with pytest.raises(DataMissing):  # directory present but empty
        fsdd_utterances(tmp_path, "test")
    with pytest.raises(DataMissing, match="ljspeech"):
        ljspeech_utterances(tmp_path)


def test_fsdd_on_a_synthetic_root(tmp_path):
    rec = tmp_path / "fsdd" / "recordings"
    for d in (3, 7):
        for i in (0, 4, 5, 12):
            _write_wav(rec / f"{d}_jackson_{i}.wav", np.full(100 + d, 1000 * d, "<i2"), SAMPLE_RATE, 2)
            _write_wav(rec / f"{d}_{FSDD_UNSEEN_SPEAKER}_{i}.wav", np.zeros(50, "<i2"), SAMPLE_RATE, 2)
    _write_wav(rec / "3_lucas_9.wav", np.zeros(10, "<i2"), SAMPLE_RATE, 2)  # not one of FSDD_SPEAKERS
    (rec / "README.txt").write_text("ignored")
    test, train = fsdd_utterances(tmp_path, "test"), fsdd_utterances(tmp_path, "train")
    assert [u.uid for u in test] == [
        "fsdd/3_jackson_0",
        "fsdd/3_jackson_4",
        "fsdd/7_jackson_0",
        "fsdd/7_jackson_4",
    ]
    assert [u.text for u in train] == ["three", "three", "seven", "seven"]
    assert train[0].wave.shape == (103,) and train[0].wave[0] == pytest.approx(3000 / 32768)
    seqs = fsdd_sequences(tmp_path, "test", 5, min_digits=2, max_digits=2, seed=1)
    assert all(s.source == "fsdd_seq" and s.speaker == "jackson" and len(s.text.split()) == 2 for s in seqs)
    # the held-out speaker: every index (test 0-4 and train 5-49 alike) is in `unseen`, none in train/test
    unseen = fsdd_utterances(tmp_path, "unseen")
    assert [u.uid for u in unseen] == [
        f"fsdd/{d}_{FSDD_UNSEEN_SPEAKER}_{i}" for d in (3, 7) for i in (0, 4, 5, 12)
    ]
    assert {u.speaker for u in unseen} == {FSDD_UNSEEN_SPEAKER}
    useq = fsdd_sequences(tmp_path, "unseen", 3, seed=1)
    assert all(s.speaker == FSDD_UNSEEN_SPEAKER and s.uid.startswith("fsdd_seq/unseen/") for s in useq)
    with pytest.raises(ValueError, match="train|test|unseen"):
        fsdd_files(tmp_path, "all")  # type: ignore[arg-type]


def test_a_root_with_only_the_unseen_speaker_has_no_train_or_test(tmp_path):
    rec = tmp_path / "fsdd" / "recordings"
    for i in (0, 7):
        _write_wav(rec / f"1_{FSDD_UNSEEN_SPEAKER}_{i}.wav", np.zeros(50, "<i2"), SAMPLE_RATE, 2)
    for split in ("train", "test"):
        with pytest.raises(DataMissing):
            fsdd_utterances(tmp_path, split)
    assert len(fsdd_utterances(tmp_path, "unseen")) == 2


def test_the_unseen_speaker_is_one_fixed_fsdd_speaker():
    assert FSDD_UNSEEN_SPEAKER == "theo" and FSDD_UNSEEN_SPEAKER in FSDD_SPEAKERS
    assert FSDD_TRAIN_SPEAKERS == ("george", "jackson", "nicolas", "yweweler")


def test_concat_utterances():
    a = Utterance(np.ones(100, np.float32), "one", "x", "fsdd", "a")
    b = Utterance(np.full(50, 0.5, np.float32), "two", "x", "fsdd", "b")
    c = concat_utterances([a, b, a], random.Random(0), gap_s=(0.05, 0.05))
    assert c.text == "one two one" and c.speaker == "x" and c.source == "fsdd_seq"
    assert len(c.wave) == 250 + 2 * 400 and c.wave[100:500].max() == 0
    assert c.uid == concat_utterances([a, b, a], random.Random(0), gap_s=(0.05, 0.05)).uid
    mixed = concat_utterances([a, Utterance(b.wave, "two", "y", "dtmf", "b")], random.Random(0))
    assert mixed.speaker == "x+y" and mixed.source == "mixed"
    with pytest.raises(ValueError):
        concat_utterances([], random.Random(0))


def test_fsdd_real_splits(fsdd_root):
    train, test = fsdd_utterances(fsdd_root, "train"), fsdd_utterances(fsdd_root, "test")
    unseen = fsdd_utterances(fsdd_root, "unseen")
    assert (len(train), len(test), len(unseen)) == (1800, 200, 500)
    assert not {u.uid for u in train} & {u.uid for u in test}
    assert {u.speaker for u in train} == {u.speaker for u in test} == set(FSDD_TRAIN_SPEAKERS)
    assert {u.speaker for u in unseen} == {FSDD_UNSEEN_SPEAKER}  # every index 0..49 of the held-out speaker
    assert sorted(int(u.uid.rsplit("_", 1)[1]) for u in unseen if u.text == "zero") == list(range(50))
    assert sorted({u.text for u in test}) == sorted(DIGIT_WORDS)
    assert all(u.wave.dtype == np.float32 and np.abs(u.wave).max() <= 1 for u in test)
    assert all(int(u.uid.rsplit("_", 1)[1]) < 5 for u in test)
    assert 0.1 < np.mean([u.duration_s for u in test]) < 1.0


def test_fsdd_sequences_one_speaker_one_split(fsdd_root):
    test_waves = {u.uid: u.wave for u in fsdd_utterances(fsdd_root, "test")}
    seqs = fsdd_sequences(fsdd_root, "test", 20, min_digits=2, max_digits=4, seed=3)
    again = fsdd_sequences(fsdd_root, "test", 20, min_digits=2, max_digits=4, seed=3)
    assert [s.uid for s in seqs] == [f"fsdd_seq/test/3/{i}" for i in range(20)]
    assert all(np.array_equal(s.wave, t.wave) and s.text == t.text for s, t in zip(seqs, again))
    assert [s.text for s in seqs] != [s.text for s in fsdd_sequences(fsdd_root, "test", 20, seed=4)]
    for s in seqs:
        words = s.text.split()
        assert 2 <= len(words) <= 4 and set(words) <= set(DIGIT_WORDS)
        assert "+" not in s.speaker and s.source == "fsdd_seq"
    # every non-silent stretch of a sequence is a test recording of its speaker
    first = seqs[0]
    candidates = [w for uid, w in test_waves.items() if f"_{first.speaker}_" in uid]
    head = first.wave[:200]
    assert any(len(w) >= 200 and np.array_equal(w[:200], head) for w in candidates)


def test_ljspeech(data_root):
    if not (data_root / "ljspeech_mini" / "metadata.csv").is_file():
        pytest.skip(f"no LJSpeech sample under {data_root}")
    utts = ljspeech_utterances(data_root)
    assert len(utts) == 32 and utts[0].uid == "LJ001-0001"
    assert utts[1].text == "in being comparatively modern"
    assert utts[1].duration_s == pytest.approx(1.9, abs=0.01)
    assert all(u.text == normalize_text(u.text) and u.source == "ljspeech" for u in utts)
