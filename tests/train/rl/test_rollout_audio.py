"""Speech rollouts: the engine samples what ``generate_audio`` samples, and the learner's teacher-forced
forward recomputes the behaviour log-prob of every generated frame (and END)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ernie5.generation.audio import AudioSampling, generate_audio
from ernie5.model.elastic import Subnet
from ernie5.sequence.audio import decode_codes
from tests.conftest import micro_multimodal_parts
from train.rl.buffer import Rollout
from train.rl.rollout_audio import (
    AudioPrompt,
    AudioRolloutEngine,
    audio_learner_batch,
    audio_logprobs,
    decode_rollouts,
    pack_frame,
    speech_prompt_ids,
    unpack_frames,
)

PROMPTS = (("Dial: five star.", -1, 9), ("Say: seven three.", 1, 9), ("Say: one.", 2, 6))


@pytest.fixture(scope="module")
def parts():
    model, tok, _, codec = micro_multimodal_parts()
    return model.eval(), tok, codec


def _prompts(tok) -> list[AudioPrompt]:
    return [AudioPrompt(speech_prompt_ids(tok, p), spk, m) for p, spk, m in PROMPTS]


def _engine(parts, temperature: float = 1.0) -> tuple[AudioRolloutEngine, list[AudioPrompt]]:
    model, tok, _ = parts
    prompts = _prompts(tok)
    return AudioRolloutEngine(model, lambda r: prompts[r.query], temperature=temperature, seed=3), prompts


def _logprobs(model, rows, prompts, temperature):
    batch = audio_learner_batch(rows, prompts, model.cfg.audio)
    with torch.no_grad():
        return audio_logprobs(model, batch, Subnet.full(model.cfg), temperature, model.cfg.audio.end_code)


def test_frames_round_trip_and_end_is_a_token_of_its_own():
    k, q = 16, 3
    codes = torch.randint(0, k, (7, q))
    tokens = [pack_frame(c.tolist(), k) for c in codes]
    assert all(t != k for t in tokens)  # no frame packs to END
    back, ended = unpack_frames(tokens, q, k)
    assert torch.equal(back, codes) and not ended
    back, ended = unpack_frames([*tokens, pack_frame([k, 0, 0], k)], q, k)
    assert torch.equal(back, codes) and ended
    assert unpack_frames([k], q, k)[0].shape == (0, q)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_samples_what_generate_audio_samples(parts, temperature):
    """Same prompts, speakers, frame budget and seed: the engine's codes are the harness sampler's, and the
    waveforms the RL rewards are computed on are the harness's decoded ones."""
    model, _, codec = parts
    engine, prompts = _engine(parts, temperature)
    codes, ended, logp = engine.sample(prompts[:2], 9, seed=11)
    sampling = AudioSampling(temperature=temperature, max_frames=9, seed=11)
    theirs = generate_audio(model, [p.document(model.cfg.audio.n_levels) for p in prompts[:2]], sampling)
    assert all(torch.equal(a, b) for a, b in zip(codes, theirs, strict=True))
    assert [len(lp) for lp in logp] == [len(c) + e for c, e in zip(codes, ended, strict=True)]
    assert all(x < 0 for lp in logp for x in lp)
    k = model.cfg.audio.codebook_size
    rows = [
        Rollout(i, 0, tokens=[pack_frame(f.tolist(), k) for f in c] + [k] * e, done=True)
        for i, (c, e) in enumerate(zip(codes, ended, strict=True))
    ]
    ours, harness = decode_rollouts(codec, model.cfg.audio, rows), decode_codes(codec, theirs)
    assert all(np.array_equal(a, b) for a, b in zip(ours, harness, strict=True))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_learner_recomputes_the_behaviour_logprobs(parts, temperature):
    """Same weights: the teacher-forced forward's log-prob of every generated frame (the sum of its levels)
    and of END equals the one the engine stored while sampling it; rows that ended and rows cut at their
    frame budget both occur."""
    model, _, _ = parts
    engine, prompts = _engine(parts, temperature)
    rows = [Rollout(q, s) for q in range(len(prompts)) for s in range(3)]
    steps, tokens = engine.advance(rows, 1, 0, Subnet.full(model.cfg), 5)
    assert tokens == sum(len(r.tokens) for r in rows) and steps > 0
    assert all(r.done and len(r.tokens) == len(r.logp) and set(r.versions) == {5} for r in rows)
    k = model.cfg.audio.codebook_size
    assert {r.truncated for r in rows} == {True, False}
    assert all((r.tokens[-1] == k) != r.truncated for r in rows)  # ended rows end with END, others don't
    assert all(len(r.tokens) == prompts[r.query].max_frames for r in rows if r.truncated)
    assert rows[0].tokens != rows[1].tokens  # the G responses of a query differ
    logp, ent = _logprobs(model, rows, [prompts[r.query] for r in rows], temperature)
    for i, r in enumerate(rows):
        assert torch.allclose(logp[i, : len(r.tokens)], torch.tensor(r.logp), atol=1e-5)
        assert bool((logp[i, len(r.tokens) :] == 0).all()) and bool((ent[i, : len(r.tokens)] > 0).all())


def test_a_batch_recomputes_what_each_row_alone_does(parts):
    model, _, _ = parts
    engine, prompts = _engine(parts)
    rows = [Rollout(q, s) for q in range(len(prompts)) for s in range(2)]
    engine.advance(rows, 1, 0, Subnet.full(model.cfg), 0)
    logp, ent = _logprobs(model, rows, [prompts[r.query] for r in rows], 1.0)
    for i, r in enumerate(rows):
        one, one_ent = _logprobs(model, [r], [prompts[r.query]], 1.0)
        n = len(r.tokens)
        assert torch.allclose(logp[i, :n], one[0], atol=1e-5) and torch.allclose(ent[i, :n], one_ent[0])


def test_audio_logprobs_carry_gradient_to_the_ncp_heads(parts):
    model, _, _ = parts
    engine, prompts = _engine(parts)
    rows = [Rollout(0, s) for s in range(2)]
    engine.advance(rows, 1, 0, Subnet.full(model.cfg), 0)
    batch = audio_learner_batch(rows, [prompts[0]] * 2, model.cfg.audio)
    model.zero_grad(set_to_none=True)
    logp, _ = audio_logprobs(model, batch, Subnet.full(model.cfg), 1.0, model.cfg.audio.end_code)
    logp.sum().backward()
    grads = [h.weight.grad for h in model.audio.heads]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    model.zero_grad(set_to_none=True)


def test_the_engine_refuses_argmax(parts):
    with pytest.raises(ValueError, match="must be > 0"):
        AudioRolloutEngine(parts[0], lambda r: None, temperature=0.0)
