"""``ernie5 bench decode``: KV-cache decoding tokens/s of the nano model and its sub-models.

A randomly initialised nano model (perf-anchors.md shape; or the model of the preset ``shape``)
decodes ``new_tokens`` tokens after a 32-token prompt, batch 1, in fp32 and bf16, sampling at
temperature 1 with a fixed seed (``decoding="sampled"``, the default) or greedily (``"greedy"``).
Sampling is the default because greedy decoding from random weights falls into repeating a handful
of tokens (15 distinct of 64 at the default seed), so its routing keeps revisiting 9-26 experts per
layer whose weights stay in cache, which no trained model's decoding does; sampled, the same model
emits ~63 distinct tokens and reaches 16-52 experts per layer, so expert weights come from memory as
in real decoding. Each row reports ``distinct_tokens`` (of its last round).

``tokens_per_s`` counts decode steps only (the prompt's prefill is timed separately as
``prefill_ms``). Sub-models: the full model, top-k 25 % (k=1 of 2, i.e. the smallest top-k), depth
75 %, width 50 %, and the combined ``d0.75-w0.5-k1`` physically extracted into a standalone model.
``speedup`` is relative to the full model in the same dtype: the median over ``repeats`` rounds,
each timing every sub-model once in turn, of the round's tokens/s ratio (``tokens_per_s`` and
``prefill_ms`` are medians too); ``ideal_speedup`` is the ratio of forward FLOPs per token
(``ernie5.subnets.params``, at the mean context of the run); ``fraction_of_ideal = speedup /
ideal_speedup`` and the stricter ``gain_fraction_of_ideal = (speedup - 1) / (ideal_speedup - 1)``.
``device`` (``--device cuda``) decodes on a GPU instead, each timed call synchronised with it.

Memory bound: a batch-1 decode step reads every active weight and the KV cache once, so it can go no
faster than ``bandwidth_bound_tokens_per_s = memory_bandwidth / bytes_per_token``, with
``bytes_per_token = (active_params + KV cache elements at the run's mean context) * element size``
and the bandwidth measured in the same process (:func:`ernie5.bench.timing.memory_bandwidth`: HBM
on a GPU, DRAM on the CPU); ``fraction_of_bandwidth_bound`` is the measured tokens/s over it. On a
GPU, ``shape="gpu_fill"`` (a preset) gives a model whose weights, not kernel launches, set the pace.

``prefill`` reports, per dtype, the full model's tokens/s over one ``1 x prefill_len`` forward
that fills a KV cache under ``inference_mode`` (default 512), as perf-anchors.md times its peer's
prefill (median of ``repeats`` after a warm-up), so the figure sits next to the peer's 4-6k tok/s.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from ernie5.bench import preset_model
from ernie5.bench.timing import environment, median_seconds, memory_bandwidth, synchronizer
from ernie5.fast import apply_fast_paths
from ernie5.generation.text import generate
from ernie5.model.model import Ernie5Model
from ernie5.subnets.extract import extract_subnet
from ernie5.subnets.params import count_params
from ernie5.subnets.spec import resolve

SUBNETS = ("full", "k0.25", "d0.75", "w0.5", "d0.75-w0.5-k1")
DECODINGS = {"sampled": {"temperature": 1.0, "seed": 0}, "greedy": {"temperature": 0.0}}
"""How tokens are picked (``generate`` arguments), by ``decoding`` name."""


def bench_decode(
    repeats: int = 5,
    new_tokens: int = 64,
    prompt_len: int = 32,
    dtypes=("fp32", "bf16"),
    device: torch.device | str = "cpu",
    decoding: str = "sampled",
    prefill_len: int = 512,
    shape: str = "nano",
) -> dict:
    """Run the benchmark on ``device``; returns ``{"subnets": [...], ...}`` (one entry per subnet
    and dtype)."""
    if decoding not in DECODINGS:
        raise ValueError(f"decoding={decoding!r}: expected one of {', '.join(DECODINGS)}")
    pick = DECODINGS[decoding]
    device = torch.device(device)
    sync = synchronizer(device)
    cfg = preset_model(shape)
    torch.manual_seed(0)
    with device:  # initialised where it runs: a GPU-sized shape never sits on the host
        base = apply_fast_paths(Ernie5Model(cfg).eval())
    bandwidth = memory_bandwidth(device)
    prompt = torch.randint(16, cfg.vocab_size, (prompt_len,)).tolist()
    ctx = prompt_len + new_tokens
    subs = {spec: resolve(spec, cfg) for spec in SUBNETS}
    reports = {spec: count_params(cfg, sub, ctx) for spec, sub in subs.items()}
    rows = []
    prefill_tps = {}
    for dt_name in dtypes:
        dtype = torch.bfloat16 if dt_name == "bf16" else torch.float32
        # A copy: ``Module.to`` converts in place, and a later fp32 row must not run bf16 weights.
        model = copy.deepcopy(base).to(dtype) if dtype != torch.float32 else base
        prefill_tps[dt_name] = _prefill_tokens_per_s(model, prefill_len, repeats)
        runs = {}  # spec -> (label, prefill fn, decode fn)
        for spec, sub in subs.items():
            if spec == "d0.75-w0.5-k1":
                runner, run_sub, label = extract_subnet(model, sub).eval(), None, f"{spec} (extracted)"
            else:
                runner, run_sub, label = model, sub, spec
            runs[spec] = (
                label,
                lambda r=runner, s=run_sub: generate(r, [prompt], 1, subnet=s, **pick),
                lambda r=runner, s=run_sub: generate(r, [prompt], new_tokens, subnet=s, **pick),
            )
        # Rounds alternate over the sub-models, so each speedup compares timings taken seconds
        # apart (paired per round); a burst of contention on a shared VM then hits both sides.
        prefill = {spec: [] for spec in SUBNETS}
        total = {spec: [] for spec in SUBNETS}
        distinct = {}
        for rnd in range(repeats + 1):  # round 0 warms up
            for spec, (_, prefill_fn, decode_fn) in runs.items():
                sync()
                t0 = time.perf_counter()
                prefill_fn()
                sync()
                t1 = time.perf_counter()
                tokens = decode_fn()[0]
                sync()
                t2 = time.perf_counter()
                distinct[spec] = len(set(tokens))
                if rnd:
                    prefill[spec].append(t1 - t0)
                    total[spec].append(t2 - t1)
        pre = {spec: statistics.median(v) for spec, v in prefill.items()}
        tps = {spec: [(new_tokens - 1) / max(t - pre[spec], 1e-9) for t in total[spec]] for spec in SUBNETS}
        for spec, (label, _, _) in runs.items():
            ideal = reports["full"].flops_per_token / reports[spec].flops_per_token
            speedup = statistics.median(a / b for a, b in zip(tps[spec], tps["full"]))
            n_kept = len(subs[spec].layers)
            kv = 2 * n_kept * cfg.n_kv_heads * cfg.dim_head * (prompt_len + new_tokens / 2)
            bytes_per_token = (reports[spec].active_params + kv) * (2 if dtype == torch.bfloat16 else 4)
            bound = bandwidth / bytes_per_token
            rows.append(
                {
                    "spec": label,
                    "dtype": dt_name,
                    "tokens_per_s": statistics.median(tps[spec]),
                    "prefill_ms": pre[spec] * 1e3,
                    "speedup": speedup,
                    "ideal_speedup": ideal,
                    "fraction_of_ideal": speedup / ideal,
                    "gain_fraction_of_ideal": (speedup - 1) / (ideal - 1) if ideal > 1 else None,
                    "active_params": reports[spec].active_params,
                    "bytes_per_token": bytes_per_token,
                    "bandwidth_bound_tokens_per_s": bound,
                    "fraction_of_bandwidth_bound": statistics.median(tps[spec]) / bound,
                    "distinct_tokens": distinct[spec],
                }
            )
    return {
        "shape": shape,
        "memory_bandwidth_gb_s": bandwidth / 1e9,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "decoding": {"mode": decoding, **pick},
        "subnets": rows,
        "prefill": {"tokens": prefill_len, "tokens_per_s": prefill_tps},
        "env": environment(device),
        "target": "k0.25: fraction_of_ideal = speedup / ideal_speedup >= 0.8",
    }


def _prefill_tokens_per_s(model: Ernie5Model, length: int, repeats: int) -> float:
    """Median tokens/s of a ``1 x length`` forward that fills a fresh KV cache (one warm-up call)."""
    device = model.tok_emb.weight.device
    ids = torch.randint(16, model.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    with torch.inference_mode():
        seconds = median_seconds(lambda: model(ids, cache=model.new_cache(1, length)), repeats, 1, device)
    return length / seconds
