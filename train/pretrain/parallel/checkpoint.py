"""Checkpoints of runs over several processes: sharded, and readable at any world size.

A parallel run's checkpoint is the usual checkpoint folder (``ernie5.store.checkpoint``: config,
tokenizer, frozen media models, ``meta.json``) with ``train_state.dcp/`` in place of
``model.safetensors``: the model and AdamW state written by every process for its own shards with
``torch.distributed.checkpoint`` (DCP), so no process ever gathers the whole model to checkpoint.
Whatever loads it in one process (a sweep, ``init_from``) reads the weights from the shards;
``ernie5 export`` writes the consolidated ``model.safetensors``. The run's step and loss-balance
state are in ``meta.json`` (``train_state``).

DCP keys are the one-process model's names (``model.<param>``, ``optim.<param>.<exp_avg|exp_avg_sq
|step>``) and every tensor is described in its GLOBAL shape: FSDP2's parameters are DTensors
already, and an expert-parallel slice (``<layer>.ffn.local.w13``, experts ``[first, first + E_local)``
of ``<layer>.ffn.w13``) is viewed as a DTensor of the full expert tensor on the 3-D expert mesh. So a
run saved by N processes loads into M processes with any sharding and expert split, and into one
process (plain tensors, no process group): DCP reads whatever slices each process's tensors cover.
A one-process run's checkpoint (no shards) continues with several processes too: every process
reads its full optimizer state and keeps its slices (:func:`load_full_optimizer_state`).

References:
  * PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``): load-time resharding.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ernie5.store.checkpoint import SHARDS_DIR, quiet_dcp
from train.pretrain.parallel.expert import LocalExperts

DCP_DIR = SHARDS_DIR


def _global_view(name: str, p: torch.Tensor, model: nn.Module, expert_mesh) -> tuple[str, torch.Tensor]:
    """``(one-process name, tensor in its global shape)`` for parameter ``name`` of a parallel model."""
    if ".local." not in name:
        return name, p
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    assert isinstance(owner, LocalExperts)
    global_name = name.replace(".local.", ".")
    local = p.to_local() if isinstance(p, DTensor) else p
    moe = model.get_submodule(name.rsplit(".", 2)[0])
    n_experts = moe.e_local * moe.ep_size
    shape = (n_experts, *p.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    placements = (Replicate(), Shard(1), Shard(0))
    view = DTensor.from_local(local, expert_mesh, placements, run_check=False, shape=shape, stride=stride)
    return global_name, view


def model_state(model: nn.Module, expert_mesh=None) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by their one-process names, in global shape."""
    out: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for name, t in model.state_dict().items():
        if name in params:
            name, t = _global_view(name, params[name], model, expert_mesh)
        out[name] = t
    return out


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state for every parameter that has none (what its first step creates), so
    that a checkpoint can be loaded into it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, expert_mesh=None) -> dict:
    """AdamW's state by one-process parameter name, moments in global shape (created if missing)."""
    init_optimizer_state(optimizer)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        st = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            gname, view = _global_view(name, st[key], model, expert_mesh)
            out[f"{gname}.{key}"] = view
        gname = name.replace(".local.", ".")
        out[f"{gname}.step"] = st["step"]
    return out


def train_state(model: nn.Module, optimizer: torch.optim.Optimizer, expert_mesh=None) -> dict:
    """The DCP state dict of a run: ``{"model": ..., "optim": ...}``."""
    return {
        "model": model_state(model, expert_mesh),
        "optim": optimizer_state(model, optimizer, expert_mesh),
    }


def save_train_state(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, expert_mesh=None
) -> None:
    """Every process writes its shards of the run's state into ``path`` (collective)."""
    with quiet_dcp():
        dcp.save(train_state(model, optimizer, expert_mesh), checkpoint_id=str(path), no_dist=_no_dist())


def load_train_state(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, expert_mesh=None
) -> None:
    """Load ``path`` (written at any world size) into this process's shards of ``model`` and
    ``optimizer``, in place (collective when a process group is up)."""
    state = train_state(model, optimizer, expert_mesh)
    with quiet_dcp():
        dcp.load(state, checkpoint_id=str(path), no_dist=_no_dist())


def _no_dist() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


@torch.no_grad()
def load_full_optimizer_state(
    full: dict[str, dict[str, torch.Tensor]],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    expert_mesh=None,
) -> None:
    """Put a one-process AdamW state (``{param name: {exp_avg, exp_avg_sq, step}}``, full tensors,
    present on every process) into this process's shards (each takes its own slice; no
    communication)."""
    for key, target in optimizer_state(model, optimizer, expert_mesh).items():
        name, what = key.rsplit(".", 1)
        src = full[name][what]
        if isinstance(target, DTensor):
            mine = distribute_tensor(src, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(mine.to_local())
        else:
            target.copy_(src)
