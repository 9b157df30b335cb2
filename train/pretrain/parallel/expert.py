"""Expert parallelism: each process of an expert-parallel group owns a slice of every MoE layer's
routed experts, and tokens travel to their experts and back by all-to-all.

Applied from outside the model (:func:`shard_experts`), like :func:`ernie5.fast.apply_fast_paths`:
every MoE layer's class becomes a subclass whose :meth:`~ernie5.model.moe.MoE.experts` (step 4 of
the layer, the expert compute) is replaced; routing (steps 1-3, the router and its selection-only
balancing bias) runs unchanged on every process over the GLOBAL expert dimension, so the router's
weights, its bias and the elastic width mask are those of the one-process model. The layer's
``w13``/``w2`` parameters move into a child module ``local`` (:class:`LocalExperts`) holding only
this process's experts ``[rank * E/ep, (rank + 1) * E/ep)``, so FSDP2 can shard them over the
processes that hold the same slice (:mod:`train.pretrain.parallel.shard`).

One forward of a layer (dropless; ``P = N * top_k`` routed (token, slot) pairs):
  1. pairs are sorted by expert, which groups them by owner (experts are contiguous per owner);
  2. the per-owner pair counts are exchanged (one small all-to-all), then the pairs' hidden rows
     and local expert ids go to their owners (``all_to_all_single`` with uneven splits; the rows
     through the autograd version, so gradients come back the same way);
  3. each owner runs its experts on what it received (the fast ``sorted`` path on CPU, ``grouped``
     for bf16 on CUDA, the model's loop otherwise), with unit gates;
  4. the outputs return by the inverse all-to-all, and each token's gated sum is formed where the
     token lives, so the gates (and the router's gradient) never leave their process.
A process whose experts are all masked by the sampled sub-model (elastic width) receives no rows
but still joins every collective; its experts get a zero gradient, as in one process, where the
layer's expert tensor gets one whenever the layer runs.

References:
  * GShard (arXiv 2006.16668) and Switch Transformer (arXiv 2101.03961): experts sharded over
    devices, tokens dispatched and combined by all-to-all.
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §4 (infrastructure: expert parallelism among the
    hybrid parallel strategies), §3.2 (no token dropping).
  * torchtitan's expert parallelism (tokens sorted by expert, counts exchanged, then the rows).

Deviations:
  1. The report gives no detail of its expert-parallel kernels; this is the plain two-all-to-all
     scheme with no overlap of communication and expert compute.
  2. The gated sum is formed at the token's process (gates multiply the returned rows), where the
     model's reference multiplies inside each expert call: the same product, summed in another
     order, so fp32 results agree to rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from ernie5.model.moe import MoE, RouterOutput, experts_loop


class ExpertParallelError(ValueError):
    """The model cannot be split as asked (one-line message)."""


class LocalExperts(nn.Module):
    """This process's slice of one MoE layer's routed experts: ``w13 (E_local, 2F, D)``,
    ``w2 (E_local, D, F)``; ``forward`` runs each received row through its (local) expert."""

    def __init__(self, w13_EFD: torch.Tensor, w2_EDF: torch.Tensor, first: int, path: str) -> None:
        super().__init__()
        self.w13 = nn.Parameter(w13_EFD)
        self.w2 = nn.Parameter(w2_EDF)
        self.first = first
        """Global id of the first expert held here."""
        self.path = path
        """``sorted`` | ``grouped`` | ``loop``: the expert compute (:mod:`ernie5.fast.moe`)."""

    def forward(self, x_PD: torch.Tensor, local_ids_P: torch.Tensor) -> torch.Tensor:
        """Unweighted expert outputs ``(P, D)`` of rows ``x_PD`` routed to local experts ``local_ids_P``."""
        w13, w2 = self.w13, self.w2
        if x_PD.shape[0] == 0:  # nothing routed here: still a (zero) gradient for the slice
            return x_PD + 0.0 * (w13.sum() + w2.sum()).to(x_PD.dtype)
        counts_E = torch.zeros(w13.shape[0], dtype=torch.long, device=x_PD.device)
        counts_E.scatter_add_(0, local_ids_P, torch.ones_like(local_ids_P))
        gates_P1 = torch.ones(x_PD.shape[0], 1, dtype=torch.float32, device=x_PD.device)
        r = RouterOutput(local_ids_P[:, None], gates_P1, counts_E)
        if self.path == "sorted":
            from ernie5.fast.moe_levels import experts_sorted

            return experts_sorted(x_PD, w13, w2, r)
        if self.path == "grouped":
            from ernie5.fast.moe import experts_grouped

            return experts_grouped(x_PD, w13, w2, r)
        return experts_loop(x_PD, w13, w2, r)


class ExpertParallel:
    """Mixin put in front of a model MoE class by :func:`shard_experts` (adds no state but
    ``local``, ``ep_group`` and the traffic counter)."""

    local: LocalExperts
    ep_group: dist.ProcessGroup
    ep_size: int
    e_local: int
    a2a_bytes: int = 0
    """Bytes this process sent by all-to-all (rows and ids, dispatch and combine) since the last
    :func:`take_a2a_bytes`; the backward's return traffic equals the forward's and is not counted."""

    def experts(self, x_ND: torch.Tensor, r: RouterOutput) -> torch.Tensor:  # noqa: D102
        n, a = r.expert_ids_NA.shape
        e_local = self.e_local
        ids_P = r.expert_ids_NA.reshape(-1)
        order_P = torch.argsort(ids_P, stable=True)
        tok_P = order_P // a
        ids_sorted_P = ids_P.index_select(0, order_P)
        owner_P = ids_sorted_P // e_local
        send_R = torch.zeros(self.ep_size, dtype=torch.long, device=ids_P.device)
        send_R.scatter_add_(0, owner_P, torch.ones_like(owner_P))
        recv_R = torch.empty_like(send_R)
        dist.all_to_all_single(recv_R, send_R, group=self.ep_group)
        send, recv = send_R.tolist(), recv_R.tolist()
        x_send_PD = x_ND.index_select(0, tok_P)
        local_send_P = ids_sorted_P - owner_P * e_local
        local_recv = torch.empty(sum(recv), dtype=local_send_P.dtype, device=ids_P.device)
        dist.all_to_all_single(local_recv, local_send_P, recv, send, group=self.ep_group)
        x_recv = funcol.all_to_all_single_autograd(x_send_PD, recv, send, self.ep_group)
        y_recv = self.local(_wait(x_recv), local_recv)
        y_back_PD = _wait(funcol.all_to_all_single_autograd(y_recv, send, recv, self.ep_group))
        gate_P1 = r.gates_NA.reshape(-1).index_select(0, order_P).unsqueeze(1).to(y_back_PD.dtype)
        row_bytes = x_ND.shape[1] * x_ND.element_size()
        self.a2a_bytes += 2 * row_bytes * sum(send) + local_send_P.element_size() * sum(send)
        return torch.zeros_like(x_ND).index_add_(0, tok_P, y_back_PD * gate_P1)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


def expert_path(moe: MoE, device: torch.device, dtype: torch.dtype) -> str:
    """The local expert compute: the fast layer's batch path (``sorted`` / ``grouped``), or the
    model's loop for an eager layer."""
    from ernie5.fast.moe import FastMoE, batch_dispatch

    if not isinstance(moe, FastMoE):
        return "loop"
    if moe.path in ("sorted", "grouped", "loop"):
        return moe.path
    return batch_dispatch(device, dtype)


