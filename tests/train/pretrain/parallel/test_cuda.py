"""The GPU paths (skipped without a CUDA GPU): one training step on the GPU against the CPU, FSDP2
with expert parallelism over NCCL on the GPUs present, the process group's NCCL + gloo backends on
one GPU, ``ernie5 bench train --device cuda`` and ``ernie5 rl`` on the GPU against the CPU."""

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
from train.pretrain.config import RunConfig
from train.pretrain.loop import pretrain

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


def test_the_gpu_process_group_reduces_the_trainers_cpu_tensors_and_cuda_tensors(tmp_path):
    """The backend ``init_dist`` asks for on a GPU machine, in one process (it runs on one GPU, where
    the NCCL test above is skipped): CUDA tensors go through NCCL, and the CPU tensors the trainer
    all-reduces (expert loads, their availability mask with MAX, the gradient norm's float64 sum)
    through gloo; NCCL alone refuses those."""
    import torch.distributed as dist

    from ernie5.runtime.distributed import process_group_backend

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(process_group_backend(cuda=True), store=store, rank=0, world_size=1)
    try:
        loads, avail = torch.arange(4), torch.tensor([1, 0, 1, 1], dtype=torch.int32)
        norm, on_gpu = torch.tensor(2.5, dtype=torch.float64), torch.ones(3, device="cuda")
        dist.all_reduce(loads)
        dist.all_reduce(avail, op=dist.ReduceOp.MAX)
        dist.all_reduce(norm)
        dist.all_reduce(on_gpu)
        dist.barrier()
        assert loads.tolist() == [0, 1, 2, 3] and avail.tolist() == [1, 0, 1, 1] and float(norm) == 2.5
        assert on_gpu.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_bench_train_on_the_gpu_reports_mfu():
    from train.pretrain.bench import bench_train

    out = bench_train(repeats=2, warmup=2, device="cuda")
    assert out["env"]["device"].startswith("cuda")
    assert 0 < out["mfu"] < 1 and out["peak_memory_mb"] > 0


def test_rl_on_the_gpu_matches_the_cpu(tmp_path):
    """``ernie5 rl`` with ``rl.device=cuda``: the policy rolls out and learns on the GPU (batches built
    on the CPU and moved), the rewards of the first step (same seeded draws) and the learner's
    recomputation of the behaviour log-probs agree with the CPU run, and the checkpoint loads on CPU."""
    from dataclasses import replace

    from ernie5.store.checkpoint import checkpoint_dirs, load_checkpoint
    from tests.train.rl.test_trainer import ToyVerifier, _cfg
    from train.rl.config import RLLoopConfig
    from train.rl.trainer import RLTrainer

    base = load(RunConfig, resolve_config_path("micro"), ["train.steps=10", "data.tokenizer_chars=20000"])
    pretrain(replace(base, train=replace(base.train, device="cpu")), tmp_path / "base", quiet=True)
    ckpt = checkpoint_dirs(tmp_path / "base")[-1]
    recs = {}
    for device in ("cpu", "cuda"):
        cfg = _cfg(ckpt, rl=RLLoopConfig(steps=2, init_from=str(ckpt), dtype="fp32", device=device))
        RLTrainer(cfg, tmp_path / device, {"toy": ToyVerifier()}, quiet=True).run()
        lines = (tmp_path / device / "metrics.jsonl").read_text().splitlines()
        recs[device] = [r for r in map(json.loads, lines) if "event" not in r]
    assert recs["cuda"][0]["reward"] == pytest.approx(recs["cpu"][0]["reward"], abs=0.1)
    assert recs["cuda"][0]["logp_mismatch"] < 1e-3
    assert load_checkpoint(checkpoint_dirs(tmp_path / "cuda")[-1]).model is not None
