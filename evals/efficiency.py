"""Per-subnet efficiency, measured in the same run as the scores.

For each sub-model:
  * ``total_params`` / ``active_params`` / ``flops_per_token``: analytic (``ernie5.subnets.params``) at the
    context ``prompt_len + decode_tokens``;
  * ``active_params_measured``: the non-routed active parameters plus, per MoE layer, the routed
    (token, expert) pairs per token actually recorded while the suite ran, times the parameters of
    one expert; it checks the accounting against what routing really did;
  * ``prefill_ms``: median time of the prefill forward alone over a ``prompt_len``-token prompt
    (batch 1), with ``prefill_ms_low`` / ``prefill_ms_high`` its interquartile range;
  * ``decode_tokens_per_s``: one over the median time of one greedy decoding step with the KV cache
    after that prompt (each step timed on its own, from the end of one forward to the end of the
    next), with ``decode_tokens_per_s_low`` / ``_high`` from the interquartile range of the steps;
  * ``matmul_peak_flops``: this machine's measured dense matmul FLOP/s (the physical bound below);
  * ``threads``: the intra-op threads the CPU timings ran with (:data:`CPU_THREADS`; empty on CUDA);
  * ``status`` / ``reason``: ``ok``, or ``failed`` with why (see below);
  * ``peak_memory_mb``: on CUDA, ``torch.cuda.max_memory_allocated`` during decoding; on CPU, where
    the allocator exposes no per-model peak, the resident bytes of the sub-model's weights plus its
    KV cache at the measured context (analytic);
  * ``extracted_bytes``: size of ``model.safetensors`` of the physically extracted sub-model.
Latency and throughput are measured on the extracted sub-model (its deploy form) when
``extract`` is on, else on the masked supernet.

Both timings are measured directly, never as the difference of two noisy totals (which, under load,
can come out near zero and turn into an absurd throughput). Every ``generate`` call is one repeat
(at least :data:`MIN_REPEATS`, after one untimed warm-up) and gives one prefill time and
``decode_tokens - 1`` decoding-step times; the figures are medians over all of them. A
measurement that fails the checks below is taken again, up to :data:`MAX_ATTEMPTS` times (on a
shared machine contention comes in bursts); the first one that passes is kept.

A figure is a **failed measurement**, recorded as NaN with ``status = "failed"`` and the reason,
when it is not finite or not positive, when it implies more arithmetic per second than
:data:`PEAK_SLACK` times the measured matmul peak allows (every token costs at least the
sub-model's matmul FLOPs, ``matmul_flops_per_token``), or when its interquartile range spans more
than a factor :data:`MAX_SPREAD` (the middle half of the repeats disagree so much that the median
means nothing). Reports show such a row as "measurement failed" and never use it for a speedup or
a Pareto frontier.
"""

from __future__ import annotations

import functools
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ernie5.bench.timing import matmul_peak, synchronizer
from ernie5.generation.text import generate
from ernie5.model.elastic import Subnet
from ernie5.model.model import Ernie5Model
from ernie5.runtime.threads import num_threads
from ernie5.store.checkpoint import save_checkpoint
from ernie5.subnets.extract import extract_subnet
from ernie5.subnets.params import count_params
from evals.suite import EfficiencyConfig

MEASURE_VERSION = 2
"""Bumped when the measurement's method changes (a cached row of another version is stale)."""
MIN_REPEATS = 5
"""Timed ``generate`` calls at least, whatever the suite's ``repeats`` (each gives one prefill)."""
MAX_SPREAD = 4.0
"""Largest accepted ratio of the upper to the lower quartile of a timing."""
PEAK_SLACK = 4.0
"""How far above the measured matmul peak an implied FLOP rate may go before it is impossible
(the peak is itself a noisy measurement on a shared machine)."""
PEAK_MATMUL_N = 1024
"""Side of the square matmul timed for the machine peak."""
CPU_THREADS = 1
"""Intra-op threads while timing on CPU: with more, every operator waits for its slowest thread, and
on a machine shared with other work (a CI runner, a laptop) a descheduled thread turns a 2 ms step
into a 20 ms one at random; one thread keeps the figures reproducible and comparable across
sub-models (the row records it as ``threads``)."""
MAX_ATTEMPTS = 3
"""Measurements of a sub-model before its figures are given up as failed (load comes in bursts)."""


