"""``ernie5 bench moe``: one MoE layer's forward+backward against a dense chain and the naive loop.

Shape: the nano MoE layer (d_model 256, 64 experts x 256, top-2) on ``tokens`` tokens (default
2048 = 8 x 256, as perf-anchors.md). Per dtype:
  * ``moe_ms``: the layer (router + experts) forward + backward, with the expert path ``dispatch``
    that ``auto`` trains with on this device and dtype (:func:`ernie5.fast.moe.batch_dispatch`:
    ``sorted`` on CPU and for fp32 on CUDA, ``grouped`` for bf16 on CUDA); the other of the two
    is timed alongside as ``<other>_ms``, with ``<other>_speedup = <other>_ms / moe_ms`` (above
    1: the chosen path is the faster one);
  * ``dense_ms``: a dense SwiGLU chain doing the same active expert FLOPs (``tokens * top_k`` rows
    through D -> 2F -> F -> D) forward + backward;
  * ``loop_ms``: the same layer with the naive per-expert loop;
  * ``dense_equiv_ratio = dense_ms / moe_ms`` (1.0 = as fast as dense), ``loop_speedup =
    loop_ms / moe_ms``.
``bf16`` holds bf16 weights and inputs; ``bf16_autocast`` fp32 weights under CPU autocast; ``fp32``
plain fp32 (training runs a bf16 replica, i.e. the ``bf16`` row). Gradients are reset to None
before every repeat.

The headline figures route with the router at random init (max/mean expert load about 1.6 here:
the padded levels of the ``bmm`` path carry idle rows, which the bf16 expert GEMM kernels skip, but
the activations and gathers still see the padded shapes). In training the aux-free bias flattens
the load within tens of steps, so each row also reports the same layer after ``settle_steps`` bias
updates on the bench input (the training rule at the report's initial speed 1e-4, on an fp32 copy
of the bias as the trainer's master keeps it):
``moe_ms_settled``, ``dense_equiv_ratio_settled`` and ``load_max_over_mean_settled``. The layer,
its settled copy and the dense chain are timed in alternating rounds
(:func:`ernie5.bench.timing.alternating_medians`), so their ratios compare runs taken moments apart.

Two ceilings, measured in the same process, say how far a layer built on these batched GEMMs
(the padding-skipping kernels of ``ernie5/kernels/cpu_expert_gemm.cpp`` in bf16 where they
build, oneDNN's ``bmm`` otherwise) could go:
  * ``gemm_only_ms``: just the six batched expert GEMMs (forward, data and weight gradients) of a
    perfectly balanced layer (``tokens * top_k / n_experts`` rows per expert, no padding, no
    routing, gathers, scatters or activations); ``dense_equiv_ratio_gemm_only`` is the ratio a
    layer made of nothing else would reach;
  * ``gemm_only_bmm_ms``: the same six products through oneDNN's ``torch.bmm`` (the reference the
    expert kernels are measured against; equal to ``gemm_only_ms`` where the layer runs bmm);
  * ``dense_gemm_ms``: the dense chain's three GEMMs and their gradients alone, so
    ``dense_ms - dense_gemm_ms`` is what the dense chain spends on the SwiGLU activation and
    autograd; ``dense_equiv_ratio_ceiling = dense_ms / (gemm_only_ms + dense_ms - dense_gemm_ms)``
    is the ratio of an MoE layer whose routing and dispatch were free and whose activations cost
    exactly what the dense chain's do.

``device`` (``ernie5 bench moe --device cuda``) runs all of it on a GPU instead, every timed run
synchronised with it (the eager ``sorted`` path and ``torch.bmm``: the CPU kernels do not apply);
the default shape is then far too small to fill one, so pass ``--tokens`` in the tens of thousands
to see the GEMMs rather than launch and host-sync overheads.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ernie5.bench.timing import alternating_medians, environment, matmul_peak, median_seconds
from ernie5.fast import apply_fast_paths
from ernie5.fast.moe import FastMoE, batch_dispatch
from ernie5.kernels import kernels, ops
from ernie5.model.config import MoEConfig
from ernie5.model.moe import MoE, update_router_bias


def _moe_step(layer: FastMoE, x: torch.Tensor, path: str, autocast: bool):
    def step():
        layer.path = path
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
            y, _ = layer(x)
        y.float().sum().backward()

    return step


def _dense_step(n_rows: int, d: int, f: int, dtype: torch.dtype, autocast: bool, device: torch.device):
    x = torch.randn(n_rows, d, dtype=dtype, device=device, requires_grad=True)
    w13 = (torch.randn(2 * f, d, dtype=dtype, device=device) * 0.02).requires_grad_()
    w2 = (torch.randn(d, f, dtype=dtype, device=device) * 0.02).requires_grad_()

    def step():
        x.grad = w13.grad = w2.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            g, u = F.linear(x, w13).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, w2)
        y.float().sum().backward()

    return step


def _gemm_steps(n_rows: int, d: int, f: int, n_experts: int, dtype: torch.dtype, device: torch.device):
    """The six GEMMs of a balanced expert layer (batched, the layout and the kernels
    `_GroupedSwiGLU` uses; ``experts_bmm``: the same through ``torch.bmm``) and of the dense chain,
    without anything else."""
    c = n_rows // n_experts

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    w13, w2 = randn(n_experts, 2 * f, d), randn(n_experts, d, f)
    x, dy = randn(n_experts, c, d), randn(n_experts, c, d)
    act, d_h = randn(n_experts, f, c), randn(n_experts, 2 * f, c)

    def experts_bmm():
        torch.bmm(w13, x.transpose(1, 2))
        torch.bmm(w2, act)
        torch.bmm(dy.transpose(1, 2), act.transpose(1, 2))
        torch.bmm(w2.transpose(1, 2), dy.transpose(1, 2))
        torch.bmm(d_h, x)
        torch.bmm(d_h.transpose(1, 2), w13)

    experts = experts_bmm
    if ops.expert_gemm_fusable(x[0], w13, w2):  # what `_GroupedSwiGLU` runs in bf16 here
        k, n_E = kernels(), torch.full((n_experts,), c, dtype=torch.long)

        def experts():
            k.expert_up(w13, x, n_E)
            k.expert_down(w2, act, n_E)
            k.expert_down_dw(dy, act, n_E)
            k.expert_down_dx(w2, dy, n_E)
            k.expert_up_dw(d_h, x, n_E)
            k.expert_up_dx(d_h, w13, n_E)

    xd, dyd = randn(n_rows, d), randn(n_rows, d)
    w13d, w2d = randn(2 * f, d), randn(d, f)
    actd, dhd = randn(n_rows, f), randn(n_rows, 2 * f)

    def dense():
        F.linear(xd, w13d)
        F.linear(actd, w2d)
        dyd.t() @ actd
        dyd @ w2d
        dhd.t() @ xd
        dhd @ w13d

    return {"experts": experts, "experts_bmm": experts_bmm, "dense": dense}


def _settle_router(layer: MoE, x: torch.Tensor, steps: int, speed: float = 1e-4) -> None:
    """Aux-free bias updates from the layer's own routing of ``x``, as training applies them."""
    master = SimpleNamespace(router_bias=layer.router_bias.float().clone())
    avail = torch.ones_like(master.router_bias, dtype=torch.bool)
    for _ in range(steps):
        with torch.no_grad():
            _, r = layer(x)
        update_router_bias(master, r.counts_E, speed, avail)
        layer.router_bias.copy_(master.router_bias)


