"""Audio through the harness: an audio checkpoint answers ASR, understanding, TTS and codec requests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from ernie5.data.dtmf import dtmf_utterance
from ernie5.store.checkpoint import load_checkpoint
from evals.adapter import Ernie5EvalModel, EvalInputError
from evals.api import (
    GenerationRequest,
    LoglikelihoodRequest,
    MediaPart,
    ReconstructionRequest,
    SpeechGenerationRequest,
)
from evals.sweep import run_sweep


@pytest.fixture(scope="module")
def audio_ckpt(tmp_path_factory) -> Path:
    from ernie5.config import load
    from ernie5.presets import resolve_config_path
    from ernie5.store.checkpoint import checkpoint_dirs
    from ernie5.tokenizers.audio_codec import AudioCodec
    from ernie5.tokenizers.audio_config import AudioCodecConfig
    from train.pretrain.config import RunConfig
    from train.pretrain.loop import pretrain

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("audio")
    codec = AudioCodec(
        AudioCodecConfig(channels=4, max_channels=16, latent_dim=8, n_levels=2, codebook_size=16)
    )
    codec_dir = codec.save(root / "codec")
    cfg = load(
        RunConfig,
        resolve_config_path("micro"),
        [
            "model.max_seq_len=256",
            "data.seq_len=256",
            "data.batch_size=2",
            "data.tokenizer_chars=20000",
            "model.audio.enabled=true",
            "model.audio.n_levels=2",
            "model.audio.codebook_size=16",
            "data.sources={procedural: 0.4, dtmf: 0.6}",
            f"data.audio_codec={codec_dir}",
            "train.steps=4",
        ],
    )
    pretrain(cfg, root / "run", quiet=True)
    return checkpoint_dirs(root / "run")[-1]


@pytest.fixture(scope="module")
def model(audio_ckpt) -> Ernie5EvalModel:
    return Ernie5EvalModel(load_checkpoint(audio_ckpt), batch_size=3)


def _wave(keys: str, seed: int = 0) -> np.ndarray:
    import random

    return dtmf_utterance(keys, random.Random(seed)).wave


def test_every_audio_request_kind_is_answered_and_batching_does_not_change_answers(model):
    part = MediaPart("audio", _wave("12"), {"sample_rate": 8000})
    gens = [GenerationRequest((part, "Transcript:"), 5, stop=("\n",)), GenerationRequest("1 2 3", 5)]
    together = model.generate(gens).results
    alone = [model.generate([g])[0] for g in gens]
    assert together == alone
    lls = [
        LoglikelihoodRequest((part, "Question: Which digit is spoken?\nAnswer:"), f" {w}")
        for w in ("one", "two")
    ]
    assert model.loglikelihood(lls).results == [model.loglikelihood([r])[0] for r in lls]
    speech = model.generate_speech([SpeechGenerationRequest("Dial: one.", max_frames=4, seed=1)])[0]
    assert speech.n_tokens <= 4 and speech.media.dtype == np.float32
    assert len(speech.media) == speech.n_tokens * model.ckpt.audio_codec.hop
    rec = model.reconstruct([ReconstructionRequest(part)])[0]
    assert rec.media.shape == part.data.shape


def test_audio_inputs_are_checked(model):
    bad_rate = MediaPart("audio", _wave("1"), {"sample_rate": 16000})
    with pytest.raises(EvalInputError, match="16000 Hz"):
        model.generate([GenerationRequest((bad_rate, "Transcript:"), 3)])
    with pytest.raises(EvalInputError, match="speaker 'nobody'"):
        model.generate_speech([SpeechGenerationRequest("Say: one.", speaker="nobody")])


AUDIO_SUITE = """
name: audio
batch_size: 4
tasks:
  - {task: asr_dtmf, limit: 3}
  - {task: tts_dtmf, limit: 2}
  - {task: codec_dtmf, limit: 2}
  - {task: arith_d1, limit: 3}
subnets: {specs: [full, k1]}
efficiency: {enabled: false}
routing: true
"""


def test_sweep_over_audio_tasks(audio_ckpt, micro_text_ckpt, tmp_path):
    suite = tmp_path / "suite.yaml"
    suite.write_text(AUDIO_SUITE)
    (tmp_path / "no-data").mkdir()  # an empty data root
    res = run_sweep(audio_ckpt, suite, tmp_path / "a", data_dir=tmp_path / "no-data", quiet=True)
    assert res.errors == 0 and res.computed == 8
    df = pd.read_csv(tmp_path / "a" / "results.csv")
    assert {"wer", "cer", "exact_match", "snr_db", "mel_distance"} <= set(df["metric"])
    wer = df[(df["task"] == "asr_dtmf") & (df["metric"] == "wer")]["value"]
    assert ((wer >= 0) & np.isfinite(wer)).all()
    samples = (tmp_path / "a" / "samples" / "full" / "tts_dtmf.jsonl").read_text().splitlines()
    assert json.loads(samples[0])["sample"]["judge"] == "goertzel"
    # a text-only checkpoint records the audio tasks as skipped, with the reason
    res = run_sweep(micro_text_ckpt, suite, tmp_path / "b", data_dir=tmp_path / "no-data", quiet=True)
    assert res.skipped == 6 and res.errors == 0


@pytest.fixture(scope="module")
def micro_text_ckpt(tmp_path_factory) -> Path:
    from ernie5.config import load
    from ernie5.presets import resolve_config_path
    from ernie5.store.checkpoint import checkpoint_dirs
    from train.pretrain.config import RunConfig
    from train.pretrain.loop import pretrain

    run = tmp_path_factory.mktemp("text") / "run"
    pretrain(
        load(RunConfig, resolve_config_path("micro"), ["train.steps=2", "data.tokenizer_chars=20000"]),
        run,
        quiet=True,
    )
    return checkpoint_dirs(run)[-1]
