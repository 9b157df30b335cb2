"""The pretraining mixture's audio sources: FSDD (seen speakers' train split only, never the held-out
speaker), its perturbed twin and the synthetic voices."""

from __future__ import annotations

import hashlib
import random
import wave
from pathlib import Path

import numpy as np
import pytest

from ernie5.data import voices
from ernie5.data.audio import (
    FSDD_SPEAKERS,
    FSDD_TRAIN_SPEAKERS,
    FSDD_UNSEEN_SPEAKER,
    SAMPLE_RATE,
    fsdd_utterances,
)
from ernie5.data.audio_sources import (
    AUDIO_SOURCES,
    DIGIT_SPOKEN_QUESTION,
    SPEAKER_QUESTION,
    open_audio_source,
    speaker_id,
)
from ernie5.data.root import DataMissing


@pytest.fixture(scope="module")
def fsdd_root(data_root) -> Path:
    if not (data_root / "fsdd" / "recordings").is_dir():
        pytest.skip(f"no FSDD under {data_root}")
    return data_root


def _digest(wave_: np.ndarray) -> str:
    return hashlib.sha1(np.asarray(wave_, np.float32).tobytes()).hexdigest()


def test_speaker_ids_seen_speakers_keep_their_rows_and_the_unseen_one_has_none():
    assert [speaker_id(s) for s in FSDD_TRAIN_SPEAKERS] == [
        FSDD_SPEAKERS.index(s) for s in FSDD_TRAIN_SPEAKERS
    ]
    assert [speaker_id(s) for s in ("george", "jackson", "nicolas", "yweweler")] == [0, 1, 2, 4]
    assert speaker_id(FSDD_UNSEEN_SPEAKER) == -1
    assert speaker_id("dtmf") == speaker_id("nobody") == -1


def test_fsdd_source_on_a_root_with_only_the_unseen_speaker_is_data_missing(tmp_path):
    rec = tmp_path / "fsdd" / "recordings"
    rec.mkdir(parents=True)
    for i in (0, 9):
        with wave.open(str(rec / f"4_{FSDD_UNSEEN_SPEAKER}_{i}.wav"), "wb") as f:
            f.setnchannels(1), f.setsampwidth(2), f.setframerate(SAMPLE_RATE)
            f.writeframes(np.zeros(100, "<i2").tobytes())
    with pytest.raises(DataMissing):
        open_audio_source("fsdd", tmp_path)


def test_fsdd_training_source_never_yields_the_unseen_speaker(fsdd_root):
    _, loader = AUDIO_SOURCES["fsdd"]
    by_speaker, speakers = loader(fsdd_root)
    assert speakers == sorted(FSDD_TRAIN_SPEAKERS) and FSDD_UNSEEN_SPEAKER not in by_speaker
    pool = [u for utts in by_speaker.values() for u in utts]
    assert len(pool) == 1800 and all(f"_{FSDD_UNSEEN_SPEAKER}_" not in u.uid for u in pool)
    unseen = {_digest(u.wave) for u in fsdd_utterances(fsdd_root, "unseen")}
    assert len(unseen) == 500 and not unseen & {_digest(u.wave) for u in pool}

    draw = open_audio_source("fsdd", fsdd_root)
    rng = random.Random(0)
    docs = [draw(rng) for _ in range(400)]
    seen_ids = {speaker_id(s) for s in FSDD_TRAIN_SPEAKERS}
    assert {d.speaker for d in docs if d.kind == "gen"} <= seen_ids
    answers = {d.text.split("Answer:")[1].strip() for d in docs if SPEAKER_QUESTION in d.text}
    assert answers and answers <= set(FSDD_TRAIN_SPEAKERS)
    assert not {_digest(d.wave) for d in docs} & unseen  # no single recording of the held-out speaker


def test_fsdd_varied_perturbs_only_what_is_not_about_the_voice(fsdd_root):
    plain, varied = open_audio_source("fsdd", fsdd_root), open_audio_source("fsdd_varied", fsdd_root)
    changed = kept = 0
    for seed in range(60):
        a, b = plain(random.Random(seed)), varied(random.Random(seed))
        assert (a.kind, a.prompt, a.text, a.speaker) == (b.kind, b.prompt, b.text, b.speaker)
        if a.kind == "gen" or SPEAKER_QUESTION in a.text:
            assert np.array_equal(a.wave, b.wave)  # TTS and speaker documents keep the real voice
            kept += 1
        else:
            assert b.wave.dtype == np.float32 and np.abs(b.wave).max() <= 1.0
            changed += not (len(a.wave) == len(b.wave) and np.array_equal(a.wave, b.wave))
    assert kept and changed >= 20


@pytest.mark.skipif(not voices.available(), reason=voices.HOW_TO_GET)
def test_espeak_source_is_understanding_only_and_cached(tmp_path, monkeypatch):
    import ernie5.data.audio_sources as sources

    monkeypatch.setenv("ERNIE5_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sources, "ESPEAK_UTTERANCES", 12)
    draw = open_audio_source("espeak", None)
    assert (tmp_path / "voices" / "digits-12-s0.npz").is_file()
    docs = [draw(random.Random(i)) for i in range(30)]
    assert all(d.kind == "und" and d.speaker == -1 for d in docs)
    assert all(d.text.startswith("Transcript: ") or DIGIT_SPOKEN_QUESTION in d.text for d in docs)
    again = open_audio_source("espeak", None)  # read back from the cache: the same documents
    assert all(np.array_equal(draw(random.Random(i)).wave, again(random.Random(i)).wave) for i in range(5))
