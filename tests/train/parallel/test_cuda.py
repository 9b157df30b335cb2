"""The GPU paths (skipped without a CUDA GPU): one training step on the GPU against the CPU, FSDP2
with expert parallelism over NCCL on the GPUs present, and ``ernie5 bench train --device cuda``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ernie5.config import load
from ernie5.presets import resolve_config_path
from tests.conftest import cli_env
from train.config import RunConfig
from train.loop import pretrain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SETS = ["train.steps=4", "train.log_every=1", "train.dtype=fp32", "data.tokenizer_chars=20000"]


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_gpu_training_step_matches_the_cpu(tmp_path):
    for device in ("cpu", "cuda"):
        cfg = load(RunConfig, resolve_config_path("micro"), [*SETS, f"train.device={device}"])
        pretrain(cfg, tmp_path / device, quiet=True)
    assert _losses(tmp_path / "cuda") == pytest.approx(_losses(tmp_path / "cpu"), rel=1e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more CUDA GPUs")
def test_fsdp2_with_expert_parallelism_over_nccl_matches_one_process(tmp_path):
    n = 2
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    common = ["train", "--config", "micro", "--quiet"] + [a for s in SETS for a in ("--set", s)]
    cmd = [torchrun, "--nproc_per_node", str(n), "-m", "jobs.cli", *common, "--out", str(tmp_path / "gpus")]
    cmd += ["--set", "train.parallel.ep=2"]
    r = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    one = load(
        RunConfig,
        resolve_config_path("micro"),
        [*SETS, "train.grad_accum=2", "train.parallel.subnet_group=2"],
    )
    pretrain(one, tmp_path / "one", quiet=True)
    assert _losses(tmp_path / "gpus") == pytest.approx(_losses(tmp_path / "one"), rel=1e-3)


def test_bench_train_on_the_gpu_reports_mfu():
    from train.bench import bench_train

    out = bench_train(repeats=2, warmup=2, device="cuda")
    assert out["env"]["device"].startswith("cuda")
    assert 0 < out["mfu"] < 1 and out["peak_memory_mb"] > 0
