"""RL on generated images: ``t2i_shapes`` rollouts rewarded by the task's judge, mixed with text tasks,
per-output metrics, gradients reaching the image rows, and exact resume with images in the buffer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import evals.tasks  # noqa: F401  (registers the tasks)
from ernie5.generation.vision import generate_media
from ernie5.model.elastic import Subnet
from ernie5.store.checkpoint import checkpoint_dirs, load_checkpoint
from evals.verifiers import TaskVerifier
from tests.train.rl.rl_media import media_checkpoint, media_rl_config, step_records
from tests.train.rl.test_trainer import ToyVerifier
from train.rl.buffer import Rollout
from train.rl.config import ObjectiveConfig, RolloutConfig
from train.rl.rollout_image import unpack_codes
from train.rl.trainer import RLTrainer


class RedVerifier:
    """A graded image reward every untrained model spreads: the mean red level of the decoded image."""

    name = "red"
    modality = "image"

    def __init__(self) -> None:
        self._t2i = TaskVerifier("t2i_shapes")

    def query(self, index: int, seed: int):
        return self._t2i.query(index, seed)

    def reward(self, query, image) -> float:
        return float(np.asarray(image)[..., 0].mean() / 255.0)


@pytest.fixture(scope="module")
def mm_ckpt(tmp_path_factory) -> Path:
    return media_checkpoint(tmp_path_factory.mktemp("rlimg"))


def test_t2i_reward_is_the_judges_score_of_the_generated_image(mm_ckpt, tmp_path):
    """The trainer's reward of an image rollout = the task's judge on what generate_media draws for the
    prompt with the same bits (the decoded image), averaged over the task's metrics."""
    verifier = TaskVerifier("t2i_shapes")
    trainer = RLTrainer(
        media_rl_config(mm_ckpt, {"t2i_shapes": 1.0}), tmp_path / "rl", {"t2i_shapes": verifier}
    )
    trainer._setup()
    rows = [Rollout(0, s) for s in range(3)]
    trainer._advance_on(rows, 8, 0, Subnet.full(trainer.cfg.model))
    got = trainer._rewards(rows)
    _, query = trainer._query(0)
    assert query.output == "image" and query.cfg_scale == 3.0 and query.context.startswith("Draw: ")
    ckpt = trainer.ckpt
    for r, reward in zip(rows, got, strict=True):
        bits = unpack_codes(r.tokens, ckpt.cfg.vision.latent_bits)
        assert bits.shape == (ckpt.cfg.vision.tokens_per_frame, ckpt.cfg.vision.latent_bits)
        scores = verifier.task.score(
            query.example,
            [__import__("evals.api", fromlist=["MediaResult"]).MediaResult(_decode(ckpt, bits))],
        )
        assert reward == pytest.approx(sum(scores.values()) / len(scores))
    # and the pixels are generate_media's for that prompt when the engine's draws are replayed
    engine = trainer.rollouts["image"].engine
    ids = trainer.rollouts["image"].prompt(rows[0]).ids
    bits, _ = engine.sample([ids], 3.0, seed=9)
    want = generate_media(engine.model, ckpt.vision_tokenizer, [ids[:-1]], 1, cfg_scale=3.0, seed=9)
    assert np.array_equal(_decode(ckpt, bits[0]), want[0])


def _decode(ckpt, bits_PD: torch.Tensor) -> np.ndarray:
    from train.rl.rollout_image import decode_rollouts, pack_codes

    return decode_rollouts(
        ckpt.vision_tokenizer, ckpt.cfg.vision, [Rollout(0, 0, tokens=pack_codes(bits_PD))]
    )[0]


