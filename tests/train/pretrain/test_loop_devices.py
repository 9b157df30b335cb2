"""``ernie5 train`` on a GPU's code path, checked on the CPU: the model on the stand-in device
(``tests/stand_in_device.py``: real values, ``.device`` not the CPU) trains, checkpoints and resumes
(bf16 replica, two micro-batches, elastic sub-models, the router-bias update, activation offload
switched on) without mixing a CPU tensor into its device tensors."""

from __future__ import annotations

import pytest
import torch

import train.pretrain.loop as loop
from ernie5.config import load
from ernie5.presets import resolve_config_path
from ernie5.store.checkpoint import checkpoint_dirs
from tests.stand_in_device import stand_in_device
from train.pretrain.config import RunConfig

SETS = [
    "train.log_every=1",
    "train.ckpt_every=1",
    "train.dtype=bf16",
    "train.grad_accum=2",
    "train.parallel.activation_offload=true",
    "data.tokenizer_chars=20000",
    "optim.fused=false",  # fused AdamW has no meta kernel (CUDA has one): foreach here
]


@pytest.mark.slow
def test_training_on_the_device_path_mixes_no_cpu_tensor(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "pick_device", lambda name: torch.device("meta"))  # the stand-in GPU
    monkeypatch.setattr(loop, "machine_peak", lambda *a, **k: 1e12)  # no matmul to time on it
    with stand_in_device() as mixed:
        for steps, resume in ((2, False), (3, True)):  # a run, then its extension from the checkpoint
            cfg = load(RunConfig, resolve_config_path("micro"), [*SETS, f"train.steps={steps}"])
            loop.pretrain(cfg, tmp_path, resume=resume, quiet=True)
    assert mixed == []
    assert len(checkpoint_dirs(tmp_path)) >= 1
