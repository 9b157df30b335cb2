"""The pretraining mixture's FSDD source: seen speakers' train split only, never the held-out speaker."""

from __future__ import annotations

import hashlib
import random
import wave
from pathlib import Path

import numpy as np
import pytest

from ernie5.data.audio import (
    FSDD_SPEAKERS,
    FSDD_TRAIN_SPEAKERS,
    FSDD_UNSEEN_SPEAKER,
    SAMPLE_RATE,
    fsdd_utterances,
)
from ernie5.data.audio_sources import AUDIO_SOURCES, SPEAKER_QUESTION, open_audio_source, speaker_id
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
