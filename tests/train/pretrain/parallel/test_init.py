"""Meta-device init of a parallel run (``train.pretrain.parallel.init``): two gloo processes, FSDP2 +
expert parallelism, each holding nothing before sharding and only its shards after, initialise to
exactly the one-process model of the same seed; the trainer builds a parallel run's model this way."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ernie5.config import load
from ernie5.presets import resolve_config_path
from tests.train.pretrain.parallel.test_expert import _free_port
from train.pretrain.config import ParallelConfig, RunConfig
from train.pretrain.parallel.init import init_shards, meta_model, one_process_model
from train.pretrain.parallel.shard import parallelize

SEED = 7


def _cfg():
    return load(RunConfig, resolve_config_path("micro")).model


def _local_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += 0 if t.is_meta else t.numel() * t.element_size()
    return total


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = _cfg()
        model = meta_model(cfg)
        before = _local_bytes(model)
        par = parallelize(
            model, ParallelConfig(dp_shard=2, ep=2), rank=rank, world=2, device="cpu", param_dtype=None
        )
        model.to_empty(device="cpu")
        largest = init_shards(model, cfg, SEED, par.meshes.experts)
        after = _local_bytes(model)
        ref = one_process_model(cfg, SEED)
        named = dict(ref.named_parameters())
        worst = 0.0
        for name, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if ".local." in name:
                first = model.get_submodule(name.rsplit(".", 1)[0]).first
                r = named[name.replace(".local.", ".")][first : first + full.shape[0]]
            else:
                r = named[name]
            worst = max(worst, float((full - r).abs().max()))
        buffers = all(
            float(m.router_bias.abs().max()) == 0 for m in model.modules() if hasattr(m, "router_bias")
        )
        out[rank] = {
            "before": before,
            "after": after,
            "largest": largest,
            "worst": worst,
            "buffers": buffers,
            "inv_freq": bool(torch.equal(model.inv_freq, ref.inv_freq)),
        }
    finally:
        dist.destroy_process_group()


def test_meta_init_holds_only_shards_and_equals_one_process():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
        res = dict(out)
    ref = one_process_model(_cfg(), SEED)
    full_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    largest = max(p.numel() for p in ref.parameters())
    for rank in (0, 1):
        r = res[rank]
        assert r["before"] == 0  # nothing materialised before sharding
        assert r["after"] <= full_bytes / 2 * 1.05, (r["after"], full_bytes)  # its shards, FSDP padding aside
        assert r["largest"] == largest  # at most one full parameter drawn at a time
        assert r["worst"] == 0.0 and r["buffers"] and r["inv_freq"]


def test_one_process_model_is_the_seeded_reset():
    cfg = _cfg()
    a, b = one_process_model(cfg, SEED), one_process_model(cfg, SEED)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    c = one_process_model(cfg, SEED + 1)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
    assert not any(p.is_meta for p in a.parameters())


def test_the_trainer_starts_a_run_from_the_seeded_reset(tmp_path):
    """``ernie5 train`` from scratch (one process) starts from :func:`one_process_model`'s weights."""
    from train.pretrain.loop import Trainer

    cfg = load(RunConfig, resolve_config_path("micro"), ["data.tokenizer_chars=20000"])
    trainer = Trainer(cfg, tmp_path / "run", resume=False, data_dir=None, quiet=True)
    trainer._setup()
    try:
        ref = one_process_model(cfg.model, cfg.train.seed)
        pairs = zip(trainer.model.parameters(), ref.parameters(), strict=True)
        assert all(torch.equal(x, y) for x, y in pairs)
    finally:
        trainer.stream.close()
