"""Image rollouts: the engine samples what ``generate_media`` samples, and the learner's teacher-forced
forward recomputes the behaviour log-prob of every generated position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ernie5.generation.vision import generate_media
from ernie5.model.elastic import Subnet
from tests.conftest import micro_multimodal_parts
from train.rl.buffer import Rollout
from train.rl.rollout_image import (
    ImagePrompt,
    ImageRolloutEngine,
    bit_logprobs,
    decode_rollouts,
    image_learner_batch,
    image_logprobs,
    image_prompt_ids,
    pack_codes,
    unpack_codes,
)

PROMPTS = ("Draw: a red circle at the top.", "Draw: a blue square at the bottom left.")


@pytest.fixture(scope="module")
def parts():
    model, tok, vtok, _ = micro_multimodal_parts()
    return model.eval(), tok, vtok


def _engine(parts, scale: float, temperature: float = 1.0):
    model, tok, vtok = parts
    ids = [image_prompt_ids(tok, p) for p in PROMPTS]
    engine = ImageRolloutEngine(
        model, vtok, lambda r: ImagePrompt(ids[r.query], scale), temperature=temperature, seed=3
    )
    return engine, ids


def test_codes_round_trip():
    bits = torch.where(torch.rand(7, 10) < 0.5, 1.0, -1.0)
    assert torch.equal(unpack_codes(pack_codes(bits), 10), bits)


def test_bit_logprobs_are_bernoulli_logprobs_and_entropies():
    logits = torch.tensor([[[0.0, 2.0, -1.0]]])
    bits = torch.tensor([[[1.0, -1.0, -1.0]]])
    logp, ent = bit_logprobs(logits, bits, temperature=2.0)
    p = torch.sigmoid(logits / 2.0)
    want = torch.where(bits > 0, p, 1 - p).log().sum(-1)
    want_ent = -(p * p.log() + (1 - p) * (1 - p).log()).sum(-1)
    assert torch.allclose(logp, want) and torch.allclose(ent, want_ent)


@pytest.mark.parametrize("scale", [3.0, 1.0])
def test_engine_samples_what_generate_media_samples(parts, scale):
    model, tok, vtok = parts
    engine, ids = _engine(parts, scale)
    bits, logp = engine.sample(ids, scale, seed=11)
    rows = [Rollout(q, 0, tokens=pack_codes(bits[q]), done=True) for q in range(len(ids))]
    ours = decode_rollouts(vtok, model.cfg.vision, rows)
    theirs = generate_media(model, vtok, [i[:-1] for i in ids], 1, cfg_scale=scale, temperature=1.0, seed=11)
    assert np.array_equal(ours, theirs)
    assert logp.shape == (len(ids), model.cfg.vision.tokens_per_frame) and bool((logp < 0).all())


@pytest.mark.parametrize("scale,temperature", [(3.0, 1.0), (1.0, 0.7)])
def test_learner_recomputes_the_behaviour_logprobs(parts, scale, temperature):
    """Same weights: the teacher-forced forward's guided log-prob of every generated position equals the
    one the engine stored while sampling it."""
    model, _, vtok = parts
    engine, ids = _engine(parts, scale, temperature)
    rows = [Rollout(q, s) for q in range(len(ids)) for s in range(2)]
    steps, tokens = engine.advance(rows, 1, 0, Subnet.full(model.cfg), 5)
    p = model.cfg.vision.tokens_per_frame
    assert steps == len(model.cfg.vision.scales) and tokens == len(rows) * p
    assert all(r.done and len(r.tokens) == len(r.logp) == p and set(r.versions) == {5} for r in rows)
    assert rows[0].tokens != rows[1].tokens  # the G responses of a query differ
    batch = image_learner_batch(rows, [engine.prompt_of(r) for r in rows], vtok, model.cfg.vision)
    with torch.no_grad():
        logp, ent = image_logprobs(model, batch, Subnet.full(model.cfg), temperature)
    assert torch.allclose(logp, torch.tensor([r.logp for r in rows]), atol=2e-5)
    assert bool((ent > 0).all())


def test_image_logprobs_carry_gradient_to_the_vision_head(parts):
    model, _, vtok = parts
    engine, ids = _engine(parts, 3.0)
    rows = [Rollout(0, s) for s in range(2)]
    engine.advance(rows, 1, 0, Subnet.full(model.cfg), 0)
    batch = image_learner_batch(rows, [engine.prompt_of(r) for r in rows], vtok, model.cfg.vision)
    model.zero_grad(set_to_none=True)
    logp, _ = image_logprobs(model, batch, Subnet.full(model.cfg), 1.0)
    logp.sum().backward()
    grads = [p.grad for p in model.vision.head.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    model.zero_grad(set_to_none=True)


def test_one_learner_batch_has_one_guidance_scale(parts):
    model, tok, vtok = parts
    rows = [Rollout(0, 0, tokens=[0] * model.cfg.vision.tokens_per_frame)] * 2
    prompts = [ImagePrompt(image_prompt_ids(tok, "x"), s) for s in (1.0, 3.0)]
    with pytest.raises(ValueError, match="one cfg_scale"):
        image_learner_batch(rows, prompts, vtok, model.cfg.vision)