@functools.cache
def machine_matmul_peak(device: str, dtype: torch.dtype, threads: int) -> float:
    """The best dense matmul FLOP/s of ``device`` in ``dtype`` (with ``threads`` intra-op threads on
    CPU), measured once per process; a shared machine can only lower it, so the higher of two
    measurements is kept."""
    with num_threads(threads if torch.device(device).type == "cpu" else None):
        return max(matmul_peak(dtype, n=PEAK_MATMUL_N, repeats=5, device=device) for _ in range(2))


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """Lower quartile, median and upper quartile (all three equal for a single value)."""
    if len(xs) < 2:
        x = xs[0] if xs else math.nan
        return x, x, x
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def check_timing(
    name: str, seconds: list[float], tokens: int, flops_per_token: float, peak_flops: float
) -> tuple[tuple[float, float, float] | None, str]:
    """The quartiles of ``seconds`` (each the time of ``tokens`` tokens), or ``(None, reason)``
    when they are no measurement (see the module docstring)."""
    q1, med, q3 = _quartiles(seconds)
    if not seconds or not all(math.isfinite(s) for s in seconds) or not med > 0 or not q1 > 0:
        return None, f"{name}: non-positive or non-finite elapsed time (median {med:.3g} s)"
    implied = tokens * flops_per_token / q1
    if implied > PEAK_SLACK * peak_flops:
        return None, (
            f"{name}: {tokens} tokens in {q1:.3g} s implies {implied:.3g} FLOP/s, above "
            f"{PEAK_SLACK:g}x the measured matmul peak {peak_flops:.3g} FLOP/s"
        )
    if q3 / q1 > MAX_SPREAD:
        return None, f"{name}: interquartile range {q1:.3g}-{q3:.3g} s spans more than {MAX_SPREAD:g}x"
    return (q1, med, q3), ""


def time_generation(
    runner: Ernie5Model,
    prompt_ids: list[int],
    decode_tokens: int,
    subnet: Subnet | None,
    repeats: int,
    clock: Callable[[], float],
) -> tuple[list[float], list[float]]:
    """Prefill seconds (one per repeat) and decoding-step seconds (``decode_tokens - 1`` per repeat)
    of greedy ``generate`` calls, after one untimed warm-up call."""

    def run(mark: Callable[[], None]) -> None:
        generate(runner, [prompt_ids], decode_tokens, subnet=subnet, on_forward=lambda *_: mark())

    return time_forwards(run, next(runner.parameters()).device, repeats, clock)


def time_forwards(
    run: Callable[[Callable[[], None]], None], device: torch.device, repeats: int, clock: Callable[[], float]
) -> tuple[list[float], list[float]]:
    """Prefill and decoding-step seconds of ``repeats`` calls of ``run(mark)`` (after one untimed
    warm-up call), where ``run`` decodes greedily and calls ``mark()`` after every forward: the first
    mark ends the prefill, each later one a decoding step (the device synchronised at every mark)."""
    sync = synchronizer(device)
    prefill: list[float] = []
    steps: list[float] = []
    for rep in range(repeats + 1):
        marks: list[float] = []

        def mark(marks: list[float] = marks) -> None:
            sync()
            marks.append(clock())

        sync()
        start = clock()
        run(mark)
        if rep == 0 or not marks:
            continue
        prefill.append(marks[0] - start)
        steps.extend(b - a for a, b in zip(marks, marks[1:]))
    return prefill, steps


