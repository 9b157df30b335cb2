"""Per-subnet efficiency, measured in the same run as the scores.

For each sub-model:
  * ``total_params`` / ``active_params`` / ``flops_per_token``: analytic (``ernie5.subnets.params``) at the
    context ``prompt_len + decode_tokens``;
  * ``active_params_measured``: the non-routed active parameters plus, per MoE layer, the routed
    (token, expert) pairs per token actually recorded while the suite ran, times the parameters of
    one expert; it checks the accounting against what routing really did;
  * ``prefill_ms``: median time of one forward over a ``prompt_len``-token prompt (batch 1);
  * ``decode_tokens_per_s``: median greedy decode speed with a KV cache after that prompt;
  * ``peak_memory_mb``: on CUDA, ``torch.cuda.max_memory_allocated`` during decoding; on CPU, where
    the allocator exposes no per-model peak, the resident bytes of the sub-model's weights plus its
    KV cache at the measured context (analytic);
  * ``extracted_bytes``: size of ``model.safetensors`` of the physically extracted sub-model.
Latency and throughput are measured on the extracted sub-model (its deploy form) when
``extract`` is on, else on the masked supernet.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from ernie5.generation.text import generate
from ernie5.model.elastic import Subnet
from ernie5.model.model import Ernie5Model
from ernie5.store.checkpoint import save_checkpoint
from ernie5.subnets.extract import extract_subnet
from ernie5.subnets.params import count_params
from evals.suite import EfficiencyConfig


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(
    model: Ernie5Model,
    subnet: Subnet,
    cfg: EfficiencyConfig,
    routing: dict[int, list[int]] | None = None,
    n_tokens_routed: int = 0,
) -> dict:
    """One row of the efficiency table for ``subnet`` of ``model``."""
    mcfg = model.cfg
    ctx = cfg.prompt_len + cfg.decode_tokens
    rep = count_params(mcfg, subnet, ctx)
    row = {
        "subnet": subnet.name,
        "depth": len(subnet.layers),
        "width": max(
            (subnet.n_experts_kept(i, mcfg.moe.n_experts) for i in subnet.layers if mcfg.is_moe_layer(i)),
            default=0,
        ),
        "top_k": subnet.top_k,
        "total_params": rep.total_params,
        "active_params": rep.active_params,
        "flops_per_token": rep.flops_per_token,
    }
    expert = 3 * mcfg.d_model * mcfg.moe.d_expert
    if routing and n_tokens_routed:
        moe_layers = [i for i in subnet.layers if mcfg.is_moe_layer(i)]
        analytic_routed = len(moe_layers) * subnet.top_k * expert
        measured_routed = sum(sum(routing.get(i, [])) for i in moe_layers) / n_tokens_routed * expert
        row["active_params_measured"] = rep.active_params - analytic_routed + measured_routed
    else:
        row["active_params_measured"] = None

    runner, run_sub = model, subnet
    with tempfile.TemporaryDirectory() as tmp:
        if cfg.extract:
            runner, run_sub = extract_subnet(model, subnet).eval(), None
            path = save_checkpoint(Path(tmp) / "sub", runner, meta={"subnet": subnet.name})
            row["extracted_bytes"] = (path / "model.safetensors").stat().st_size
        else:
            row["extracted_bytes"] = None
        prompt = torch.randint(
            16, mcfg.vocab_size, (cfg.prompt_len,), generator=torch.Generator().manual_seed(0)
        )
        prompt_ids = prompt.tolist()

        def prefill():
            generate(runner, [prompt_ids], 1, subnet=run_sub)

        def decode():
            generate(runner, [prompt_ids], cfg.decode_tokens, subnet=run_sub)

        if torch.cuda.is_available() and next(runner.parameters()).is_cuda:
            torch.cuda.reset_peak_memory_stats()
        t_prefill = _median_time(prefill, cfg.repeats)
        t_total = _median_time(decode, cfg.repeats)
        row["prefill_ms"] = t_prefill * 1e3
        row["decode_tokens_per_s"] = (cfg.decode_tokens - 1) / max(t_total - t_prefill, 1e-9)
        if torch.cuda.is_available() and next(runner.parameters()).is_cuda:
            row["peak_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
        else:
            weights = sum(p.numel() * p.element_size() for p in runner.parameters())
            if run_sub is not None:  # masked supernet: only the kept layers' weights are resident work
                weights = rep.total_params * next(runner.parameters()).element_size()
            kv = (
                2
                * len(subnet.layers)
                * mcfg.n_kv_heads
                * mcfg.dim_head
                * ctx
                * next(runner.parameters()).element_size()
            )
            row["peak_memory_mb"] = (weights + kv) / 2**20
    return row