def _load_ratio(layer: MoE, x: torch.Tensor) -> float:
    with torch.no_grad():
        _, r = layer(x)
    counts = r.counts_E.float()
    return float(counts.max() / counts.mean())


def bench_moe(
    tokens: int = 2048,
    repeats: int = 5,
    d_model: int = 256,
    loop_repeats: int = 2,
    settle_steps: int = 300,
    device: torch.device | str = "cpu",
) -> dict:
    """Run the benchmark on ``device`` (``cpu`` or a CUDA device; every timed run is synchronised
    with it); returns ``{"bf16": {...}, "bf16_autocast": {...}, "fp32": {...}, ...}``."""
    device = torch.device(device)
    cfg = MoEConfig(n_experts=64, d_expert=256, top_k=2)
    torch.manual_seed(0)
    base = MoE(d_model, cfg)
    for p in base.parameters():
        torch.nn.init.normal_(p, std=0.02)
    base.to(device)
    x0 = torch.randn(tokens // 256 or 1, min(tokens, 256), d_model, device=device)
    out: dict = {
        "shape": {
            "tokens": x0.numel() // d_model,
            "d_model": d_model,
            "n_experts": cfg.n_experts,
            "d_expert": cfg.d_expert,
            "top_k": cfg.top_k,
        },
        "env": environment(device),
    }
    rows = x0.numel() // d_model * cfg.top_k
    flops = 6 * rows * 3 * d_model * cfg.d_expert
    ceilings: dict[torch.dtype, dict[str, float]] = {}  # GEMM dtype -> seconds of each _gemm_steps step
    for name, dtype, autocast in (
        ("bf16", torch.bfloat16, False),
        ("bf16_autocast", torch.float32, True),
        ("fp32", torch.float32, False),
    ):
        layer = apply_fast_paths(MoE(d_model, cfg).to(device=device, dtype=dtype))
        layer.load_state_dict(base.state_dict())
        x = x0.to(dtype).requires_grad_()
        load = _load_ratio(layer, x.detach())
        settled = copy.deepcopy(layer)
        _settle_router(settled, x.detach(), settle_steps)
        path = batch_dispatch(device, torch.bfloat16 if autocast else dtype)  # what `auto` trains with
        other = "grouped" if path == "sorted" else "sorted"
        timed = alternating_medians(
            {
                "moe": _moe_step(layer, x, path, autocast),
                "settled": _moe_step(settled, x, path, autocast),
                other: _moe_step(layer, x, other, autocast),
                "dense": _dense_step(rows, d_model, cfg.d_expert, dtype, autocast, device),
            },
            repeats,
            device=device,
        )
        moe_s, settled_s, dense_s = timed["moe"], timed["settled"], timed["dense"]
        loop_s = median_seconds(_moe_step(layer, x, "loop", autocast), loop_repeats, warmup=1, device=device)
        gemm_dtype = torch.bfloat16 if autocast else dtype  # autocast runs the experts in bf16
        if gemm_dtype not in ceilings:
            steps = _gemm_steps(rows, d_model, cfg.d_expert, cfg.n_experts, gemm_dtype, device)
            ceilings[gemm_dtype] = alternating_medians(steps, repeats, device=device)
        gemm = ceilings[gemm_dtype]
        gemm_s, dense_gemm_s = gemm["experts"], gemm["dense"]
        out[name] = {
            "dispatch": path,
            "moe_ms": moe_s * 1e3,
            f"{other}_ms": timed[other] * 1e3,
            f"{other}_speedup": timed[other] / moe_s,
            "dense_ms": dense_s * 1e3,
            "loop_ms": loop_s * 1e3,
            "dense_equiv_ratio": dense_s / moe_s,
            "loop_speedup": loop_s / moe_s,
            "expert_gflops_per_s": flops / moe_s / 1e9,
            "dense_gflops_per_s": flops / dense_s / 1e9,
            "load_max_over_mean": load,
            "moe_ms_settled": settled_s * 1e3,
            "dense_equiv_ratio_settled": dense_s / settled_s,
            "load_max_over_mean_settled": _load_ratio(settled, x.detach()),
            "gemm_only_ms": gemm_s * 1e3,
            "gemm_only_bmm_ms": gemm["experts_bmm"] * 1e3,
            "dense_gemm_ms": dense_gemm_s * 1e3,
            "dense_equiv_ratio_gemm_only": dense_s / gemm_s,
            "dense_equiv_ratio_ceiling": dense_s / (gemm_s + max(dense_s - dense_gemm_s, 0.0)),
        }
    out["matmul_peak_gflops"] = {
        "bf16": matmul_peak(torch.bfloat16, device=device) / 1e9,
        "fp32": matmul_peak(torch.float32, device=device) / 1e9,
    }
    out["targets"] = {"bf16.dense_equiv_ratio": ">= 0.8", "bf16.loop_speedup": ">= 1.5"}
    return out
