"""``ernie5 extract`` of a multimodal checkpoint: the child ships every side model of its supernet and
answers the supernet's vision, audio and refine requests."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ernie5.data.dtmf import dtmf_utterance
from ernie5.store.checkpoint import load_checkpoint, save_checkpoint
from ernie5.subnets.extract import extract_checkpoint, side_models
from ernie5.tokenizers.refiner import Refiner, RefinerConfig
from evals.adapter import Ernie5EvalModel
from evals.api import LoglikelihoodRequest, MediaPart, ReconstructionRequest, RefineRequest
from tests.conftest import micro_multimodal_parts

SIDE = ("vision_tokenizer", "audio_codec", "refiner")


@pytest.fixture(scope="module")
def multimodal_ckpt(tmp_path_factory):
    """A micro model with vision and audio, its text tokenizer, vision tokenizer, codec and refiner
    (untrained: extraction copies weights, it does not need good ones)."""
    model, tok, vtok, codec = micro_multimodal_parts()
    refiner = Refiner(
        RefinerConfig(low_size=16, channels=(16, 32), n_res_blocks=1, time_dim=32, sample_steps=2)
    )
    path = tmp_path_factory.mktemp("mm") / "ckpt"
    save_checkpoint(
        path,
        model,
        tokenizer=tok,
        meta={"step": 0},
        vision_tokenizer=vtok,
        audio_codec=codec,
        refiner=refiner,
    )
    return path


def _requests():
    image = MediaPart("image", np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    audio = MediaPart("audio", dtmf_utterance("12", random.Random(0)).wave, {"sample_rate": 8000})
    low = MediaPart("image", np.random.default_rng(1).integers(0, 255, (16, 16, 3), dtype=np.uint8))
    return (
        [
            LoglikelihoodRequest((image, "Question: what is shown?\nAnswer:"), " a circle"),
            LoglikelihoodRequest((audio, "Question: which digit is spoken?\nAnswer:"), " one"),
        ],
        [ReconstructionRequest(image), ReconstructionRequest(audio)],
        [RefineRequest(low, steps=1)],
    )


def test_extract_carries_every_side_model_and_the_child_runs_the_parents_requests(multimodal_ckpt, tmp_path):
    parent = load_checkpoint(multimodal_ckpt)
    assert all(v is not None for v in side_models(parent).values())  # the fixture ships them all
    assert set(SIDE) <= set(side_models(parent))
    rep = extract_checkpoint(multimodal_ckpt, "d0.5-k1", tmp_path / "child")
    child = load_checkpoint(rep["out"])
    assert child.cfg.n_layers == parent.cfg.n_layers // 2 and child.cfg.moe.top_k == 1
    assert child.tokenizer is not None and child.tokenizer.vocab_size == parent.tokenizer.vocab_size
    for name, side in side_models(parent).items():  # every side model, with the parent's weights
        mine = getattr(child, name)
        assert mine is not None, name
        assert mine.cfg == side.cfg, name
        for (k, a), (_, b) in zip(side.state_dict().items(), mine.state_dict().items(), strict=True):
            assert torch.equal(a, b), (name, k)
    lls, recs, refines = _requests()
    for ckpt in (parent, child):
        model = Ernie5EvalModel(ckpt, batch_size=2)
        assert all(np.isfinite(r.logprob) for r in model.loglikelihood(lls).results)
        shapes = [r.media.shape for r in model.reconstruct(recs).results]
        assert shapes == [(1, 32, 32, 3), recs[1].media.data.shape]
        assert model.refine(refines).results[0].media.shape == (1, 32, 32, 3)
