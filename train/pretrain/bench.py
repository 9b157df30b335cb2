"""``ernie5 bench train``: training throughput and MFU at the nano shape.

One optimizer step of the real training loop's work (forward with targets and the MTP loss,
backward, gradient clipping and AdamW through ``MixedPrecision.step``, aux-free bias update) on
``grad_accum`` micro-batches (default one) of ``batch_size x seq_len`` random ids, for the full model (no
elastic sampling, so every step does the same work), with fp32 master weights and a bf16
compute replica (``train.pretrain.precision``), as ``ernie5 train`` runs.
``mfu = 6 * active_params_no_embedding * tokens_per_s / peak`` with ``peak`` this machine's bf16
matmul FLOP/s measured in the same process before and after the timed steps, the higher of the two
(perf-anchors.md §2 and §6: the peer's convention, attention-score FLOPs and the MTP module
ignored). ``mfu_model_flops`` credits everything the step computes, Megatron-LM's way
(``ernie5.subnets.params``: ``train_flops_per_token``: the MTP module's projection, block and logits, and
the causal attention cores); the peer, which has no MTP module, is compared on ``mfu``.

``--device cuda``: the same step on the GPU (bf16 replica there, the ``grouped`` expert path),
with ``peak`` the GPU's measured bf16 matmul FLOP/s, and the allocator's peak memory.
``--activation-checkpoint``: each block recomputes its activations in the backward
(``train.parallel.activation_checkpoint``); ``saved_activation_mb`` is what the forward keeps for
the backward (every tensor autograd saves, counted once per storage), on any device.
``--fp8`` (GPU of capability >= 8.9, torchao): the blocks' dense projections in FP8
(``train.fp8``, :mod:`train.pretrain.parallel.fp8`); ``mfu`` stays against the bf16 peak, so FP8's gain shows
as a higher MFU. Emulated FP8 is not offered here: its timings would mean nothing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from ernie5.bench import preset_model
from ernie5.bench.timing import environment, matmul_peak, median_seconds
from ernie5.fast import apply_fast_paths
from ernie5.model.config import ModelConfig
from ernie5.model.model import Ernie5Model
from ernie5.model.moe import MoE, update_router_bias
from ernie5.runtime.allocator import tune_allocator
from ernie5.subnets.params import count_params
from train.pretrain.precision import MixedPrecision

WARMUP_STEPS = 40
"""Untimed steps before the timed ones, so that the median describes a long run. The first steps
fill oneDNN's kernel cache (one JIT kernel per GEMM shape) and grow the heap to its working set,
and the aux-free bias (speed 1e-3) flattens the expert loads that a fresh router leaves skewed
(slower steps: the busiest expert sets the padded depth); a long run spends almost all of its
steps in that settled state."""


def bench_peer_mixtral(
    repeats: int = 5, batch_size: int = 8, seq_len: int = 256, grad_accum: int = 1, warmup: int = WARMUP_STEPS
) -> dict:
    """Hugging Face Mixtral at the nano shape, trained the perf-anchors.md way, in this process.

    ``transformers`` is an optional dependency (it is in the ``test`` extra); the peer is built
    from its config (random init, nothing downloaded) with the library defaults (``sdpa``
    attention, ``grouped_mm`` experts) and timed under bf16 autocast, with the default AdamW and
    with ``fused=True``: the two rows perf-anchors.md says to compare against.
    """
    try:
        from transformers import AutoModelForCausalLM, MixtralConfig
    except ImportError:
        return {"skipped": "transformers is not installed (pip install transformers)"}
    cfg = MixtralConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=64,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()
    ids = torch.randint(16, cfg.vocab_size, (batch_size, seq_len))
    out: dict = {"model": "transformers Mixtral, nano shape, sdpa + grouped_mm experts, bf16 autocast"}
    for name, fused in (("default_adamw", False), ("fused_adamw", True)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

        def step(opt=opt):
            opt.zero_grad()
            for _ in range(grad_accum):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss / grad_accum
                loss.backward()
            opt.step()

        # The same warm-up as ours (see _time_step), so both describe a long run.
        seconds = median_seconds(step, repeats, warmup=warmup)
        out[name] = {"tokens_per_s": grad_accum * batch_size * seq_len / seconds}
    return out


def bench_train(
    repeats: int = 5,
    shape: str = "nano",
    batch_size: int = 8,
    seq_len: int = 256,
    dtype: str = "bf16",
    peer: bool = False,
    grad_accum: int = 1,
    warmup: int = WARMUP_STEPS,
    device: str = "cpu",
    activation_checkpoint: bool = False,
    fp8: bool = False,
) -> dict:
    """Median tokens/s of a full training step and the MFU it implies, after ``warmup`` steps, for the
    model of preset ``shape`` (``nano``: the CPU reference of perf-anchors.md; ``gpu_fill``: a shape
    that fills one H100, for its MFU) at ``batch_size x seq_len`` tokens per micro-batch.

    ``grad_accum`` micro-batches share one optimizer step (``train.grad_accum``): the optimizer
    phase, which does not depend on the batch, is then paid once per ``grad_accum`` micro-batches.

    With ``peer``, also times Hugging Face Mixtral (:func:`bench_peer_mixtral`) and our model in
    the peer's setting (``matched_to_peer``: no MTP module, no gradient clipping, no bias update),
    so the speedups compare like with like as well as our real step against theirs.
    """
    cfg = preset_model(shape)  # ConfigError: no such preset
    tune_allocator()
    peak_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    dev = torch.device(device)
    n = 8192 if dev.type == "cuda" else 2048
    peak_start = matmul_peak(peak_dtype, n=n, device=dev)
    phases: dict[str, list[float]] = {}
    memory: dict[str, float] = {}
    seconds = _time_step(
        cfg,
        dtype,
        batch_size,
        seq_len,
        repeats,
        True,
        phases,
        grad_accum,
        warmup,
        dev,
        activation_checkpoint,
        memory,
        fp8,
    )
    peak = max(peak_start, matmul_peak(peak_dtype, n=n, device=dev))
    tokens = grad_accum * batch_size * seq_len
    rep = count_params(cfg, None, seq_len)
    active = rep.active_params_no_embedding
    tps = tokens / seconds
    flops_per_step = 6 * active * tokens
    phase_ms = {k: statistics.median(v[-repeats:]) * 1e3 for k, v in phases.items()}
    result = {
        "shape": shape,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "dtype": dtype,
        "tokens_per_step": tokens,
        "grad_accum": grad_accum,
        "warmup_steps": warmup,
        "step_ms": seconds * 1e3,
        "tokens_per_s": tps,
        "mfu": flops_per_step / seconds / peak,
        "mfu_model_flops": rep.train_flops_per_token * tokens / seconds / peak,
        "peak_gflops": peak / 1e9,
        "peak_gflops_start": peak_start / 1e9,
        "active_params_no_embedding": active,
        "train_flops_per_token": rep.train_flops_per_token,
        "phase_ms": phase_ms,
        # The MFU the step would have if forward and backward took no time at all: the optimizer
        # phase (gradient accumulation into fp32, clip + AdamW, replica refresh) alone caps it.
        "mfu_ceiling_optimizer_only": flops_per_step / (phase_ms["optimizer"] / 1e3) / peak,
        # The step time 30% MFU would allow, to set against phase_ms.
        "step_ms_at_target": flops_per_step / (0.30 * peak) * 1e3,
        "activation_checkpoint": activation_checkpoint,
        "fp8": fp8,
        **memory,
        "env": environment(dev),
        "target": "mfu >= 0.30",
    }
    if peer and dev.type == "cpu":
        p = bench_peer_mixtral(repeats, batch_size, seq_len, grad_accum, warmup)
        result["peer"] = p
        bare = replace(cfg, mtp=replace(cfg.mtp, n_depth=0))
        matched = tokens / _time_step(
            bare, dtype, batch_size, seq_len, repeats, False, None, grad_accum, warmup
        )
        result["matched_to_peer"] = {"tokens_per_s": matched, "what": "no MTP, no clipping, no bias update"}
        for name in ("default_adamw", "fused_adamw"):
            if name in p:
                result[f"speedup_vs_peer_{name}"] = tps / p[name]["tokens_per_s"]
                result[f"matched_speedup_vs_peer_{name}"] = matched / p[name]["tokens_per_s"]
    return result


def _time_step(
    cfg: ModelConfig,
    dtype: str,
    batch_size: int,
    seq_len: int,
    repeats: int,
    full_recipe: bool,
    phases: dict[str, list[float]] | None = None,
    grad_accum: int = 1,
    warmup: int = WARMUP_STEPS,
    device: torch.device | str = "cpu",
    activation_checkpoint: bool = False,
    memory: dict[str, float] | None = None,
    fp8: bool = False,
) -> float:
    """Median seconds of one training step (``full_recipe``: MTP loss, clipping, bias update).

    ``phases``, if given, receives every step's seconds in ``forward``, ``backward`` (each summed
    over the step's ``grad_accum`` micro-batches) and ``optimizer`` (gradient accumulation into the
    fp32 master, ``MixedPrecision.step``, bias update, buffer sync). ``memory``, if given, receives
    ``saved_activation_mb`` (and ``peak_memory_mb`` on CUDA; ``fp8_linears`` with ``fp8``).
    Raises :class:`train.pretrain.parallel.fp8.FP8Error` where ``fp8`` cannot run.
    """
    laps = phases if phases is not None else {}
    dev = torch.device(device)
    torch.manual_seed(0)
    with dev:  # initialised where it trains: a GPU-sized shape never sits on the host
        model = Ernie5Model(cfg).train()
    mp = MixedPrecision(model, dtype)
    apply_fast_paths(mp.compute, grad_squares=mp.grad_squares)
    if fp8:
        from train.pretrain.parallel.fp8 import apply_fp8

        converted = apply_fp8(mp.compute, dev)
        if memory is not None:
            memory["fp8_linears"] = converted
    if activation_checkpoint:
        from torch.distributed._composable import checkpoint

        for block in mp.compute.layers:
            checkpoint(block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(16, cfg.vocab_size, (batch_size, seq_len + 1), device=dev)
    x, y = ids[:, :-1], ids[:, 1:]
    moes = [b.ffn for b in model.layers if isinstance(b.ffn, MoE)]
    avail = torch.ones(cfg.moe.n_experts, dtype=torch.bool, device=dev)
    if memory is not None:
        memory["saved_activation_mb"] = _saved_activation_bytes(mp.compute, x, y) / 2**20

    def step():
        fwd = bwd = opt_s = 0.0
        counts = [torch.zeros_like(avail, dtype=torch.long) for _ in moes]
        for _ in range(grad_accum):
            t0 = time.perf_counter()
            out = mp.compute(x, targets=y, return_logits=False)
            loss = out.losses.text
            if out.losses.mtp:
                loss = loss + 0.3 * torch.stack(out.losses.mtp).mean()
            t1 = time.perf_counter()
            (loss / grad_accum).backward()
            t2 = time.perf_counter()
            mp.accumulate_grads(only_micro_batch=grad_accum == 1)
            for c, r in zip(counts, out.routing.values()):
                c += r.counts_E
            fwd, bwd, opt_s = fwd + t1 - t0, bwd + t2 - t1, opt_s + time.perf_counter() - t2
        t3 = time.perf_counter()
        mp.step(opt, 1.0 if full_recipe else 0.0)
        opt.zero_grad(set_to_none=True)
        if full_recipe:
            for moe, c in zip(moes, counts):
                update_router_bias(moe, c, 1e-3, avail)
        mp.sync()
        opt_s += time.perf_counter() - t3
        for name, dt in (("forward", fwd), ("backward", bwd), ("optimizer", opt_s)):
            laps.setdefault(name, []).append(dt)

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    seconds = median_seconds(step, repeats, warmup=warmup, device=dev)
    if memory is not None and dev.type == "cuda":
        memory["peak_memory_mb"] = torch.cuda.max_memory_allocated(dev) / 2**20
    return seconds


def _saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for the backward in one forward with targets (each
    storage once; parameters, which are kept anyway, excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, targets=y, return_logits=False)
    del out
    return sum(seen.values())
