"""Process-group facts for data-parallel runs started by ``accelerate launch`` / torchrun."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Dist:
    """Rank and world size; a single process when not launched for data parallelism."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Whether this process writes shared files."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every process (no-op for one process)."""
        if self.world > 1:
            torch.distributed.barrier()

    def broadcast(self, value):
        """Process 0's ``value`` (any picklable object) on every process (``value`` itself for one)."""
        if self.world == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]


def process_group_backend(cuda: bool) -> str:
    """The ``torch.distributed`` backend of a run's process group: gloo on a CPU-only machine; with
    CUDA, NCCL for CUDA tensors and gloo for CPU tensors. The trainer all-reduces CPU bookkeeping
    (expert loads for the router bias, the gradient norm's sum, all-to-all byte counts) and a run may
    keep its model on the CPU (``train.device=cpu``); NCCL alone has no backend for CPU tensors, so
    those collectives would fail ("No backend type associated with device type cpu")."""
    return "cuda:nccl,cpu:gloo" if cuda else "gloo"


def init_dist() -> Dist:
    """Join the process group started by ``accelerate launch --multi_gpu`` / torchrun, if any
    (backend: :func:`process_group_backend`)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist()
    from accelerate import PartialState

    state = PartialState(backend=process_group_backend(torch.cuda.is_available()))
    return Dist(state.process_index, state.num_processes)


DEVICES = "auto, cpu, cuda or cuda:N"
"""The device names the jobs take (``--device``)."""


def parse_device(name: str) -> tuple[str, int | None]:
    """``(kind, index)`` of a device name (one-line ``ValueError`` for anything else)."""
    kind, sep, index = name.partition(":")
    if kind in ("auto", "cpu", "cuda") and not sep:
        return kind, None
    if kind == "cuda" and index.isdigit():
        return kind, int(index)
    raise ValueError(f"device={name!r}: expected {DEVICES}")


def check_device(name: str) -> None:
    """Raise the one-line ``ValueError`` :func:`pick_device` would, without touching any GPU."""
    kind, index = parse_device(name)
    if kind != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device={name!r}, but no CUDA GPU is visible to this process")
    if index is not None and index >= torch.cuda.device_count():
        raise ValueError(
            f"device={name!r}, but this process sees {torch.cuda.device_count()} GPU(s) (cuda:0 .. "
            f"cuda:{torch.cuda.device_count() - 1})"
        )


def pick_device(name: str) -> torch.device:
    """The device a process runs on: ``auto`` = CUDA when a GPU is visible, else CPU; ``cuda`` = the
    GPU of the process's ``LOCAL_RANK`` (so each process of a launch gets its own); ``cuda:N`` = GPU
    ``N``; a CUDA name without a GPU (or ``N`` out of range) is a one-line ``ValueError``. A CUDA
    device becomes the process's current one."""
    check_device(name)
    kind, index = parse_device(name)
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
