"""Sharded train state (``train.pretrain.parallel.checkpoint``) in one process: the DCP state of a plain
model and AdamW round-trips exactly, under the one-process parameter names, and a checkpoint folder
carrying it verifies and loads like any other."""

from __future__ import annotations

import torch

from ernie5.config import load
from ernie5.model.model import Ernie5Model
from ernie5.presets import resolve_config_path
from ernie5.store.checkpoint import load_checkpoint, save_checkpoint
from train.common.optim import make_optimizer
from train.pretrain.config import RunConfig
from train.pretrain.parallel import checkpoint as pc


def _model_and_optimizer(seed: int):
    cfg = load(RunConfig, resolve_config_path("micro"))
    torch.manual_seed(seed)
    model = Ernie5Model(cfg.model)
    opt = make_optimizer(model, cfg.optim)
    return model, opt


def _one_step(model, opt) -> None:
    ids = torch.randint(4, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    model(ids, return_logits=True).logits_BTV.float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_train_state_round_trips_under_one_process_names(tmp_path):
    model, opt = _model_and_optimizer(0)
    _one_step(model, opt)
    state = pc.train_state(model, opt)
    assert set(state["model"]) == set(model.state_dict())
    assert "layers.1.ffn.w13.exp_avg" in state["optim"]
    pc.save_train_state(tmp_path / "dcp", model, opt)

    fresh, fresh_opt = _model_and_optimizer(1)
    pc.load_train_state(tmp_path / "dcp", fresh, fresh_opt)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    by_name = dict(fresh.named_parameters())
    for name, p in model.named_parameters():
        mine, theirs = opt.state[p], fresh_opt.state[by_name[name]]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(mine[key], theirs[key]), (name, key)
    # the next step is the same step
    _one_step(model, opt)
    _one_step(fresh, fresh_opt)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_folder_carries_the_shards_in_its_manifest(tmp_path):
    model, opt = _model_and_optimizer(0)
    pc.save_train_state(tmp_path / "shards", model, opt)
    path = save_checkpoint(tmp_path / "ckpt", model, extra_dirs={pc.DCP_DIR: tmp_path / "shards"})
    assert not (tmp_path / "shards").exists()  # moved, not copied
    meta = (path / "meta.json").read_text()
    assert f'"{pc.DCP_DIR}/.metadata"' in meta
    ckpt = load_checkpoint(path, fast=False, verify=True)
    assert torch.equal(ckpt.model.layers[0].attn.wqkv.weight, model.layers[0].attn.wqkv.weight)
    (path / pc.DCP_DIR / ".metadata").write_bytes(b"corrupt")
    try:
        load_checkpoint(path, fast=False, verify=True)
    except Exception as e:  # noqa: BLE001
        assert "train_state.dcp/.metadata" in str(e)
    else:
        raise AssertionError("a corrupted shard file must fail verification")


def _train_worker(rank: int, port: int, out_dir: str) -> None:
    """One process of a 2-process ``ernie5 train`` (FSDP2 + EP over gloo) that may never gather a
    full tensor: ``DTensor.full_tensor`` and ``redistribute`` raise."""
    import os

    from torch.distributed.tensor import DTensor

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )

    def refuse(*args, **kwargs):
        raise AssertionError("a full tensor was gathered")

    DTensor.full_tensor = refuse
    DTensor.redistribute = refuse
    from train.pretrain.loop import pretrain

    sets = ["train.steps=2", "train.ckpt_every=2", "data.tokenizer_chars=20000", "train.threads=1"]
    sets += ["train.parallel.ep=2", "train.dtype=fp32"]
    pretrain(load(RunConfig, resolve_config_path("micro"), sets), out_dir, quiet=True)


def test_a_parallel_checkpoint_gathers_nothing_and_loads_and_exports_in_one_process(tmp_path):
    """A 2-process run writes its checkpoint as shards only (no process holds the full state); one
    process then reads the weights from the shards, and ``ernie5 export`` consolidates them into
    ``model.safetensors`` with the same weights."""
    import torch.multiprocessing as mp

    from ernie5.store.checkpoint import MODEL_FILE, SHARDS_DIR, checkpoint_dirs, checkpoint_hash
    from jobs.cli import main
    from tests.train.pretrain.parallel.test_expert import _free_port

    run = tmp_path / "run"
    mp.spawn(_train_worker, args=(_free_port(), str(run)), nprocs=2, join=True)
    (ckpt,) = checkpoint_dirs(run)
    assert (ckpt / SHARDS_DIR).is_dir() and not (ckpt / MODEL_FILE).exists()
    loaded = load_checkpoint(ckpt, fast=False)
    assert checkpoint_hash(ckpt)
    out = tmp_path / "export"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert (out / MODEL_FILE).is_file() and not (out / SHARDS_DIR).exists()
    exported = load_checkpoint(out, fast=False)
    a, b = loaded.model.state_dict(), exported.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert exported.tokenizer is not None and exported.meta["exported_from"] == str(ckpt)
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 2  # never overwritten
