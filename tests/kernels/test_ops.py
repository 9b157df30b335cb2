"""Fused CPU kernels against their eager PyTorch references (forward and gradients)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from ernie5 import kernels as kernels_pkg
from ernie5.fast.layers import FusedRMSNorm
from ernie5.kernels import kernels, ops
from ernie5.model.rope import apply_rope, inv_frequencies, rope_cos_sin

needs_kernels = pytest.mark.skipif(kernels() is None, reason="fused CPU kernels did not build here")

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


def _grads(fn, inputs, grad_outs):
    for t in inputs:
        t.grad = None
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, grad_outs)
    return [o.detach() for o in outs], [t.grad.clone() for t in inputs]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 37), (1, 1, 256), (5, 256), (8, 64, 256)])
def test_rms_norm_matches_eager(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype).requires_grad_()
    w = (torch.rand(shape[-1]) + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(shape).to(dtype)
    ref_out, ref_grads = _grads(lambda x, w: F.rms_norm(x, (shape[-1],), w, 1e-6), [x, w], [dy])
    out, grads = _grads(lambda x, w: ops.rms_norm(x, w, 1e-6), [x, w], [dy])
    _close(out[0], ref_out[0], dtype)
    _close(grads[0], ref_grads[0], dtype)
    # The weight gradient sums over every row: compare relative to its scale.
    scale = ref_grads[1].float().abs().max()
    torch.testing.assert_close(grads[1].float() / scale, ref_grads[1].float() / scale, atol=1e-2, rtol=0)


@needs_kernels
def test_rms_norm_module_is_nn_rmsnorm():
    ref = torch.nn.RMSNorm(48, eps=1e-5)
    mod = FusedRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    mod.load_state_dict(ref.state_dict())
    assert list(mod.state_dict()) == list(ref.state_dict())
    x = torch.randn(4, 7, 48)
    _close(mod(x), ref(x), torch.float32)
    x_nc = torch.randn(4, 48, 7).transpose(1, 2)  # non-contiguous input
    _close(mod(x_nc), ref(x_nc), torch.float32)
    x64 = x.double()  # not fusable: the module runs nn.RMSNorm itself
    assert not ops.fusable(x64, mod.weight.double())
    _close(mod.double()(x64), ref.double()(x64), torch.float32)


@needs_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_rows_linear_module_is_nn_linear(bias):
    """RowsLinear keeps nn.Linear's parameters and function: a decoding call (few rows, no gradient)
    takes the few-row product, and a bias, which that product has not, is still added."""
    from ernie5.fast.layers import RowsLinear

    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 32, bias=bias)
    mod = RowsLinear(64, 32, bias=bias)
    mod.load_state_dict(ref.state_dict())
    assert list(mod.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 1, 64)
    with torch.no_grad():
        _close(mod(x), ref(x), torch.float32)
    _close(mod(x), ref(x), torch.float32)


def _qk_reference(qkv, q_w, k_w, cos, sin, h, k, eps):
    q, kk, v = qkv.split([h, k, k], dim=2)
    if q_w is not None:
        dh = qkv.shape[-1]
        q, kk = F.rms_norm(q, (dh,), q_w, eps), F.rms_norm(kk, (dh,), k_w, eps)
    return (
        apply_rope(q.transpose(1, 2), cos, sin),
        apply_rope(kk.transpose(1, 2), cos, sin),
        v.transpose(1, 2),
    )


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dh", [16, 32, 48, 64, 128])  # 32, 64, 128 have compile-time head-dim kernels
def test_qk_norm_rope_matches_eager(dtype, qk_norm, dh):
    torch.manual_seed(0)
    b, t, h, k = 2, 9, 4, 2
    qkv = torch.randn(b, t, h + 2 * k, dh).to(dtype).requires_grad_()
    weights = [(torch.rand(dh) + 0.5).to(dtype).requires_grad_() for _ in range(2)] if qk_norm else []
    # Uni-RoPE with distinct (t, h, w) positions, so every section of the tables differs.
    pos = torch.stack([torch.randint(0, 50, (b, t)) for _ in range(3)])
    cos, sin = rope_cos_sin(pos, inv_frequencies(dh, 1e4), (dh // 4, dh // 8, dh // 8))
    grads_out = [torch.randn(b, n, t, dh).to(dtype) for n in (h, k, k)]
    q_w, k_w = weights or (None, None)

    def ref(qkv, *w):
        return _qk_reference(qkv, *(w or (None, None)), cos, sin, h, k, 1e-6)

    def fused(qkv, *w):
        return ops.qk_norm_rope(qkv, *(w or (None, None)), cos, sin, h, k, 1e-6)

    ref_out, ref_grads = _grads(ref, [qkv, *weights], grads_out)
    out, grads = _grads(fused, [qkv, *weights], grads_out)
    for a, r in zip(out, ref_out):
        assert a.shape == r.shape and a.is_contiguous()
        _close(a, r, dtype)
    _close(grads[0], ref_grads[0], dtype)
    for g, r in zip(grads[1:], ref_grads[1:]):
        scale = r.float().abs().max()
        torch.testing.assert_close(g.float() / scale, r.float() / scale, atol=1e-2, rtol=0)
    assert q_w is None or q_w.grad is not None


def _swiglu_reference(h, gate):
    g, u = h.chunk(2, dim=1)
    return F.silu(g) * u * gate[:, None]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_gate_matches_eager(dtype):
    torch.manual_seed(0)
    e, f, c = 3, 24, 13
    h = (torch.randn(e, 2 * f, c) * 4).to(dtype)
    h[0, 0, :4] = torch.tensor([-100.0, 100.0, -30.0, 30.0])  # the exp approximation's clamped range
    gate = torch.rand(e, c).to(dtype)
    gate[:, -2:] = 0  # pad slots
    dout = torch.randn(e, f, c).to(dtype)
    hr, gr = h.clone().requires_grad_(), gate.clone().requires_grad_()
    ref = _swiglu_reference(hr, gr)
    ref.backward(dout)
    none = torch.empty(0, dtype=torch.long)
    out = kernels().swiglu_gate_fwd(h, gate, none)
    d_h, d_gate = kernels().swiglu_gate_bwd(dout, h, gate, none)
    _close(out, ref, dtype)
    _close(d_h, hr.grad, dtype)
    assert d_gate.dtype == torch.float32
    scale = gr.grad.float().abs().max()
    torch.testing.assert_close(
        d_gate / scale, gr.grad.float() / scale, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0
    )
    assert torch.isfinite(out).all() and torch.isfinite(d_h).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_gate_with_slot_counts_skips_the_pad_slots(dtype):
    """Given each expert's valid slot count, the kernels compute those slots as without counts and
    write zeros to the rest without reading them (NaN there changes nothing)."""
    torch.manual_seed(1)
    e, f, c = 3, 24, 13
    counts = torch.tensor([13, 0, 5])
    h = torch.randn(e, 2 * f, c).to(dtype)
    gate = torch.rand(e, c).to(dtype)
    dout = torch.randn(e, f, c).to(dtype)
    none = torch.empty(0, dtype=torch.long)
    full_out = kernels().swiglu_gate_fwd(h, gate, none)
    full_dh, full_dgate = kernels().swiglu_gate_bwd(dout, h, gate, none)
    for i, n in enumerate(counts.tolist()):
        h[i, :, n:], gate[i, n:], dout[i, :, n:] = float("nan"), float("nan"), float("nan")
    out = kernels().swiglu_gate_fwd(h, gate, counts)
    d_h, d_gate = kernels().swiglu_gate_bwd(dout, h, gate, counts)
    for i, n in enumerate(counts.tolist()):
        assert torch.equal(out[i, :, :n], full_out[i, :, :n]) and not out[i, :, n:].any()
        assert torch.equal(d_h[i, :, :n], full_dh[i, :, :n]) and not d_h[i, :, n:].any()
        assert torch.equal(d_gate[i, :n], full_dgate[i, :n]) and not d_gate[i, n:].any()
    with pytest.raises(RuntimeError, match="slot count 14 outside"):
        kernels().swiglu_gate_fwd(h, gate, torch.tensor([14, 0, 0]))


@needs_kernels
def test_kernels_are_deterministic():
    torch.manual_seed(0)
    x = torch.randn(64, 33, 40, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(40, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    first = _grads(lambda x, w: ops.rms_norm(x, w, 1e-6), [x, w], [dy])
    second = _grads(lambda x, w: ops.rms_norm(x, w, 1e-6), [x, w], [dy])
    for a, b in zip(first[0] + first[1], second[0] + second[1]):
        assert torch.equal(a, b)


def test_off_mode_runs_eager(monkeypatch):
    monkeypatch.setenv("ERNIE5_KERNELS", "off")
    x = torch.randn(3, 8)
    assert kernels() is None and not ops.fusable(x)
    assert kernels_pkg.status() == "off"
    assert kernels_pkg.attention_status() == "pytorch (kernels off)"
    mod = FusedRMSNorm(8, eps=1e-6)
    torch.testing.assert_close(mod(x), F.rms_norm(x, (8,), mod.weight, 1e-6))


@needs_kernels
def test_attention_status_names_the_path():
    mod = kernels()
    expected = (
        ("fused (amx)" if mod.attention_amx() else "fused (avx512-bf16)")
        if mod.attention_available()
        else "pytorch (no avx512-bf16 build)"
    )
    assert kernels_pkg.attention_status() == expected


def test_bad_mode_is_an_error(monkeypatch):
    monkeypatch.setenv("ERNIE5_KERNELS", "fast")
    with pytest.raises(ValueError, match="ERNIE5_KERNELS='fast'"):
        kernels()


def test_mode_follows_every_change_of_the_variable(monkeypatch):
    """mode() keeps its parse per value object of the variable: any change is still seen at once."""
    for value, expected in (("off", "off"), (" ON ", "on"), ("off", "off"), ("", "auto"), ("auto", "auto")):
        monkeypatch.setenv("ERNIE5_KERNELS", value)
        assert kernels_pkg.mode() == expected and kernels_pkg.mode() == expected
    monkeypatch.delenv("ERNIE5_KERNELS")
    assert kernels_pkg.mode() == "auto"
    monkeypatch.setenv("ERNIE5_KERNELS", "turbo")
    for _ in range(2):  # a bad value is an error every time, never remembered as a mode
        with pytest.raises(ValueError, match="ERNIE5_KERNELS='turbo'"):
            kernels_pkg.mode()


def test_build_failure_falls_back_to_eager(monkeypatch):
    monkeypatch.setattr(kernels_pkg, "_STATE", {})

    def broken():
        raise RuntimeError("no C++ compiler (c++) on PATH")

    monkeypatch.setattr(kernels_pkg, "_build", broken)
    with pytest.warns(UserWarning, match="using eager PyTorch"):
        assert kernels() is None
    assert kernels_pkg.status().startswith("eager (RuntimeError: no C++ compiler")
    monkeypatch.setenv("ERNIE5_KERNELS", "on")
    monkeypatch.setattr(kernels_pkg, "_STATE", {})
    with pytest.raises(RuntimeError, match="ERNIE5_KERNELS=on"):
        kernels()


@needs_kernels
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize(
    ("masked", "norm", "scale"), [(False, True, 1.0), (True, True, 2.5), (True, False, 1.0)]
)
@pytest.mark.parametrize("e", [12, 64])  # 64: whole 16-lane rows, the kernel's vector argmax
def test_route_topk_matches_eager(score_func, masked, norm, scale, e):
    """The fast MoE layer's routing (fused router logits and ``route_topk``) against the model's
    eager routing (:meth:`ernie5.model.moe.MoE.route`) of the same layer."""
    from ernie5.fast import apply_fast_paths
    from ernie5.fast.moe import FastMoE
    from ernie5.model.config import MoEConfig
    from ernie5.model.moe import MoE

    torch.manual_seed(0)
    n, d, k = 50, 16, 3
    cfg = MoEConfig(
        n_experts=e, d_expert=8, top_k=k, score_func=score_func, norm_topk=norm, route_scale=scale
    )
    x = torch.randn(n, d, requires_grad=True)
    layer = apply_fast_paths(MoE(d, cfg))
    assert isinstance(layer, FastMoE)
    w = layer.router.weight
    with torch.no_grad():
        w.copy_(torch.randn(e, d) * 0.5)
        layer.router_bias.copy_(torch.randn(e) * 0.05)
    mask = torch.rand(e) > 0.3 if masked else None
    dg = torch.randn(n, k)

    def run(route):
        x.grad = w.grad = None
        r = route(layer, x, k, mask, n)
        order = r.expert_ids_NA.argsort(dim=-1)  # slot order is unspecified (topk sorted=False)
        ids, gates = r.expert_ids_NA.gather(-1, order), r.gates_NA.gather(-1, order)
        (gates * dg).sum().backward()
        return ids, gates.detach(), r.counts_E, x.grad.clone(), w.grad.clone()

    fused = run(FastMoE.route)
    eager = run(MoE.route)
    assert torch.equal(fused[0], eager[0]) and torch.equal(fused[2], eager[2])
    if mask is not None:
        assert mask[fused[0]].all()
    for a, b in zip(fused[1:2] + fused[3:], eager[1:2] + eager[3:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("e", [12, 32])
def test_route_topk_takes_the_lowest_index_among_ties(e):
    """Equal selection scores go to the lowest expert index, in the scalar (e = 12) and the vector
    (e = 32) argmax alike; a row of NaN logits (a diverged model) still yields ids in range."""
    logits = torch.zeros(4, e)
    logits[1, [5, e - 1]] = 1.0  # two maxima: 5 first, then e - 1
    logits[2, -3:] = 2.0  # the maxima at the end
    logits[3] = float("nan")
    none = torch.empty(0, dtype=torch.bool)
    ids, _, counts = kernels().route_topk_fwd(logits, torch.zeros(e), none, 2, False, True, 1.0)
    assert ids[0].tolist() == [0, 1]
    assert ids[1].tolist() == [5, e - 1]
    assert ids[2].tolist() == [e - 3, e - 2]
    assert all(0 <= i < e for i in ids[3].tolist())
    assert int(counts.sum()) == 8


@needs_kernels
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_route_topk_logit_gradient_is_exactly_sparse_with_renormalised_gates(score_func):
    """Renormalised top-k gates depend on the selected logits only (for softmax the denominator
    cancels): the fused backward writes exact zeros elsewhere, which the router's sparse backward
    pass relies on."""
    torch.manual_seed(1)
    logits = torch.randn(200, 16, requires_grad=True)
    mask = torch.rand(16) > 0.2
    ids, gates, _ = ops.route_topk(logits, torch.zeros(16), mask, 3, score_func == "sigmoid", True, 1.0)
    gates.backward(torch.randn_like(gates))
    selected = torch.zeros(200, 16, dtype=torch.bool).scatter_(1, ids, True)
    assert not logits.grad[~selected].any()
    assert logits.grad[selected].ne(0).float().mean() > 0.99


@needs_kernels
@pytest.mark.parametrize("skew", [0.0, 1.0, 3.0])
def test_dispatch_levels_matches_eager(skew):
    from ernie5.fast.moe_levels import _dispatch_eager, plan_dispatch, plan_levels
    from ernie5.model.moe import RouterOutput

    torch.manual_seed(int(skew))
    n, e, a = 300, 16, 2
    probs = torch.softmax(torch.randn(e) * skew, 0)
    ids = torch.stack([torch.multinomial(probs, a) for _ in range(n)])
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    r = RouterOutput(ids, torch.rand(n, a), counts, None, None)
    fused_plan = plan_dispatch(r, n)
    eager_plan = _dispatch_eager(r, n, plan_levels(counts.tolist()))
    assert torch.equal(fused_plan.slot_of_pair, eager_plan.slot_of_pair)
    fused, eager = fused_plan.levels, eager_plan.levels
    assert len(fused) == len(eager) >= 1
    for f, g in zip(fused, eager):
        assert f.cap == g.cap
        assert (f.experts is None) == (g.experts is None)
        if f.experts is not None:
            assert torch.equal(f.experts, g.experts)
        assert torch.equal(f.tok_EC, g.tok_EC) and torch.equal(f.pair_EC, g.pair_EC)
    if skew == 3.0:
        assert any(f.experts is not None for f in fused)  # a subset level was exercised


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skew", [0.0, 3.0])
def test_gather_and_combine_rows_match_eager(dtype, skew):
    """The fused gather (pad slots read as zero rows) and combine (sum of a token's pairs) against
    index_select on a zero-padded copy and index_add_ into a zero buffer, over every level."""
    from ernie5.fast.moe_levels import plan_dispatch
    from ernie5.model.moe import RouterOutput

    torch.manual_seed(int(skew) + 7)
    n, e, a, d = 300, 16, 2, 40
    probs = torch.softmax(torch.randn(e) * skew, 0)
    ids = torch.stack([torch.multinomial(probs, a) for _ in range(n)])
    r = RouterOutput(ids, torch.rand(n, a), torch.bincount(ids.reshape(-1), minlength=e), None, None)
    plan = plan_dispatch(r, n)
    x = torch.randn(n, d).to(dtype)
    x_pad = torch.cat([x, x.new_zeros(1, d)])
    outs_ECD, outs_EDC = [], []
    for lv in plan.levels:
        got = kernels().gather_rows(x, lv.tok_EC)
        assert torch.equal(got, x_pad.index_select(0, lv.tok_EC))
        rows = lv.tok_EC.numel() // lv.cap
        outs_ECD.append(torch.randn(rows, lv.cap, d).to(dtype))
        outs_EDC.append(torch.randn(rows, d, lv.cap).to(dtype))
    for transposed, outs in ((False, outs_ECD), (True, outs_EDC)):
        ref = torch.zeros(n + 1, d)
        for lv, o in zip(plan.levels, outs):
            o_ECD = o.transpose(1, 2) if transposed else o
            ref.index_add_(0, lv.tok_EC, o_ECD.float().reshape(-1, d))
        got = kernels().combine_rows(outs, plan.slot_of_pair, n, transposed)
        _close(got, ref[:n].to(dtype), dtype)
    if skew:
        assert len(plan.levels) >= 2  # the slot map spans several levels


@needs_kernels
def test_gather_and_combine_reject_bad_indices():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="outside"):
        kernels().gather_rows(x, torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="outside"):
        kernels().combine_rows([torch.randn(2, 2, 8)], torch.tensor([0, 1, 2, 9]), 2, False)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_grad", [False, True])
def test_cross_entropy_rows_match_eager(dtype, with_grad):
    """The fused per-row log-sum-exp / NLL / in-place logit gradient against the chunked eager path,
    including IGNORE targets, row weights and a row count that is not a multiple of the chunk."""
    from ernie5.fast.loss import _chunked_nll, _chunked_nll_eager
    from ernie5.model.inputs import IGNORE

    torch.manual_seed(11)
    n, v = 300, 1000
    logits = (torch.randn(n, v) * 4).to(dtype)
    targets = torch.randint(0, v, (n,))
    targets[::7] = IGNORE
    scale = torch.rand(n) * (targets != IGNORE) if with_grad else None
    fused, eager = logits.clone(), logits.clone()
    nll_fused = _chunked_nll(fused, targets, scale)
    nll_eager = _chunked_nll_eager(eager, targets, scale)
    torch.testing.assert_close(nll_fused, nll_eager, atol=1e-5, rtol=1e-5)
    assert bool((nll_fused[::7] == 0).all())
    if with_grad:
        _close(fused, eager, dtype)
        assert bool((fused[::7] == 0).all())  # ignored rows get no gradient
    else:
        assert torch.equal(fused, logits)  # without a scale the logits are left alone


@needs_kernels
def test_cross_entropy_rows_reject_a_target_outside_the_vocabulary():
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        kernels().ce_rows(torch.randn(2, 5), torch.tensor([1, 5]), torch.empty(0))


@pytest.mark.skipif(__import__("shutil").which("c++") is None, reason="no C++ compiler")
def test_a_first_build_says_so_and_a_cached_one_does_not(monkeypatch, capsys, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: "module")
    assert kernels_pkg._build() == "module"
    assert "building the fused CPU kernels" in capsys.readouterr().err
    (tmp_path / "ext.so").write_bytes(b"")
    kernels_pkg._build()
    assert capsys.readouterr().err == ""


def _waits_like_torch(build_dir):
    """A stand-in for ``cpp_extension.load`` that waits on its ``lock`` file as torch's FileBaton
    does (with a deadline here, so a failure is a failure, not a hang)."""

    def load(**kw):
        import time

        deadline = time.monotonic() + 5
        while (build_dir / kernels_pkg.TORCH_LOCK).exists():
            if time.monotonic() > deadline:
                raise TimeoutError("waited on a stale lock")
            time.sleep(0.05)
        return "module"

    return load


def test_a_build_killed_half_way_does_not_block_the_next(monkeypatch, tmp_path):
    """A ``lock`` left by a killed build is removed once this process holds the build flock."""
    from torch.utils import cpp_extension

    (tmp_path / kernels_pkg.TORCH_LOCK).write_text("")  # what a kill -9 during a build leaves
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", _waits_like_torch(tmp_path))
    assert kernels_pkg._build() == "module"
    assert not (tmp_path / kernels_pkg.TORCH_LOCK).exists()


def _hold_build_flock(path: str, ready, release) -> None:
    import fcntl

    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        ready.set()
        release.wait(30)


def test_a_live_build_is_waited_for_and_its_lock_left_alone(monkeypatch, tmp_path, capsys):
    """While another process holds the build flock (it is building), this one waits and says so,
    and does not touch that build's ``lock``."""
    import multiprocessing as mp
    import threading

    from torch.utils import cpp_extension

    ctx = mp.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(
        target=_hold_build_flock, args=(str(tmp_path / kernels_pkg.BUILD_FLOCK), ready, release)
    )
    holder.start()
    try:
        assert ready.wait(30)
        (tmp_path / kernels_pkg.TORCH_LOCK).write_text("")  # the live build's
        monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
        monkeypatch.setattr(cpp_extension, "load", lambda **kw: "module")
        result = []
        t = threading.Thread(target=lambda: result.append(kernels_pkg._build()))
        t.start()
        t.join(1.0)
        assert t.is_alive() and (tmp_path / kernels_pkg.TORCH_LOCK).exists()  # waiting, lock untouched
        release.set()
        t.join(30)
        assert result == ["module"]
    finally:
        release.set()
        holder.join(30)
    assert "waiting for another process building" in capsys.readouterr().err


def test_two_checkouts_get_a_build_each(monkeypatch, tmp_path):
    """The build name depends on where the sources live, not only on what they say."""
    here = kernels_pkg._build_name()
    moved = tmp_path / "ernie5" / "kernels"
    moved.mkdir(parents=True)
    for src in kernels_pkg._SOURCES + kernels_pkg._HEADERS:
        (moved / src.name).write_bytes(src.read_bytes())
    monkeypatch.setattr(kernels_pkg, "__file__", str(moved / "__init__.py"))
    monkeypatch.setattr(kernels_pkg, "_SOURCES", [moved / p.name for p in kernels_pkg._SOURCES])
    monkeypatch.setattr(kernels_pkg, "_HEADERS", [moved / p.name for p in kernels_pkg._HEADERS])
    assert kernels_pkg._build_name() != here


@pytest.mark.skipif(__import__("shutil").which("c++") is None, reason="no C++ compiler")
def test_a_failed_build_is_not_retried_by_every_process(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    calls = []

    def broken(**kw):
        calls.append(kw["name"])
        raise RuntimeError("Error building extension: Python.h: No such file or directory")

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.raises(RuntimeError, match="Python.h"):
        kernels_pkg._build()
    assert (tmp_path / kernels_pkg.FAILED_MARKER).exists()
    with pytest.raises(RuntimeError, match="an earlier build failed .*Python.h.* to retry"):
        kernels_pkg._build()
    assert len(calls) == 1


needs_router_kernel = pytest.mark.skipif(
    kernels() is None or not kernels().router_linear_available(), reason="the router kernel needs AVX-512F"
)


def _top2_grad(n: int, e: int) -> torch.Tensor:
    """A logit gradient as the router's top-k backward leaves it: two nonzero entries per row."""
    ids = torch.stack([torch.randperm(e)[:2] for _ in range(n)])
    return torch.zeros(n, e).scatter_(1, ids, torch.randn(n, 2))


@needs_router_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,d,e", [(2048, 256, 64), (7, 64, 16), (5, 128, 128), (33, 192, 48)])
@pytest.mark.parametrize("grad", ["dense", "top2"])
def test_router_logits_match_fp32_linear(dtype, n, d, e, grad):
    """The fused router logits are ``F.linear(x.float(), w.float())`` with the same gradients, from a
    dense logit gradient and from a top-2-sparse one (the sparse backward pass)."""
    torch.manual_seed(0)
    x = torch.randn(n, d).to(dtype).requires_grad_()
    w = (torch.randn(e, d) * 0.05).to(dtype).requires_grad_()
    assert ops.router_fusable(x, w)
    g = torch.randn(n, e) if grad == "dense" else _top2_grad(n, e)
    out, grads = _grads(lambda x, w: (ops.router_logits(x, w),), [x, w], [g])
    ref, ref_grads = _grads(lambda x, w: (F.linear(x.float(), w.float()),), [x, w], [g])
    assert out[0].dtype == torch.float32
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)  # fp32 sums in another order
    for a, r in zip(grads, ref_grads):
        assert a.dtype == dtype
        scale = r.float().abs().max()
        tol = 8e-3 if dtype == torch.bfloat16 else 1e-5  # one bf16 rounding step either way
        torch.testing.assert_close(a.float() / scale, r.float() / scale, atol=tol, rtol=0)


@needs_router_kernel
@pytest.mark.parametrize("grad", ["dense", "top2"])
def test_router_logits_do_not_depend_on_the_thread_count(grad):
    torch.manual_seed(0)
    x = torch.randn(300, 256).to(torch.bfloat16)
    w = (torch.randn(64, 256) * 0.05).to(torch.bfloat16)
    g = torch.randn(300, 64) if grad == "dense" else _top2_grad(300, 64)
    k, threads = kernels(), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [k.router_logits_fwd(x, w), *k.router_logits_bwd(g, x, w)]
        torch.set_num_threads(2)
        two = [k.router_logits_fwd(x, w), *k.router_logits_bwd(g, x, w)]
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_router_falls_back_where_the_kernel_does_not_fit():
    x = torch.randn(4, 64)
    assert not ops.router_fusable(x, torch.randn(8, 64))  # 8 experts: not a multiple of 16
    assert not ops.router_fusable(x, torch.randn(16, 64, dtype=torch.bfloat16))  # mixed dtypes


def test_the_packaged_ninja_comes_first_on_path_activated_or_not(monkeypatch):
    """The ninja wheel's folder goes first on PATH whatever PATH held (a system ninja 1.11 and the
    wheel's 1.13 hash their build logs differently, so alternating them rebuilt everything), and
    only once."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", ninja.BIN_DIR, "/bin"]))
    kernels_pkg._prefer_package_ninja()
    assert os.environ["PATH"].split(os.pathsep) == [ninja.BIN_DIR, "/usr/bin", ninja.BIN_DIR, "/bin"]
    kernels_pkg._prefer_package_ninja()
    assert os.environ["PATH"].split(os.pathsep)[:2] == [ninja.BIN_DIR, "/usr/bin"]
