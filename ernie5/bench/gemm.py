"""``ernie5 bench gemm``: the routed experts' grouped GEMMs against a dense matmul of the same FLOPs.

One MoE layer's expert products at a shape (``SHAPES``): ``tokens`` tokens, each routed to ``top_k``
of ``n_experts`` experts (``P = tokens * top_k`` rows, routed uniformly at random, so the groups are
ragged as in training), through ``W13`` (``d_model -> 2 * d_expert``) and ``W2`` (``d_expert ->
d_model``): the two ``torch._grouped_mm`` calls of :func:`ernie5.fast.moe.experts_grouped` over the
rows already sorted by expert, ``6 * P * d_model * d_expert`` FLOPs in all. Beside it, on the same
device, in the same dtype and in alternating rounds (:func:`ernie5.bench.timing.alternating_medians`):

  * ``dense``: one ``(P, d_model) @ (d_model, 3 * d_expert)`` product, the same FLOPs in one GEMM:
    what the experts would cost if they were one dense layer;
  * ``peak``: the device's square matmul peak (``n x n @ n x n``; 8192 on a GPU, 2048 on the CPU).

``grouped_over_dense = grouped TFLOP/s / dense TFLOP/s`` is the figure issue 42 sets a goal for (>=
0.6 on an H100); ``grouped_over_peak`` the same against the square peak. ``shape="gpu"`` (the
default on CUDA) fills an H100: 64 experts of 1536 on d_model 4096, 16384 tokens top-8 (a
DeepSeek-/ERNIE-style layer); ``"nano"`` (the default on the CPU) is the perf-anchors.md layer. On
the CPU ``torch._grouped_mm`` is PyTorch's fallback loop, which the CPU layer never runs (it has its
own expert kernels: ``ernie5 bench moe``), so a CPU ratio says little about training there.
"""

from __future__ import annotations

import torch

from ernie5.bench.timing import alternating_medians, environment, matmul_peak

SHAPES = {
    "nano": {"tokens": 2048, "d_model": 256, "n_experts": 64, "d_expert": 256, "top_k": 2},
    "gpu": {"tokens": 16384, "d_model": 4096, "n_experts": 64, "d_expert": 1536, "top_k": 8},
}
"""Named shapes of :func:`bench_gemm`."""


def routed_rows(tokens: int, n_experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """Rows per expert (int64, sums to ``tokens * top_k``) of ``top_k`` distinct experts drawn
    uniformly per token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, n_experts, generator=gen).topk(top_k, dim=1).indices
    return torch.bincount(ids.reshape(-1), minlength=n_experts)


def bench_gemm(
    shape: str | None = None,
    repeats: int = 10,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> dict:
    """Time the grouped expert GEMMs, the dense GEMM of the same FLOPs and the square peak; returns
    ``{"shape": ..., "grouped_tflops": ..., "dense_tflops": ..., "grouped_over_dense": ..., ...}``."""
    device = torch.device(device)
    shape = shape or ("gpu" if device.type == "cuda" else "nano")
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}: expected one of {', '.join(SHAPES)}")
    s = SHAPES[shape]
    d, f, e = s["d_model"], s["d_expert"], s["n_experts"]
    counts_E = routed_rows(s["tokens"], e, s["top_k"])
    p = int(counts_E.sum())
    offs_E = torch.cumsum(counts_E, 0).to(device=device, dtype=torch.int32)
    torch.manual_seed(0)
    x_PD = torch.randn(p, d, device=device, dtype=dtype)
    w13_EDF = torch.randn(e, d, 2 * f, device=device, dtype=dtype) * d**-0.5
    w2_EFD = torch.randn(e, f, d, device=device, dtype=dtype) * f**-0.5
    h_PF = torch.randn(p, f, device=device, dtype=dtype)
    w_dense = torch.randn(d, 3 * f, device=device, dtype=dtype) * d**-0.5

    def grouped() -> None:
        torch._grouped_mm(x_PD, w13_EDF, offs=offs_E)
        torch._grouped_mm(h_PF, w2_EFD, offs=offs_E)

    def dense() -> None:
        x_PD @ w_dense

    timed = alternating_medians({"grouped": grouped, "dense": dense}, repeats, device=device)
    flops = 6 * p * d * f
    peak = matmul_peak(dtype, n=8192 if device.type == "cuda" else 2048, device=device)
    grouped_fs, dense_fs = flops / timed["grouped"], flops / timed["dense"]
    return {
        "shape": {"name": shape, **s, "rows": p, "max_rows_per_expert": int(counts_E.max())},
        "dtype": str(dtype).removeprefix("torch."),
        "grouped_ms": timed["grouped"] * 1e3,
        "dense_ms": timed["dense"] * 1e3,
        "grouped_tflops": grouped_fs / 1e12,
        "dense_tflops": dense_fs / 1e12,
        "peak_tflops": peak / 1e12,
        "grouped_over_dense": grouped_fs / dense_fs,
        "grouped_over_peak": grouped_fs / peak,
        "target": "grouped_over_dense >= 0.6 (an H100, shape gpu)",
        "env": environment(device),
    }
