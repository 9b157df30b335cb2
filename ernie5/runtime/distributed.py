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


def init_dist() -> Dist:
    """Join the process group started by ``accelerate launch --multi_gpu`` (gloo on CPU), if any."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist()
    from accelerate import PartialState

    state = PartialState(backend=None if torch.cuda.is_available() else "gloo")
    return Dist(state.process_index, state.num_processes)


def pick_device(name: str) -> torch.device:
    """The device a process trains on: ``auto`` = CUDA when a GPU is visible (the GPU of the
    process's ``LOCAL_RANK``), else CPU; ``cuda`` without a GPU is a ``ValueError``."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device={name!r}, but no CUDA GPU is visible to this process")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
