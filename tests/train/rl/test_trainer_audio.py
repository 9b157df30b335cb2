"""RL on generated speech: ``tts_dtmf`` rollouts rewarded by the task's judge, mixed with a text task,
per-output metrics, gradients reaching the NCP heads, and exact resume with utterances in the buffer."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import evals.tasks  # noqa: F401  (registers the tasks)
from ernie5.generation.audio import AudioSampling, generate_audio
from ernie5.model.elastic import Subnet
from ernie5.sequence.audio import decode_codes
from ernie5.store.checkpoint import checkpoint_dirs, load_checkpoint
from evals.api import MediaResult
from evals.verifiers import TaskVerifier
from tests.train.rl.rl_media import media_checkpoint, media_rl_config, step_records
from tests.train.rl.test_trainer import ToyVerifier
from train.rl.buffer import Rollout
from train.rl.config import RolloutConfig
from train.rl.rollout_audio import unpack_frames
from train.rl.trainer import RLTrainer

SAMPLES_PER_FRAME = 320
"""The micro codec's waveform samples per frame (8 kHz, 40 ms)."""


class ShortVerifier:
    """A graded speech reward every untrained model spreads: the shorter the utterance, the better."""

    name = "short"
    modality = "audio"

    def __init__(self) -> None:
        self._tts = TaskVerifier("tts_dtmf")

    def query(self, index: int, seed: int):
        q = self._tts.query(index, seed)
        return replace(q, max_new_tokens=8)  # a short frame budget keeps the test fast

    def reward(self, query, wave) -> float:
        return 1.0 / (1.0 + len(np.asarray(wave)) / SAMPLES_PER_FRAME)


@pytest.fixture(scope="module")
def mm_ckpt(tmp_path_factory) -> Path:
    return media_checkpoint(tmp_path_factory.mktemp("rlaudio"))


def test_tts_reward_is_the_judges_score_of_the_generated_speech(mm_ckpt, tmp_path):
    """The trainer's reward of a speech rollout = 1 - min(1, WER) of what the task's Goertzel judge hears
    in the decoded waveform, and the codes are generate_audio's for the prompt and seed."""
    verifier = TaskVerifier("tts_dtmf")
    cfg = media_rl_config(
        mm_ckpt, {"tts_dtmf": 1.0}, rollout=RolloutConfig(queries_per_step=2, group_size=3, engine="learner")
    )
    trainer = RLTrainer(cfg, tmp_path / "rl", {"tts_dtmf": verifier})
    trainer._setup()
    rows = [Rollout(0, s) for s in range(3)]
    trainer._advance_on(rows, 8, 0, Subnet.full(trainer.cfg.model))
    got = trainer._rewards(rows)
    _, query = trainer._query(0)
    assert query.output == "audio" and query.context.startswith("Dial: ")
    assert query.max_new_tokens == verifier.task.requests(query.example)[0].max_frames
    ckpt, ac = trainer.ckpt, trainer.cfg.model.audio
    for r, reward in zip(rows, got, strict=True):
        codes, _ = unpack_frames(r.tokens, ac.n_levels, ac.codebook_size)
        (wave,) = decode_codes(ckpt.audio_codec, [codes])
        errors, words = verifier.task.score(query.example, [MediaResult(wave)])["wer"]
        assert reward == pytest.approx(1.0 - min(1.0, errors / words))
    speech = trainer.rollouts["audio"]
    engine, prompt = speech.engine, speech.prompt(rows[0])
    codes, _, _ = engine.sample([prompt], prompt.max_frames, seed=9)
    assert engine.temperature == cfg.rollout.audio_temperature
    sampling = AudioSampling(temperature=engine.temperature, max_frames=prompt.max_frames, seed=9)
    (want,) = generate_audio(engine.model, [prompt.document(ac.n_levels)], sampling)
    assert torch.equal(codes[0], want)


def test_a_dtmf_prompt_of_the_judge_scores_one(mm_ckpt, tmp_path):
    """The verifier's reward is the task's: the exact keypad tones of the prompt score 1, silence 0."""
    from ernie5.data.dtmf import dtmf_utterance

    verifier = TaskVerifier("tts_dtmf")
    query = verifier.query(3, 0)
    names = {"star": "*", "pound": "#"} | {
        w: str(d)
        for d, w in enumerate(
            ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
        )
    }
    keys = "".join(names[w] for w in query.example.target.split())
    wave = dtmf_utterance(keys, __import__("random").Random(0)).wave
    assert verifier.reward(query, wave) == 1.0 and verifier.reward(query, np.zeros(800, np.float32)) == 0.0


def test_speech_mixes_with_text_and_resumes_exactly(mm_ckpt, tmp_path):
    """A tiny run with speech and text queries: rewards and entropies logged per output and modality, the
    first step's learner log-probs equal the behaviour ones (fp32, same weights), the NCP heads move, and a
    run interrupted after step 2 and resumed equals the uninterrupted one."""
    cfg = media_rl_config(mm_ckpt, {"short": 1.0, "toy": 1.0}, steps=4)

    def verifiers():
        return {"short": ShortVerifier(), "toy": ToyVerifier()}

    before = {k: v.clone() for k, v in load_checkpoint(mm_ckpt, fast=False).model.audio.state_dict().items()}
    RLTrainer(cfg, tmp_path / "whole", verifiers(), quiet=True).run()
    RLTrainer(cfg, tmp_path / "cut", verifiers(), quiet=True).run(until=2)
    state = json.loads((checkpoint_dirs(tmp_path / "cut")[-1] / "train_state.json").read_text())
    assert state["state"]["buffer"]["rollouts"]
    RLTrainer(cfg, tmp_path / "cut", verifiers(), resume=True, quiet=True).run()
    whole, cut = step_records(tmp_path / "whole"), step_records(tmp_path / "cut")
    assert set().union(*(r["reward_by_output"] for r in whole)) == {"audio", "text"}
    assert set().union(*(r["reward_by_modality"] for r in whole)) == {"audio", "text"}
    audio = [r for r in whole if "audio" in r["reward_by_output"]]
    assert audio and all(0 < r["audio_level_entropy"] <= math.log(17) for r in audio)
    assert all(0 < r["reward_by_output"]["audio"] <= 0.5 for r in audio)  # one frame at least
    assert whole[0]["staleness"] == 0 and whole[0]["logp_mismatch"] < 1e-5
    diffs = [
        (r["step"], k)
        for r, c in zip(whole, cut, strict=True)
        for k in sorted(set(r) | set(c))
        if k not in ("idle_s", "train_s", "tokens_per_s") and r.get(k) != c.get(k)
    ]
    assert len(whole) == len(cut) == 4 and not diffs, diffs[:6]
    a = load_checkpoint(checkpoint_dirs(tmp_path / "whole")[-1], fast=False).model
    b = load_checkpoint(checkpoint_dirs(tmp_path / "cut")[-1], fast=False).model.state_dict()
    assert all(torch.equal(v, b[k]) for k, v in a.state_dict().items())
    after = a.audio.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_tts_training_prompts_are_held_out_from_the_evaluated_ones():
    from evals.task import TASKS

    verifier = TaskVerifier("tts_dtmf")
    evaluated = {ex.prompt for ex in TASKS.get("tts_dtmf")(n_examples=5000).all_examples(None)}
    queries = [verifier.query(i, 0) for i in range(200)]
    assert not {q.context for q in queries} & evaluated
    assert all(
        q.output == "audio" and q.reference == "" and not q.skeleton.steps and q.max_new_tokens > 0
        for q in queries
    )
