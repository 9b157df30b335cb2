"""``ernie5 rl`` on a GPU's code path, checked on the CPU: the policy on the stand-in device
(``tests/stand_in_device.py``: real values, ``.device`` not the CPU) rolls out text (with routing
replay), images and speech and learns from them without mixing a CPU tensor into its device tensors;
the learner's recomputed log-probs match the rollouts' and the checkpoint loads on the CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import evals.tasks  # noqa: F401  (registers the tasks)
import train.rl.trainer as rl
from ernie5.store.checkpoint import checkpoint_dirs, load_checkpoint
from tests.stand_in_device import stand_in_device
from tests.train.rl.rl_media import media_checkpoint, media_rl_config, step_records
from tests.train.rl.test_trainer import ToyVerifier
from tests.train.rl.test_trainer_audio import ShortVerifier
from tests.train.rl.test_trainer_image import RedVerifier


@pytest.mark.slow
def test_rl_on_the_device_path_mixes_no_cpu_tensor(tmp_path, monkeypatch):
    ckpt = media_checkpoint(tmp_path)
    cfg = media_rl_config(ckpt, {"red": 1.0, "toy": 1.0, "short": 1.0}, steps=2)
    # rl.seed 1: queries 0-3 ask for an image, speech, text, speech. Fused AdamW has no meta kernel
    # (CUDA has one): foreach here.
    cfg = replace(cfg, rl=replace(cfg.rl, seed=1), optim=replace(cfg.optim, fused=False))
    assert cfg.objective.routing_replay
    monkeypatch.setattr(rl, "pick_device", lambda name: torch.device("meta"))  # rl.device: the stand-in GPU
    verifiers = {"red": RedVerifier(), "toy": ToyVerifier(), "short": ShortVerifier()}
    with stand_in_device() as mixed:
        rl.RLTrainer(cfg, tmp_path / "rl", verifiers, quiet=True).run()
    assert mixed == []
    recs = step_records(tmp_path / "rl")
    assert len(recs) == 2 and {o for r in recs for o in r["reward_by_output"]} == {"text", "image", "audio"}
    assert recs[0]["staleness"] == 0 and recs[0]["logp_mismatch"] < 1e-5
    assert load_checkpoint(checkpoint_dirs(tmp_path / "rl")[-1]).model.tok_emb.weight.is_cpu