@pytest.mark.slow
def test_a_tiny_image_run_trains_the_image_rows(mm_ckpt, tmp_path):
    cfg = media_rl_config(
        mm_ckpt, {"red": 1.0}, steps=2, objective=ObjectiveConfig(loss="grpo", minibatches=1)
    )
    before = {
        k: v.clone() for k, v in load_checkpoint(mm_ckpt, fast=False).model.vision.head.state_dict().items()
    }
    RLTrainer(cfg, tmp_path / "rl", {"red": RedVerifier()}, quiet=True).run()
    recs = step_records(tmp_path / "rl")
    assert len(recs) == 2
    for rec in recs:
        assert rec["reward_by_output"].keys() == {"image"} and rec["entropy_by_output"].keys() == {"image"}
        assert rec["response_len"] == cfg.model.vision.tokens_per_frame
        assert 0 < rec["image_bit_entropy"] <= math.log(2) + 1e-6
        assert all(math.isfinite(rec[k]) for k in ("reward", "entropy", "grad_norm", "logp_mismatch"))
        assert rec["grad_norm"] > 0
    # step 1 trains images sampled by the weights it starts from: fp32, the learner's teacher-forced
    # log-probs equal the behaviour ones (step 2's group was sampled one update earlier: U-RB lookahead)
    assert recs[0]["staleness"] == 0 and recs[0]["logp_mismatch"] < 1e-5
    after = load_checkpoint(checkpoint_dirs(tmp_path / "rl")[-1], fast=False).model.vision.head.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_images_mix_with_text_tasks_and_resume_exactly(mm_ckpt, tmp_path):
    tasks = {"red": 1.0, "toy": 1.0}
    cfg = media_rl_config(
        mm_ckpt,
        tasks,
        steps=4,
        rollout=RolloutConfig(
            queries_per_step=2, group_size=3, chunk=2, max_new_tokens=4, lookahead=2, engine="learner"
        ),
    )

    def verifiers():
        return {"red": RedVerifier(), "toy": ToyVerifier()}

    RLTrainer(cfg, tmp_path / "whole", verifiers(), quiet=True).run()
    RLTrainer(cfg, tmp_path / "cut", verifiers(), quiet=True).run(until=2)
    state = json.loads((checkpoint_dirs(tmp_path / "cut")[-1] / "train_state.json").read_text())
    assert state["state"]["buffer"]["rollouts"]
    RLTrainer(cfg, tmp_path / "cut", verifiers(), resume=True, quiet=True).run()
    whole, cut = step_records(tmp_path / "whole"), step_records(tmp_path / "cut")
    assert set().union(*(r["reward_by_output"] for r in whole)) == {"image", "text"}
    assert set().union(*(r["rows_by_task"] for r in whole)) == {"red", "toy"}
    diffs = [
        (r["step"], k)
        for r, c in zip(whole, cut, strict=True)
        for k in sorted(set(r) | set(c))
        if k not in ("idle_s", "train_s", "tokens_per_s") and r.get(k) != c.get(k)
    ]
    assert len(whole) == len(cut) == 4 and not diffs, diffs[:6]
    a = load_checkpoint(checkpoint_dirs(tmp_path / "whole")[-1], fast=False).model.state_dict()
    b = load_checkpoint(checkpoint_dirs(tmp_path / "cut")[-1], fast=False).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("engine", ["learner", "inference"])
def test_an_fp32_learner_trains_on_questions_about_images(mm_ckpt, tmp_path, engine):
    # The prompt's pixels are built while the engine samples (inference mode) and cached; the fp32
    # learner then feeds them to the vision encoder with autograd on. Before the prompts were built
    # outside inference mode this raised "Inference tensors cannot be saved for backward" (the
    # rl-study objective set-up: rl.dtype=fp32 with shapes_vqa_attr).
    rollout = RolloutConfig(queries_per_step=2, group_size=3, chunk=2, max_new_tokens=2, engine=engine)
    cfg = media_rl_config(mm_ckpt, {"shapes_vqa_attr": 1.0}, steps=1, rollout=rollout)
    RLTrainer(cfg, tmp_path / "rl", {"shapes_vqa_attr": TaskVerifier("shapes_vqa_attr")}, quiet=True).run()
    (rec,) = step_records(tmp_path / "rl")
    assert math.isfinite(rec["grad_norm"]) and rec["rows_by_task"] == {"shapes_vqa_attr": 6}
