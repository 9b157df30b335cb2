"""``parallelize(model, cfg, ...)``: the one step that spreads a model over processes with PyTorch's own
engine, from outside the model (its maths is untouched; see :mod:`train.pretrain.parallel.expert`).

With ``W`` processes, ``S = train.parallel.dp_shard`` (-1: ``W``) and ``ep = train.parallel.ep``:

* expert parallelism (``ep > 1``): every MoE layer keeps ``n_experts / ep`` of its routed experts
  per process (:func:`train.pretrain.parallel.expert.shard_experts`); ranks ``k*ep .. k*ep + ep - 1`` form
  one expert-parallel group;
* FSDP2 (``torch.distributed.fsdp.fully_shard``) over a ``DeviceMesh``: each backbone block is one
  unit and the rest of the model (embeddings, head, norms, MTP, vision and audio modules) the root
  unit, sharded over ``S`` processes and replicated over ``W / S`` (HSDP; ``S = 1`` replicates
  like DDP); every MoE layer's expert slice is its own unit over the ``W / ep`` processes that hold
  the same slice, sharded on dim 1 over ``S / ep`` of them (replicated when ``S = 1``). Parameters
  stay fp32 (the master weights); with ``train.dtype: bf16`` FSDP2 gathers them in bf16 for the
  forward and backward and reduces gradients in fp32 (``MixedPrecisionPolicy``);
* explicit forward and backward prefetch between consecutive blocks (:func:`prefetch`);
* activation checkpointing (``torch.distributed._composable.checkpoint`` on each block) and
  activation offload (:meth:`Parallel.forward_context`) as switches.

Gradients come out as the average over all ``W`` processes' micro-batches: FSDP2's reduce-scatter
/ all-reduce divides by its mesh size, and the expert units, whose gradient already sums the
expert-parallel group's tokens, get a further ``1 / ep`` (:meth:`Parallel.finish_grads`). So
``W`` processes with ``A`` micro-batches each compute the update of one process accumulating
``W * A`` (``train.pretrain.loop``).

References:
  * PyTorch FSDP2 (``fully_shard``, per-parameter DTensor sharding; Zhao et al. 2023, arXiv
    2304.11277 for FSDP) and torchtitan (arXiv 2410.06511): the composable parallelize step.
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §4: hybrid parallelism (expert + data) with
    sharded optimizer state.

Deviations:
  1. No tensor, pipeline or context parallelism: the data and expert dimensions only.
  2. A root-unit parameter (e.g. the vision encoder) that a process did not use in a micro-batch
     gets a zero gradient there (:meth:`Parallel.touch_root`): FSDP2 reduces only gradients that
     exist, so every process must produce the same set. Where no process used it in a whole step,
     AdamW then applies its weight decay, which one process (gradient None, parameter skipped)
     would not.
  3. The CPU fused optimizer kernels (``train.pretrain.precision``) are single-process: a parallel run
     steps ``torch.optim.AdamW`` (foreach) on the sharded fp32 parameters.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from train.common.optim import BACKBONE_DECAY, OptimConfig, decayed
from train.pretrain.config import ParallelConfig
from train.pretrain.parallel.expert import ExpertParallelError, LocalExperts, shard_experts, take_a2a_bytes


@dataclass
class Meshes:
    """The two device meshes of a run: ``dp`` (replicate, shard) for everything but the experts,
    ``experts`` (replicate, shard, ep) for the expert slices."""

    dp: DeviceMesh
    experts: DeviceMesh


def plan_meshes(world: int, cfg: ParallelConfig, device: str) -> Meshes:
    """Both meshes over the ``world`` processes, checked against ``cfg`` (one-line errors)."""
    shard = world if cfg.dp_shard == -1 else cfg.dp_shard
    if world % shard:
        raise ExpertParallelError(
            f"train.parallel.dp_shard={cfg.dp_shard} does not divide the world size {world}"
        )
    if world % cfg.ep:
        raise ExpertParallelError(f"train.parallel.ep={cfg.ep} does not divide the world size {world}")
    if shard > 1 and shard % cfg.ep:
        raise ExpertParallelError(
            f"train.parallel.ep={cfg.ep} must divide train.parallel.dp_shard={shard} (or set dp_shard=1)"
        )
    e_shard = shard // cfg.ep if shard > 1 else 1
    e_rep = world // cfg.ep // e_shard
    dp = init_device_mesh(device, (world // shard, shard), mesh_dim_names=("rep", "shard"))
    experts = init_device_mesh(device, (e_rep, e_shard, cfg.ep), mesh_dim_names=("e_rep", "e_shard", "ep"))
    return Meshes(dp, experts)


class Parallel:
    """A model after :func:`parallelize`: its meshes, expert layers and the step helpers."""

    def __init__(self, model: nn.Module, meshes: Meshes, cfg: ParallelConfig, world: int) -> None:
        self.model, self.meshes, self.cfg, self.world = model, meshes, cfg, world
        self.moe_layers: list[nn.Module] = []
        self.expert_params: list[nn.Parameter] = []

    # ------------------------------------------------------------------ the step
    def forward_context(self):
        """Context for a micro-batch's forward: saved activations in host memory when
        ``activation_offload`` (a no-op on CPU, where they already are)."""
        if self.cfg.activation_offload and next(self.model.parameters()).device.type == "cuda":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return nullcontext()

    def touch_root(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus zero times every root-unit parameter (deviation 2), called while the root
        parameters are still gathered (between the forward and the backward)."""
        zero = sum((p.sum() for p in self._gathered_root() if p.requires_grad), loss.new_zeros(()))
        return loss + 0.0 * zero.to(loss.dtype)

    def _gathered_root(self) -> list[torch.Tensor]:
        out = []
        for mod in self.model.modules():
            if mod is not self.model and isinstance(mod, FSDPModule):
                continue
            for p in mod.parameters(recurse=False):
                if not isinstance(p, DTensor):
                    out.append(p)
        return out

    def take_a2a_bytes(self) -> int:
        """All-to-all bytes this process sent since the last call."""
        return take_a2a_bytes(self.moe_layers)

    @torch.no_grad()
    def finish_grads(self, max_norm: float) -> float:
        """After the step's last backward: bring the expert slices' gradients to the average over
        all processes (FSDP2 divided their sum over the expert-parallel group by the ``W / ep``
        processes it reduced over: a further ``1 / ep``; a custom divide factor would need the
        PREMUL_SUM reduction, which gloo lacks), then clip like :func:`clip_grad_norm`."""
        if self.cfg.ep > 1:
            for p in self.expert_params:
                if p.grad is not None:
                    p.grad.to_local().div_(self.cfg.ep)
        return self.clip_grad_norm(max_norm)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm over every process's shards (each element counted once), and the
        gradients scaled by ``min(1, max_norm / (norm + 1e-6))`` when ``max_norm > 0``."""
        total = None  # summed where the gradients live: one host copy per step, not per tensor
        grads = []
        for p in self.model.parameters():
            g = p.grad
            if g is None:
                continue
            grads.append(g)
            local = g.to_local() if isinstance(g, DTensor) else g
            sq = local.double().square().sum() / _replicas(g, self.world)
            total = sq if total is None else total + sq
        total = torch.zeros((), dtype=torch.float64) if total is None else total.cpu()
        dist.all_reduce(total)
        norm = math.sqrt(float(total))
        if max_norm > 0:
            scale = min(1.0, max_norm / (norm + 1e-6))
            if scale < 1.0:
                for g in grads:
                    (g.to_local() if isinstance(g, DTensor) else g).mul_(scale)
        return norm if max_norm > 0 else float("nan")

    def memory(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this process holds of parameters, gradients and optimizer state (local shards)."""

        def nbytes(t) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        params = sum(nbytes(p) for p in self.model.parameters())
        grads = sum(nbytes(p) for p in self.model.parameters())  # fp32, one per parameter
        state = sum(
            nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
        return {"param_bytes": params, "grad_bytes": grads, "optim_bytes": state}


def _replicas(t: torch.Tensor, world: int) -> int:
    """How many processes hold each element of ``t``'s local shard: the sizes of its replicated mesh
    dimensions for a DTensor; ``world`` for a plain tensor (every process holds all of it)."""
    if not isinstance(t, DTensor):
        return world
    n = 1
    for i, pl in enumerate(t.placements):
        if pl.is_replicate():
            n *= t.device_mesh.size(i)
    return n


def parallelize(
    model: nn.Module,
    cfg: ParallelConfig,
    *,
    rank: int,
    world: int,
    device: str,
    param_dtype: torch.dtype | None,
    block_names: str = "layers",
) -> Parallel:
    """Spread ``model`` (an :class:`~ernie5.model.model.Ernie5Model`, fast paths already applied or
    not) over the ``world`` processes, in place; returns the :class:`Parallel` handle."""
    meshes = plan_meshes(world, cfg, device)
    par = Parallel(model, meshes, cfg, world)
    ep_coord = meshes.experts.get_coordinate()
    if cfg.ep > 1:
        par.moe_layers = shard_experts(
            model, ep_coord[2], cfg.ep, meshes.experts.get_group("ep"), param_dtype or torch.float32
        )
    blocks = list(getattr(model, block_names))
    if cfg.activation_checkpoint:
        from torch.distributed._composable import checkpoint

        for block in blocks:
            checkpoint(block)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    expert_mesh = meshes.experts["e_rep", "e_shard"]
    for mod in model.modules():
        if isinstance(mod, LocalExperts):
            for p in (mod.w13, mod.w2):
                if p.shape[1] % expert_mesh.size(1):
                    raise ExpertParallelError(
                        f"expert weight dim 1 ({p.shape[1]}) is not divisible by the {expert_mesh.size(1)} "
                        "processes that shard each expert slice"
                    )
            fully_shard(mod, mesh=expert_mesh, mp_policy=mp, shard_placement_fn=lambda p: Shard(1))
            par.expert_params += [mod.w13, mod.w2]
    for block in blocks:
        fully_shard(block, mesh=meshes.dp, mp_policy=mp)
    fully_shard(model, mesh=meshes.dp, mp_policy=mp, reshard_after_forward=False)
    prefetch(blocks)
    return par


def prefetch(blocks: list[nn.Module]) -> None:
    """Explicit FSDP2 prefetch: each block's all-gather issues the next block's in the forward and the
    previous block's in the backward, so the gathers overlap the compute instead of waiting on it
    (FSDP2's implicit prefetch only starts a unit's gather when that unit is reached)."""
    for prev, nxt in zip(blocks, blocks[1:], strict=False):
        prev.set_modules_to_forward_prefetch([nxt])
        nxt.set_modules_to_backward_prefetch([prev])


def make_sharded_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW (foreach) over the sharded parameters: matrices decayed, the rest not (as
    ``train.common.optim.make_optimizer``), one group per (decay, mesh) so no foreach call mixes meshes."""
    groups: dict[tuple, list] = {}
    for name, p in model.named_parameters():
        decay = decayed(name, p, **BACKBONE_DECAY)
        mesh = tuple(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        groups.setdefault((not decay, mesh), []).append(p)
    param_groups = [
        {"params": ps, "weight_decay": 0.0 if no_decay else cfg.weight_decay}
        for (no_decay, _), ps in sorted(groups.items())
    ]
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=True)
