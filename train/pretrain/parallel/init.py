"""A parallel run's model made on the meta device and initialised shard by shard: no process ever holds
the full model.

:func:`meta_model` builds the :class:`~ernie5.model.model.Ernie5Model` on the meta device (shapes, no
storage); :func:`train.pretrain.parallel.shard.parallelize` then shards it as usual, ``to_empty``
gives every process storage for its own shards only, and :func:`init_shards` fills them: for every
parameter, in the one-process model's ``named_parameters`` order, the full tensor is drawn on the
CPU from the global RNG by the model's own rule (:func:`ernie5.model.model.init_parameter_`), this
process keeps its slice (an expert-parallel slice, an FSDP2 shard, or both:
``distribute_tensor(..., src_data_rank=None)`` slices locally, no communication), and the tensor is
dropped before the next is drawn. Every process draws the same stream, so the model equals the
one-process model that :func:`one_process_model` makes from the same seed, exactly; the most any
process holds at once beyond its shards is one parameter (the largest: an embedding or one layer's
stacked experts).

References:
  * PyTorch FSDP2 meta-device initialisation (``fully_shard`` on meta, ``to_empty``, init after), as
    torchtitan does it (arXiv 2410.06511).

Deviations:
  1. The draws are the full tensors' (the one-process stream), not per-shard random ops on DTensors
     (torchtitan's), so that a run at any world size starts from the same weights; each process pays
     the draw of every full tensor (CPU time, not memory).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ernie5.model.config import ModelConfig
from ernie5.model.model import Ernie5Model, init_parameter_
from train.pretrain.parallel.checkpoint import model_state


def meta_model(cfg: ModelConfig) -> Ernie5Model:
    """The model's shapes on the meta device (no storage; not initialised)."""
    with torch.device("meta"):
        return Ernie5Model(cfg)


def one_process_model(cfg: ModelConfig, seed: int) -> Ernie5Model:
    """The one-process model from ``seed``: made on the meta device, materialised on the CPU and
    initialised by :meth:`~ernie5.model.model.Ernie5Model.reset_parameters` right after
    ``torch.manual_seed(seed)``: the weights :func:`init_shards` gives a parallel run."""
    model = meta_model(cfg).to_empty(device="cpu")
    torch.manual_seed(seed)
    model.reset_parameters()
    return model


@torch.no_grad()
def init_shards(model: nn.Module, cfg: ModelConfig, seed: int, expert_mesh=None) -> int:
    """Initialise a parallelized, ``to_empty``-materialised model's shards as :func:`one_process_model`
    would initialise the whole (see the module docstring); returns the largest number of elements
    drawn at once (one parameter)."""
    views = model_state(model, expert_mesh)
    torch.manual_seed(seed)
    largest = 0
    for name, p in meta_model(cfg).named_parameters():
        full = torch.empty(p.shape, dtype=torch.float32)
        init_parameter_(name, full, cfg)
        largest = max(largest, full.numel())
        target = views[name]
        if isinstance(target, DTensor):
            mine = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(mine.to_local())
        else:
            target.copy_(full)
        del full
    model.reset_buffers()
    return largest
