"""Benchmarks: the JSON contract (figures themselves are checked by running them, never by tests)."""

from __future__ import annotations

import pytest
import torch


def test_bench_moe_reports_both_ratios_per_dtype():
    from ernie5.bench.moe import bench_moe

    out = bench_moe(tokens=256, repeats=1, loop_repeats=1, settle_steps=5)
    for dtype in ("bf16", "bf16_autocast", "fp32"):
        d = out[dtype]
        assert d["moe_ms"] > 0 and d["dense_ms"] > 0 and d["loop_ms"] > 0
        assert d["dense_equiv_ratio"] == pytest.approx(d["dense_ms"] / d["moe_ms"])
        assert d["loop_speedup"] == pytest.approx(d["loop_ms"] / d["moe_ms"])
        assert d["dispatch"] == "sorted"  # what auto trains with on CPU; the other path alongside
        assert d["grouped_speedup"] == pytest.approx(d["grouped_ms"] / d["moe_ms"])
        # The ceilings: GEMMs alone, then GEMMs plus the dense chain's own activation cost.
        assert d["dense_equiv_ratio_gemm_only"] == pytest.approx(d["dense_ms"] / d["gemm_only_ms"])
        assert d["dense_equiv_ratio_ceiling"] <= d["dense_equiv_ratio_gemm_only"] + 1e-9
        assert d["gemm_only_bmm_ms"] > 0  # the same products through torch.bmm, for comparison
        # The same layer once the aux-free bias has moved (training's steady state).
        assert d["dense_equiv_ratio_settled"] == pytest.approx(d["dense_ms"] / d["moe_ms_settled"])
        assert d["load_max_over_mean_settled"] >= 1.0 and d["load_max_over_mean"] >= 1.0
    assert out["matmul_peak_gflops"]["bf16"] > 0


@pytest.mark.slow
def test_bench_train_reports_mfu_and_the_peer():
    pytest.importorskip("transformers")
    from train.bench import bench_train

    out = bench_train(repeats=1, peer=True, grad_accum=2, warmup=2)
    assert out["tokens_per_step"] == 2 * 8 * 256 and out["grad_accum"] == 2 and out["warmup_steps"] == 2
    assert out["tokens_per_s"] > 0 and 0 < out["mfu"] < 1
    phases = out["phase_ms"]
    assert set(phases) == {"forward", "backward", "optimizer"}
    assert sum(phases.values()) == pytest.approx(out["step_ms"], rel=0.5)
    assert out["mfu"] < out["mfu_ceiling_optimizer_only"]
    # The model-FLOPs MFU credits the MTP module and the attention cores on top of 6N.
    assert out["mfu_model_flops"] / out["mfu"] == pytest.approx(
        out["train_flops_per_token"] / (6 * out["active_params_no_embedding"])
    )
    assert out["mfu_model_flops"] > out["mfu"] and out["peak_gflops"] >= out["peak_gflops_start"]
    assert out["peer"]["fused_adamw"]["tokens_per_s"] > 0
    assert out["speedup_vs_peer_fused_adamw"] == pytest.approx(
        out["tokens_per_s"] / out["peer"]["fused_adamw"]["tokens_per_s"]
    )


def test_bench_decode_reports_paired_speedups_for_every_subnet():
    from ernie5.bench.decode import SUBNETS, bench_decode

    out = bench_decode(repeats=2, new_tokens=4, prompt_len=8, dtypes=("fp32",), prefill_len=16)
    assert out["prefill"]["tokens"] == 16 and out["prefill"]["tokens_per_s"]["fp32"] > 0
    rows = out["subnets"]
    assert [r["spec"].split(" ")[0] for r in rows] == list(SUBNETS)
    full = rows[0]
    assert full["speedup"] == 1.0 and full["ideal_speedup"] == 1.0 and full["gain_fraction_of_ideal"] is None
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["prefill_ms"] > 0 and r["active_params"] > 0
        assert r["fraction_of_ideal"] == pytest.approx(r["speedup"] / r["ideal_speedup"])
    k = next(r for r in rows if r["spec"] == "k0.25")
    assert k["ideal_speedup"] > 1 and k["active_params"] < full["active_params"]
    assert out["decoding"] == {"mode": "sampled", "temperature": 1.0, "seed": 0}
    assert all(1 <= r["distinct_tokens"] <= 4 for r in rows)


def test_bench_decode_greedy_and_a_bad_decoding():
    from ernie5.bench.decode import bench_decode

    out = bench_decode(
        repeats=1, new_tokens=3, prompt_len=8, dtypes=("fp32",), decoding="greedy", prefill_len=8
    )
    assert out["decoding"] == {"mode": "greedy", "temperature": 0.0}
    with pytest.raises(ValueError, match="decoding='beam'"):
        bench_decode(repeats=1, new_tokens=3, decoding="beam")


def test_alternating_medians_times_each_function_in_turn():
    from ernie5.bench.timing import alternating_medians

    calls: list[str] = []
    out = alternating_medians(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1
    )
    assert set(out) == {"a", "b"} and all(v >= 0 for v in out.values())
    assert calls == ["a", "b"] * 4  # one warm-up round, then three timed rounds, alternating


def test_resolve_device_accepts_cpu_and_names_a_bad_value():
    from ernie5.bench.timing import resolve_device, synchronizer

    assert resolve_device("cpu") == torch.device("cpu")
    synchronizer("cpu")()  # nothing to wait for on CPU
    with pytest.raises(ValueError, match="'npu': expected cpu or cuda"):
        resolve_device("npu")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=f"'cuda:{n}': this machine has {n} CUDA device"):
        resolve_device(f"cuda:{n}")
