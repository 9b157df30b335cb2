"""Benchmarks: the JSON contract, checked against what the figures must physically satisfy.

A benchmark's figures are checked by running it, never by tests; a test runs it on a tiny shape and
checks what any honest run must report: every field, in its unit (times positive, finite, no
longer than the wall clock the call took and no shorter than the machine's measured matmul peak
allows), paths known to be slower measured slower by a wide margin, and the parameter and FLOP
accounting equal to :mod:`ernie5.subnets.params` on the benchmarked model.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

MOE_ROW = {
    "dispatch",
    "moe_ms",
    "grouped_ms",
    "grouped_speedup",
    "dense_ms",
    "loop_ms",
    "dense_equiv_ratio",
    "loop_speedup",
    "expert_gflops_per_s",
    "dense_gflops_per_s",
    "load_max_over_mean",
    "moe_ms_settled",
    "dense_equiv_ratio_settled",
    "load_max_over_mean_settled",
    "gemm_only_ms",
    "gemm_only_bmm_ms",
    "dense_gemm_ms",
    "dense_equiv_ratio_gemm_only",
    "dense_equiv_ratio_ceiling",
}


def _positive(x) -> bool:
    return isinstance(x, float | int) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_bench_moe_reports_both_ratios_per_dtype():
    from ernie5.bench.moe import bench_moe
    from ernie5.fast.moe import batch_dispatch

    t0 = time.perf_counter()
    out = bench_moe(tokens=256, repeats=1, loop_repeats=1, settle_steps=100)
    wall_s = time.perf_counter() - t0
    json.dumps(out, allow_nan=False)  # the CLI prints it as JSON
    shape = out["shape"]
    assert shape == {"tokens": 256, "d_model": 256, "n_experts": 64, "d_expert": 256, "top_k": 2}
    rows = shape["tokens"] * shape["top_k"]
    # Every path does the active experts' six GEMMs (forward, data and weight gradients).
    flops = 6 * rows * 3 * shape["d_model"] * shape["d_expert"]
    mean_load = rows / shape["n_experts"]  # routed pairs per expert on average (8)
    peak = out["matmul_peak_gflops"]
    assert set(peak) == {"bf16", "fp32"} and all(_positive(v) for v in peak.values())
    timed_s = 0.0
    for dtype in ("bf16", "bf16_autocast", "fp32"):
        d = out[dtype]
        assert set(d) == MOE_ROW, dtype
        assert all(_positive(v) for k, v in d.items() if k != "dispatch"), dtype
        # What `auto` trains with on CPU (the other path, grouped, alongside).
        assert d["dispatch"] == "sorted" == batch_dispatch(torch.device("cpu"), torch.bfloat16)
        # The naive per-expert loop is known to be far slower (10-40x here) than the sorted path.
        assert d["loop_ms"] > 2 * d["moe_ms"], dtype
        # No path beats the machine's matmul peak on the same FLOPs (dense in a 2x margin: the
        # chain runs close to the peak in fp32, and the peak is itself a noisy measurement).
        gemm_peak = peak["fp32" if dtype == "fp32" else "bf16"] * 1e9
        for key, slack in (("moe_ms", 1), ("moe_ms_settled", 1), ("loop_ms", 1), ("dense_ms", 2)):
            assert d[key] / 1e3 > flops / (slack * gemm_peak), (dtype, key)
        assert d["expert_gflops_per_s"] * 1e9 < gemm_peak and d["dense_gflops_per_s"] * 1e9 < 2 * gemm_peak
        # Loads: integer counts over a mean of 8 pairs per expert, between balanced and all on
        # top_k experts; the aux-free bias updates flatten the random-init router's load.
        for key in ("load_max_over_mean", "load_max_over_mean_settled"):
            assert 1.0 <= d[key] <= shape["n_experts"] / shape["top_k"], (dtype, key)
            assert (d[key] * mean_load) == pytest.approx(round(d[key] * mean_load)), (dtype, key)
        assert d["load_max_over_mean_settled"] < d["load_max_over_mean"], dtype
        # Each timed function ran at least once inside this call.
        timed_s += sum(d[k] for k in ("moe_ms", "moe_ms_settled", "grouped_ms", "dense_ms", "loop_ms")) / 1e3
    timed_s += sum(out["bf16"][k] for k in ("gemm_only_ms", "gemm_only_bmm_ms", "dense_gemm_ms")) / 1e3
    assert timed_s < wall_s
    # bf16_autocast runs its experts' GEMMs in bf16: the same ceilings as bf16, measured once.
    for k in ("gemm_only_ms", "gemm_only_bmm_ms", "dense_gemm_ms"):
        assert out["bf16_autocast"][k] == out["bf16"][k]
    assert out["targets"] == {"bf16.dense_equiv_ratio": ">= 0.8", "bf16.loop_speedup": ">= 1.5"}


@pytest.mark.slow
def test_bench_train_reports_mfu_and_the_peer():
    pytest.importorskip("transformers")
    from ernie5.bench import preset_model
    from ernie5.bench.timing import matmul_peak
    from ernie5.subnets.params import count_params
    from train.pretrain.bench import bench_train

    t0 = time.perf_counter()
    out = bench_train(repeats=1, peer=True, grad_accum=2, warmup=2)
    wall_s = time.perf_counter() - t0
    json.dumps(out, allow_nan=False)
    assert out["tokens_per_step"] == 2 * 8 * 256 and out["grad_accum"] == 2 and out["warmup_steps"] == 2
    assert out["shape"] == "nano" and out["dtype"] == "bf16"
    assert out["tokens_per_s"] > 0 and 0 < out["mfu"] < 1 and out["mfu_model_flops"] < 1
    # The accounting is the model's (perf-anchors.md: 5,640,960 active non-embedding parameters).
    rep = count_params(preset_model(), None, 256)
    assert out["active_params_no_embedding"] == rep.active_params_no_embedding == 5_640_960
    assert out["train_flops_per_token"] == rep.train_flops_per_token
    phases = out["phase_ms"]
    assert set(phases) == {"forward", "backward", "optimizer"} and all(_positive(v) for v in phases.values())
    assert sum(phases.values()) == pytest.approx(out["step_ms"], rel=0.5)
    assert out["mfu"] < out["mfu_ceiling_optimizer_only"]
    # The model-FLOPs MFU credits the MTP module and the attention cores on top of 6N.
    assert out["mfu_model_flops"] > out["mfu"]
    # The peak is a bf16 matmul rate of this machine (GFLOP/s, not FLOP/s), as measured here.
    here = matmul_peak(torch.bfloat16) / 1e9
    assert here / 4 < out["peak_gflops"] < here * 4 and here / 4 < out["peak_gflops_start"] < here * 4
    peer = out["peer"]
    assert set(peer) == {"model", "default_adamw", "fused_adamw"}
    assert all(_positive(peer[k]["tokens_per_s"]) for k in ("default_adamw", "fused_adamw"))
    assert _positive(out["matched_to_peer"]["tokens_per_s"])
    for k in ("speedup_vs_peer_default_adamw", "speedup_vs_peer_fused_adamw"):
        assert _positive(out[k]) and _positive(out[f"matched_{k}"])
    # Every configuration ran warm-up + timed steps inside this call: ours twice (the full recipe
    # and the peer-matched one), the peer once per optimizer.
    steps = out["warmup_steps"] + 1
    rates = [out["tokens_per_s"], out["matched_to_peer"]["tokens_per_s"]]
    rates += [peer[k]["tokens_per_s"] for k in ("default_adamw", "fused_adamw")]
    assert sum(steps * out["tokens_per_step"] / r for r in rates) < wall_s


def test_bench_decode_reports_paired_speedups_for_every_subnet():
    from ernie5.bench import preset_model
    from ernie5.bench.decode import SUBNETS, bench_decode
    from ernie5.subnets.params import count_params
    from ernie5.subnets.spec import resolve

    repeats, new_tokens, prompt_len, prefill_len = 2, 4, 8, 16
    t0 = time.perf_counter()
    out = bench_decode(
        repeats=repeats,
        new_tokens=new_tokens,
        prompt_len=prompt_len,
        dtypes=("fp32",),
        prefill_len=prefill_len,
    )
    wall_s = time.perf_counter() - t0
    json.dumps(out, allow_nan=False)
    assert out["prefill"]["tokens"] == 16 and _positive(out["prefill"]["tokens_per_s"]["fp32"])
    assert (out["prompt_len"], out["new_tokens"], out["shape"]) == (prompt_len, new_tokens, "nano")
    rows = out["subnets"]
    assert [r["spec"].split(" ")[0] for r in rows] == list(SUBNETS)
    assert rows[-1]["spec"] == "d0.75-w0.5-k1 (extracted)"
    full = rows[0]
    assert full["speedup"] == 1.0 and full["ideal_speedup"] == 1.0 and full["gain_fraction_of_ideal"] is None
    cfg, ctx = preset_model(), prompt_len + new_tokens
    flops = {spec: count_params(cfg, resolve(spec, cfg), ctx).flops_per_token for spec in SUBNETS}
    for r, spec in zip(rows, SUBNETS, strict=True):
        assert r["dtype"] == "fp32"
        assert _positive(r["tokens_per_s"]) and _positive(r["prefill_ms"]) and _positive(r["speedup"])
        assert _positive(r["fraction_of_ideal"])
        # The ideal is the forward-FLOPs ratio and the active parameters the subnet's accounting.
        assert r["ideal_speedup"] == pytest.approx(flops["full"] / flops[spec], rel=1e-12)
        assert r["active_params"] == count_params(cfg, resolve(spec, cfg)).active_params
        if spec != "full":
            assert r["ideal_speedup"] > 1 and r["active_params"] < full["active_params"]
            assert r["gain_fraction_of_ideal"] is not None and math.isfinite(r["gain_fraction_of_ideal"])
    # perf-anchors.md: the nano model has 6,689,536 active parameters.
    assert full["active_params"] == 6_689_536
    by_spec = dict(zip(SUBNETS, rows, strict=True))
    combined = by_spec["d0.75-w0.5-k1"]
    assert combined["ideal_speedup"] > max(by_spec[s]["ideal_speedup"] for s in ("k0.25", "d0.75", "w0.5"))
    assert out["decoding"] == {"mode": "sampled", "temperature": 1.0, "seed": 0}
    assert all(1 <= r["distinct_tokens"] <= new_tokens for r in rows)
    # Every round decoded new_tokens - 1 timed steps per subnet, and prefill ran repeats + 1 times.
    decode_s = sum((new_tokens - 1) / r["tokens_per_s"] for r in rows)
    prefill_s = (repeats + 1) * prefill_len / out["prefill"]["tokens_per_s"]["fp32"]
    assert decode_s + prefill_s + sum(r["prefill_ms"] for r in rows) / 1e3 < wall_s


def test_bench_decode_extracted_row_counts_the_extracted_model():
    """The combined subnet is timed as a standalone extracted model: its active parameters are
    those of the child config that extraction writes, counted on its own."""
    from ernie5.bench import preset_model
    from ernie5.model.model import Ernie5Model
    from ernie5.subnets.extract import extract_subnet
    from ernie5.subnets.params import count_params
    from ernie5.subnets.spec import resolve

    cfg = preset_model()
    with torch.device("meta"):
        parent = Ernie5Model(cfg)
    spec = "d0.75-w0.5-k1"
    child = extract_subnet(parent, resolve(spec, cfg))
    assert count_params(child.cfg).active_params == count_params(cfg, resolve(spec, cfg)).active_params


def test_bench_decode_greedy_and_a_bad_decoding():
    from ernie5.bench.decode import bench_decode

    out = bench_decode(
        repeats=1, new_tokens=3, prompt_len=8, dtypes=("fp32",), decoding="greedy", prefill_len=8
    )
    assert out["decoding"] == {"mode": "greedy", "temperature": 0.0}
    assert all(_positive(r["tokens_per_s"]) for r in out["subnets"])
    with pytest.raises(ValueError, match="decoding='beam'"):
        bench_decode(repeats=1, new_tokens=3, decoding="beam")


def test_cli_bench_runs_the_benchmark_and_prints_its_json(monkeypatch, capsys):
    """``ernie5 bench`` (``jobs.cli``) hands its options to the benchmark and prints its result."""
    from ernie5.bench import decode, moe
    from jobs.cli import main

    calls = []

    def fake(name):
        def run(**kwargs):
            calls.append((name, kwargs))
            return {"bench": name, "x": 1.5}

        return run

    monkeypatch.setattr(moe, "bench_moe", fake("moe"))
    monkeypatch.setattr(decode, "bench_decode", fake("decode"))
    assert main(["bench", "moe", "--json", "--tokens", "64", "--repeats", "3"]) == 0
    assert json.loads(capsys.readouterr().out) == {"bench": "moe", "x": 1.5}
    assert calls[-1] == ("moe", {"tokens": 64, "repeats": 3, "device": torch.device("cpu")})
    assert main(["bench", "decode", "--repeats", "2", "--new-tokens", "5", "--decoding", "greedy"]) == 0
    assert json.loads(capsys.readouterr().out) == {"bench": "decode", "x": 1.5}
    assert calls[-1] == (
        "decode",
        {"repeats": 2, "new_tokens": 5, "device": torch.device("cpu"), "decoding": "greedy", "shape": "nano"},
    )


@pytest.mark.parametrize(
    "argv, match",
    [
        (["bench", "moe", "--repeats", "0"], "--repeats 0: expected an integer >= 1"),
        (["bench", "moe", "--grad-accum", "2"], "--grad-accum applies to `bench train`, not `bench moe`"),
        (["bench", "train", "--decoding", "greedy"], "--decoding applies to `bench decode`"),
        (["bench", "moe", "--device", "npu"], "'npu': expected cpu or cuda"),
        (["bench", "moe", "--fp8"], "--fp8 applies to `bench train`, not `bench moe`"),
        (["bench", "moe", "--items", "3"], "--checkpoint and --items apply to `bench harness`"),
        (["bench", "harness", "--items", "0"], "--items 0: expected an integer >= 1"),
        (
            ["bench", "train", "--fp8", "--device", "cpu"],
            "--fp8: train.fp8 needs a CUDA GPU (this run is on cpu)",
        ),
    ],
)
def test_cli_bench_bad_options_are_one_line_errors(argv, match, capsys):
    from jobs.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ernie5 bench: error: ") and match in err and err.count("\n") == 1


def test_alternating_medians_times_each_function_in_turn():
    from ernie5.bench.timing import alternating_medians

    calls: list[str] = []
    out = alternating_medians(
        {"a": lambda: calls.append("a"), "b": lambda: time.sleep(0.002) or calls.append("b")},
        repeats=3,
        warmup=1,
    )
    assert set(out) == {"a", "b"} and all(v >= 0 for v in out.values())
    assert calls == ["a", "b"] * 4  # one warm-up round, then three timed rounds, alternating
    assert 0.002 <= out["b"] < 1.0 and out["a"] < out["b"]  # seconds, per call


def test_resolve_device_accepts_cpu_and_names_a_bad_value():
    from ernie5.bench.timing import resolve_device, synchronizer

    assert resolve_device("cpu") == torch.device("cpu")
    synchronizer("cpu")()  # nothing to wait for on CPU
    with pytest.raises(ValueError, match="'npu': expected cpu or cuda"):
        resolve_device("npu")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"'cuda:{n}': this machine has {n} CUDA device"):
        resolve_device(f"cuda:{n}")


def test_bench_decode_times_each_dtype_on_weights_of_that_dtype(monkeypatch):
    """Whatever the order of ``dtypes``, each row decodes with weights of its own dtype."""
    from ernie5.bench import decode

    seen: list[tuple[str, torch.dtype]] = []

    def prefill(model, length, repeats):
        seen.append(("prefill", model.tok_emb.weight.dtype))
        return 1.0

    def generate(model, prompts, n, **kwargs):
        seen.append(("generate", model.tok_emb.weight.dtype))
        return [[i % 3 for i in range(n)] for _ in prompts]

    monkeypatch.setattr(decode, "_prefill_tokens_per_s", prefill)
    monkeypatch.setattr(decode, "generate", generate)
    out = decode.bench_decode(repeats=1, new_tokens=3, prompt_len=4, dtypes=("bf16", "fp32"), prefill_len=4)
    per_dtype = 1 + 2 * 2 * len(decode.SUBNETS)  # prefill, then 2 rounds x (prefill + decode) per subnet
    assert len(seen) == 2 * per_dtype
    assert {d for _, d in seen[:per_dtype]} == {torch.bfloat16}
    assert {d for _, d in seen[per_dtype:]} == {torch.float32}
    assert [r["dtype"] for r in out["subnets"]] == ["bf16"] * len(decode.SUBNETS) + ["fp32"] * len(
        decode.SUBNETS
    )


def test_activation_checkpointing_shrinks_the_saved_activations():
    """``bench train --activation-checkpoint``: blocks keep only their inputs for the backward."""
    from ernie5.config import from_dict, read_yaml
    from ernie5.model.config import ModelConfig
    from ernie5.presets import resolve_config_path
    from train.pretrain.bench import _time_step

    cfg = from_dict(ModelConfig, read_yaml(resolve_config_path("micro"))["model"])
    saved = {}
    for ac in (False, True):
        mem: dict[str, float] = {}
        _time_step(cfg, "fp32", 2, 64, 1, True, None, 1, 0, "cpu", ac, mem)
        saved[ac] = mem["saved_activation_mb"]
    assert 0 < saved[True] < 0.6 * saved[False]  # the head, MTP module and loss keep theirs


def test_bench_harness_times_each_family_shared_and_unshared(tmp_path):
    """Procedural families are timed both ways; families whose data the (absent) root lacks are
    skips naming what is missing; the two scorings agree."""
    from ernie5.store.checkpoint import save_checkpoint
    from evals.bench import FAMILIES, bench_harness
    from tests.conftest import micro_multimodal_parts

    model, tok, vtok, codec = micro_multimodal_parts()
    save_checkpoint(tmp_path / "ckpt", model, tokenizer=tok, vision_tokenizer=vtok, audio_codec=codec)
    t0 = time.perf_counter()
    out = bench_harness(str(tmp_path / "ckpt"), data_dir=None, items=2, repeats=1, batch_size=4)
    wall = time.perf_counter() - t0
    assert set(out["families"]) == {"digit_vqa_strokes", "shapes_vqa_attr", "video_shapes"}
    named = {t for tasks in FAMILIES.values() for t in tasks}
    assert {k.split(":")[-1] for k in [*out["families"], *out["skipped"]]} == named
    assert all("data" in why or "missing" in why for why in out["skipped"].values())
    for row in out["families"].values():
        assert row["items"] == 2 and row["requests"] == round(row["choices_per_item"] * 2)
        assert 0 < 2 / row["items_per_s_shared"] < wall and 0 < 2 / row["items_per_s_each"] < wall
        assert row["speedup"] == pytest.approx(row["items_per_s_shared"] / row["items_per_s_each"], rel=0.02)
        assert row["max_abs_logprob_gap"] < 1e-3


def test_bench_gemm_times_the_grouped_experts_beside_a_dense_matmul_of_the_same_flops():
    from ernie5.bench.gemm import SHAPES, bench_gemm, routed_rows

    t0 = time.perf_counter()
    out = bench_gemm(repeats=2)
    wall_s = time.perf_counter() - t0
    json.dumps(out, allow_nan=False)
    s = SHAPES["nano"]
    assert out["shape"]["name"] == "nano" and out["shape"]["rows"] == s["tokens"] * s["top_k"]
    counts = routed_rows(s["tokens"], s["n_experts"], s["top_k"])
    assert int(counts.sum()) == s["tokens"] * s["top_k"] and out["shape"]["max_rows_per_expert"] == int(
        counts.max()
    )
    flops = 6 * out["shape"]["rows"] * s["d_model"] * s["d_expert"]
    for kind in ("grouped", "dense"):
        ms = out[f"{kind}_ms"]
        assert _positive(ms) and ms / 1e3 < wall_s
        assert out[f"{kind}_tflops"] == pytest.approx(flops / (ms / 1e3) / 1e12, rel=1e-9)
    assert out["grouped_over_dense"] == pytest.approx(out["grouped_tflops"] / out["dense_tflops"], rel=1e-9)
    assert out["grouped_over_peak"] == pytest.approx(out["grouped_tflops"] / out["peak_tflops"], rel=1e-9)
    with pytest.raises(ValueError, match="shape='huge'"):
        bench_gemm(shape="huge")


def test_bench_decode_sets_each_row_against_the_memory_bound():
    from ernie5.bench import preset_model
    from ernie5.bench.decode import bench_decode

    prompt_len, new_tokens = 8, 4
    out = bench_decode(
        repeats=1, new_tokens=new_tokens, prompt_len=prompt_len, dtypes=("fp32", "bf16"), prefill_len=8
    )
    bandwidth = out["memory_bandwidth_gb_s"] * 1e9
    assert _positive(bandwidth)
    cfg = preset_model()
    for r in out["subnets"]:
        size = 4 if r["dtype"] == "fp32" else 2
        assert r["bytes_per_token"] > r["active_params"] * size  # the KV cache on top of the weights
        kv = r["bytes_per_token"] / size - r["active_params"]
        assert kv <= 2 * cfg.n_layers * cfg.n_kv_heads * cfg.dim_head * (prompt_len + new_tokens)
        assert r["bandwidth_bound_tokens_per_s"] == pytest.approx(bandwidth / r["bytes_per_token"], rel=1e-9)
        assert r["fraction_of_bandwidth_bound"] == pytest.approx(
            r["tokens_per_s"] / r["bandwidth_bound_tokens_per_s"]
        )


def test_bench_parity_of_the_cpu_with_itself_is_exact():
    from ernie5.bench.parity import bench_parity

    out = bench_parity(batch=1, seq_len=16, new=4)
    assert out["forward_rel_l2"] == 0.0 and out["forward_max_abs"] == 0.0
    assert out["top1_agreement"] == 1.0 and out["greedy_tokens_equal"] is True


def test_cli_bench_shape_options_reach_the_benchmarks(monkeypatch, capsys):
    from ernie5.bench import gemm
    from jobs.cli import main
    from train.pretrain import bench

    calls = []
    monkeypatch.setattr(gemm, "bench_gemm", lambda **kw: calls.append(("gemm", kw)) or {"ok": 1})
    monkeypatch.setattr(bench, "bench_train", lambda **kw: calls.append(("train", kw)) or {"ok": 1})
    assert main(["bench", "gemm", "--shape", "gpu", "--repeats", "2", "--json"]) == 0
    assert calls[-1] == ("gemm", {"shape": "gpu", "repeats": 2, "device": torch.device("cpu")})
    argv = ["bench", "train", "--shape", "gpu_fill", "--batch-size", "2", "--seq-len", "64", "--json"]
    assert main(argv) == 0
    kw = calls[-1][1]
    assert (kw["shape"], kw["batch_size"], kw["seq_len"]) == ("gpu_fill", 2, 64)
    capsys.readouterr()
    for argv, match in (
        (["bench", "moe", "--shape", "gpu"], "--shape applies to `bench gemm`, `train` and `decode`"),
        (["bench", "decode", "--seq-len", "8"], "--seq-len 8: applies to `bench train` only"),
        (["bench", "train", "--batch-size", "0"], "--batch-size 0: expected an integer >= 1"),
        (["bench", "train", "--shape", "gpu_fill", "--peer"], "--peer times the peer at the nano shape only"),
        (["bench", "train", "--shape", "huge"], "unknown preset 'huge'"),
    ):
        monkeypatch.setattr(
            bench, "bench_train", __import__("train.pretrain.bench", fromlist=["x"]).bench_train
        )
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1, err
