"""Held-out evaluation of an audio codec: batching changes no score; DTMF transcripts to keys."""

from __future__ import annotations

import numpy as np
import pytest

from ernie5.tokenizers.audio_codec import AudioCodec
from tests.train.side.test_audio_codec import tiny_train_cfg
from train.side.audio_codec_eval import dtmf_keys, evaluate_codec


def test_dtmf_keys():
    assert dtmf_keys("four pound one star") == "4#1*"


def test_evaluate_codec_batches_like_single_utterances():
    codec = AudioCodec(tiny_train_cfg().codec).eval()
    rng = np.random.default_rng(0)
    waves = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (500, 1700, 960)]
    batched = evaluate_codec(codec, waves, batch_size=3)
    single = [evaluate_codec(codec, [w], batch_size=1) for w in waves]
    for n in ("1", "2"):
        expected = np.mean([s["levels"][n]["snr_db"] for s in single])
        assert batched["levels"][n]["snr_db"] == pytest.approx(expected, abs=1e-2)
