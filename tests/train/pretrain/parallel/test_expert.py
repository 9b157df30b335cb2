"""Expert parallelism (``train.pretrain.parallel.expert``) against the one-process model: two gloo processes
each own half the experts of every MoE layer; the loss and every gradient (the expert slices
compared with the matching rows of the reference's) equal the one-process model's on the union of
the two processes' batches, for the full model and an elastic sub-model whose width mask leaves one
process without experts in some layers. The owners' expert compute is the eager loop, the CPU's
``sorted`` path, or the GPU's ``grouped`` GEMMs (``torch._grouped_mm`` runs on the CPU too)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ernie5.config import load
from ernie5.fast import apply_fast_paths
from ernie5.model.elastic import Subnet
from ernie5.model.inputs import Targets
from ernie5.model.model import Ernie5Model
from ernie5.presets import resolve_config_path
from train.pretrain.config import ParallelConfig, RunConfig
from train.pretrain.parallel.expert import ExpertParallelError, shard_experts
from train.pretrain.parallel.shard import parallelize, plan_meshes

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _subnets(cfg) -> list[Subnet]:
    full = Subnet.full(cfg.model)
    e = cfg.model.moe.n_experts
    # the first half of the experts only: process 1 owns none of them
    narrow = tuple(
        tuple(range(e // 2)) if cfg.model.is_moe_layer(i) else None for i in range(cfg.model.n_layers)
    )
    return [full, Subnet((0, 1, 3), narrow, 1, "d3-w4-k1")]


def _worker(rank: int, port: int, path: str, ep: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        cfg = load(RunConfig, resolve_config_path("micro"))
        torch.manual_seed(0)
        ref = Ernie5Model(cfg.model)
        model = Ernie5Model(cfg.model)
        model.load_state_dict(ref.state_dict())
        if path != "eager":  # auto: the CPU's sorted path; grouped: the GPU's, forced here
            apply_fast_paths(model, moe_path=path)
        par = parallelize(
            model, ParallelConfig(ep=ep), rank=rank, world=WORLD, device="cpu", param_dtype=None
        )
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(4, 500, (2 * WORLD, 48), generator=gen)
        tgt = torch.randint(4, 500, (2 * WORLD, 48), generator=gen)
        ones = torch.ones_like(tgt, dtype=torch.float32)
        worst, losses = 0.0, []
        for sub in _subnets(cfg):
            for p in (*model.parameters(), *ref.parameters()):
                p.grad = None
            mine = slice(2 * rank, 2 * rank + 2)
            out_ = model(ids[mine], targets=Targets(tgt[mine], ones[mine]), subnet=sub, return_logits=False)
            par.touch_root(out_.losses.text).backward()
            par.finish_grads(0.0)
            ref_out = ref(ids, targets=Targets(tgt, ones), subnet=sub, return_logits=False)
            ref_out.losses.text.backward()
            loss = out_.losses.text.detach().clone()
            dist.all_reduce(loss)
            losses.append((float(loss) / WORLD, float(ref_out.losses.text)))
            named = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                if p.grad is None:  # a layer the sub-model skips: no gradient in either model
                    assert named[name.replace(".local.", ".")].grad is None, name
                    continue
                g = p.grad.full_tensor()
                if ".local." in name:
                    first = model.get_submodule(name.rsplit(".", 1)[0]).first
                    r = named[name.replace(".local.", ".")].grad
                    r = r[first : first + g.shape[0]] if r is not None else torch.zeros_like(g)
                else:
                    r = named[name].grad
                    r = torch.zeros_like(g) if r is None else r  # unused by the loss: zero (touch_root)
                # relative to the tensor's scale, with a floor: top-1 gates renormalise to exactly 1,
                # so the router's gradient is rounding noise around zero there
                worst = max(worst, float((g - r).abs().max()) / max(float(r.abs().max()), 1e-3))
        out[rank] = {"worst": worst, "losses": losses, "a2a": par.take_a2a_bytes()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path", ["eager", "auto", "grouped"])
def test_two_process_expert_parallel_equals_one_process(path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), path, 2, out), nprocs=WORLD, join=True)
        res = dict(out)
    for rank in range(WORLD):
        assert res[rank]["worst"] < 1e-5, res[rank]
        for mine, ref in res[rank]["losses"]:
            assert mine == pytest.approx(ref, rel=1e-6)
        assert res[rank]["a2a"] > 0


def test_mesh_and_expert_split_errors_are_one_line():
    with pytest.raises(ExpertParallelError, match=r"ep=3 does not divide the world size 4"):
        plan_meshes(4, ParallelConfig(ep=3), "cpu")
    with pytest.raises(ExpertParallelError, match=r"dp_shard=3 does not divide the world size 4"):
        plan_meshes(4, ParallelConfig(dp_shard=3), "cpu")
    with pytest.raises(ExpertParallelError, match=r"ep=4 must divide train.parallel.dp_shard=2"):
        plan_meshes(4, ParallelConfig(ep=4, dp_shard=2), "cpu")
    cfg = load(RunConfig, resolve_config_path("micro"))
    with pytest.raises(ExpertParallelError, match=r"ep=3 does not divide model.moe.n_experts=8"):
        shard_experts(Ernie5Model(cfg.model), 0, 3, None, torch.float32)
