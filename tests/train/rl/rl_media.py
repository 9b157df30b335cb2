"""What the image and speech RL tests share: a micro multimodal checkpoint, a small RL config over it,
and the run's step records."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from ernie5.model.model import Ernie5Model
from ernie5.store.checkpoint import load_checkpoint, save_checkpoint
from tests.conftest import micro_multimodal_parts
from train.pretrain.config import ElasticConfig
from train.rl.config import ObjectiveConfig, RLLoopConfig, RLRunConfig, RolloutConfig


def media_checkpoint(folder: Path) -> Path:
    """A random micro model with vision and audio, its text tokenizer, vision tokenizer and codec."""
    model, tok, vtok, codec = micro_multimodal_parts()
    torch.manual_seed(0)
    model = Ernie5Model(replace(model.cfg, vocab_size=tok.vocab_size))  # text rollouts decode every id
    path = folder / "ckpt"
    save_checkpoint(path, model, tokenizer=tok, vision_tokenizer=vtok, audio_codec=codec)
    return path


def media_rl_config(ckpt: Path, tasks: dict[str, float], steps: int = 3, **sections) -> RLRunConfig:
    """A few fp32 steps of 2 queries x 3 responses over ``ckpt``; ``sections`` replace whole sections.
    The learner's own copy samples (``rollout.engine=learner``), so that the first step's learner
    log-probs equal the behaviour ones exactly: the check that each output's learner batch lays out
    what the engine sampled."""
    base = RLRunConfig(
        model=load_checkpoint(ckpt, fast=False).cfg,
        tasks=tasks,
        rl=RLLoopConfig(steps=steps, init_from=str(ckpt), dtype="fp32", ckpt_every=2),
        rollout=RolloutConfig(queries_per_step=2, group_size=3, chunk=2, max_new_tokens=4, engine="learner"),
        objective=ObjectiveConfig(minibatches=2),
        elastic=ElasticConfig(enabled=False),
        optim=replace(RLRunConfig().optim, lr=1e-3),
    )
    return replace(base, **sections)


def step_records(run: Path) -> list[dict]:
    """The run's per-step records (events left out)."""
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "event" not in r]