def shard_experts(model: nn.Module, ep_rank: int, ep_size: int, group: dist.ProcessGroup, dtype) -> list[MoE]:
    """Keep only experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` of every MoE layer of ``model``
    (in place) and route their tokens by all-to-all over ``group``; returns the layers."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in layers:
        n_exp = moe.w13.shape[0]
        if n_exp % ep_size:
            raise ExpertParallelError(
                f"train.parallel.ep={ep_size} does not divide model.moe.n_experts={n_exp}"
            )
        e_local = n_exp // ep_size
        lo = ep_rank * e_local
        w13 = moe.w13.detach()[lo : lo + e_local].clone()
        w2 = moe.w2.detach()[lo : lo + e_local].clone()
        path = expert_path(moe, w13.device, dtype)
        del moe.w13, moe.w2
        base = type(moe)
        moe.__class__ = type(f"ExpertParallel{base.__name__}", (ExpertParallel, base), {})
        moe.local = LocalExperts(w13, w2, lo, path)
        moe.ep_group, moe.ep_size, moe.e_local = group, ep_size, e_local
    return layers


def take_a2a_bytes(layers: list[MoE]) -> int:
    """All-to-all bytes sent by ``layers`` since the last call (and reset the counters)."""
    total = 0
    for moe in layers:
        total += getattr(moe, "a2a_bytes", 0)
        moe.a2a_bytes = 0
    return total