def timing_columns(
    time_once: Callable[[], tuple[list[float], list[float]]],
    prompt_len: int,
    flops_per_token: float,
    peak_flops: float,
) -> dict:
    """The timing columns of a row from ``time_once()`` (raw prefill and step seconds), measured
    again up to :data:`MAX_ATTEMPTS` times until they pass the checks (the module docstring)."""
    for _ in range(MAX_ATTEMPTS):
        timing = _timing_columns(*time_once(), prompt_len, flops_per_token, peak_flops)
        if timing["status"] == "ok":
            break
    return timing


def measure(
    model: Ernie5Model,
    subnet: Subnet,
    cfg: EfficiencyConfig,
    routing: dict[int, list[int]] | None = None,
    n_tokens_routed: int = 0,
    *,
    clock: Callable[[], float] | None = None,
    peak_flops: float | None = None,
) -> dict:
    """One row of the efficiency table for ``subnet`` of ``model``.

    Args:
        model: the loaded supernet.
        subnet: the sub-model to measure.
        cfg: the suite's efficiency settings.
        routing: per MoE layer, the expert loads recorded while the suite ran.
        n_tokens_routed: the tokens those loads cover.
        clock: the wall clock read around each forward (default ``time.perf_counter``).
        peak_flops: the machine's matmul FLOP/s (default: measured once per process).
    """
    clock = clock or time.perf_counter
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
        first = next(runner.parameters())
        prompt = torch.randint(
            16, mcfg.vocab_size, (cfg.prompt_len,), generator=torch.Generator().manual_seed(0)
        )
        on_cuda = torch.cuda.is_available() and first.is_cuda
        if on_cuda:  # the model's GPU, which need not be the current one
            torch.cuda.reset_peak_memory_stats(first.device)
        threads = CPU_THREADS if first.device.type == "cpu" else None
        if peak_flops is None:
            peak_flops = machine_matmul_peak(str(first.device), first.dtype, threads or 0)
        repeats = max(cfg.repeats, MIN_REPEATS)
        with num_threads(threads):
            timing = timing_columns(
                lambda: time_generation(runner, prompt.tolist(), cfg.decode_tokens, run_sub, repeats, clock),
                cfg.prompt_len,
                rep.matmul_flops_per_token,
                peak_flops,
            )
        row.update(timing, threads=threads)
        if on_cuda:
            row["peak_memory_mb"] = torch.cuda.max_memory_allocated(first.device) / 2**20
        else:
            weights = sum(p.numel() * p.element_size() for p in runner.parameters())
            if run_sub is not None:  # masked supernet: only the kept layers' weights are resident work
                weights = rep.total_params * first.element_size()
            kv = 2 * len(subnet.layers) * mcfg.n_kv_heads * mcfg.dim_head * ctx * first.element_size()
            row["peak_memory_mb"] = (weights + kv) / 2**20
    return row


def _timing_columns(
    prefill_s: list[float], step_s: list[float], prompt_len: int, flops_per_token: float, peak_flops: float
) -> dict:
    """The timing columns of a row from the raw prefill and decoding-step seconds."""
    nan = math.nan
    out = {
        "prefill_ms": nan,
        "prefill_ms_low": nan,
        "prefill_ms_high": nan,
        "decode_tokens_per_s": nan,
        "decode_tokens_per_s_low": nan,
        "decode_tokens_per_s_high": nan,
        "matmul_peak_flops": peak_flops,
    }
    reasons = []
    pre, why = check_timing("prefill", prefill_s, prompt_len, flops_per_token, peak_flops)
    if pre is None:
        reasons.append(why)
    else:
        out.update(prefill_ms_low=pre[0] * 1e3, prefill_ms=pre[1] * 1e3, prefill_ms_high=pre[2] * 1e3)
    dec, why = check_timing("decode", step_s, 1, flops_per_token, peak_flops)
    if dec is None:
        reasons.append(why)
    else:
        out.update(
            decode_tokens_per_s_low=1 / dec[2],
            decode_tokens_per_s=1 / dec[1],
            decode_tokens_per_s_high=1 / dec[0],
        )
    out["status"] = "failed" if reasons else "ok"
    out["reason"] = "; ".join(reasons)
    return out
