"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

from ernie5.kernels import attention_status
from ernie5.kernels import status as kernel_status


def synchronizer(device: torch.device | str = "cpu") -> Callable[[], None]:
    """What to call before reading a wall clock so that work queued on ``device`` is done: nothing
    on CPU, ``torch.cuda.synchronize`` on a CUDA device."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def resolve_device(name: str) -> torch.device:
    """``cpu`` or ``cuda[:N]`` as a device; a ValueError naming ``name`` if it is neither or if no
    such CUDA device is present."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: expected cpu or cuda[:N]")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"--device {name!r}: this machine has {count} CUDA device(s)")
    return device


def median_seconds(
    fn: Callable[[], object], repeats: int = 5, warmup: int = 2, device: torch.device | str = "cpu"
) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` untimed runs (each run
    synchronised with ``device``)."""
    sync = synchronizer(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def alternating_medians(
    fns: dict[str, Callable[[], object]],
    repeats: int = 5,
    warmup: int = 2,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Median wall time of each of ``fns``, timed in alternating rounds (one run of each per round
    after ``warmup`` untimed rounds), so that ratios between them compare runs taken moments apart:
    on a shared VM, contention comes in bursts that would otherwise land on one side only."""
    sync = synchronizer(device)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(1, repeats)):
        for name, fn in fns.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def matmul_peak(
    dtype: torch.dtype, n: int = 2048, repeats: int = 10, device: torch.device | str = "cpu"
) -> float:
    """Median FLOP/s of ``repeats`` timed ``n x n @ n x n`` products in ``dtype`` after three
    untimed ones: the machine peak of perf-anchors.md §2, so that MFU figures sit next to the
    peer's. Contention on a shared VM can only lower it, so ``ernie5 bench train`` measures it
    before and after its timed steps and keeps the higher figure, as perf-anchors.md does."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / median_seconds(lambda: a @ b, repeats, warmup=3, device=device)


def memory_bandwidth(device: torch.device | str = "cpu", mib: int | None = None, repeats: int = 10) -> float:
    """Median bytes/s of copying one ``mib``-MiB buffer into another on ``device`` (read + write
    counted; default 1024 MiB on a GPU, 256 on the CPU): the memory bound a decode step is measured
    against (``ernie5 bench decode``)."""
    device = torch.device(device)
    n = (mib or (1024 if device.type == "cuda" else 256)) * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), repeats, warmup=2, device=device)


@functools.cache
def machine_peak(dtype: torch.dtype, device: str = "cpu") -> float:
    """:func:`matmul_peak` measured once per process and device (the MFU denominator of ``ernie5
    train``; on a GPU, its measured bf16 or fp32 matmul peak)."""
    return matmul_peak(dtype, n=8192 if torch.device(device).type == "cuda" else 2048, device=device)


def environment(device: torch.device | str = "cpu") -> dict:
    """Threads and CPU capability (and the GPU, when ``device`` is one) recorded with every benchmark."""
    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernels": kernel_status(),
        "attention": attention_status(),
        "device": str(device),
    }
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env
