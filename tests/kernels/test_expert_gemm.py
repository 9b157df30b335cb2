"""The padding-skipping expert GEMMs (cpu_expert_gemm.cpp) against torch.bmm, and their use by the MoE."""

from __future__ import annotations

import pytest
import torch

from ernie5.fast import GradSquares, apply_fast_paths
from ernie5.fast.moe_levels import _round_rows, plan_dispatch
from ernie5.kernels import kernels, ops
from ernie5.model.config import MoEConfig
from ernie5.model.moe import MoE, RouterOutput

needs_expert_gemm = pytest.mark.skipif(
    kernels() is None or not kernels().expert_gemm_available(),
    reason="the expert GEMM kernels need an AVX512-BF16 build",
)
bf16 = torch.bfloat16


def _operands(n_exp, d, f, cap, counts, seed=0):
    """bf16 operands of the six products, zero in every pad slot (as the gathers leave them)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(bf16)

    x, dy = rnd(n_exp, cap, d), rnd(n_exp, cap, d)
    act, dh = rnd(n_exp, f, cap), rnd(n_exp, 2 * f, cap)
    for e, c in enumerate(counts):
        x[e, c:], dy[e, c:], act[e, :, c:], dh[e, :, c:] = 0, 0, 0, 0
    return dict(w13=rnd(n_exp, 2 * f, d), w2=rnd(n_exp, d, f), x=x, dy=dy, g=act, dh=dh)


def _products(o):
    """name -> (kernel call, the torch.bmm it replaces); the weight-gradient products also return a
    sum of squares, dropped here."""
    return {
        "up": (
            lambda n: kernels().expert_up(o["w13"], o["x"], n),
            lambda: torch.bmm(o["w13"], o["x"].transpose(1, 2)),
        ),
        "down": (  # token rows: the transpose of the bmm
            lambda n: kernels().expert_down(o["w2"], o["g"], n),
            lambda: torch.bmm(o["w2"], o["g"]).transpose(1, 2),
        ),
        "down_dx": (
            lambda n: kernels().expert_down_dx(o["w2"], o["dy"], n),
            lambda: torch.bmm(o["w2"].transpose(1, 2), o["dy"].transpose(1, 2)),
        ),
        "down_dw": (
            lambda n: kernels().expert_down_dw(o["dy"], o["g"], n)[0],
            lambda: torch.bmm(o["dy"].transpose(1, 2), o["g"].transpose(1, 2)),
        ),
        "up_dx": (
            lambda n: kernels().expert_up_dx(o["dh"], o["w13"], n),
            lambda: torch.bmm(o["dh"].transpose(1, 2), o["w13"]),
        ),
        "up_dw": (
            lambda n: kernels().expert_up_dw(o["dh"], o["x"], n)[0],
            lambda: torch.bmm(o["dh"], o["x"]),
        ),
    }


@needs_expert_gemm
@pytest.mark.parametrize(
    "n_exp,d,f,cap,counts",
    [
        (3, 32, 16, 7, [7, 0, 3]),  # odd cap: rows of the token operand are not dword-aligned
        (4, 64, 32, 40, [40, 17, 1, 33]),  # odd counts, a single row, a full expert
        (5, 256, 256, 112, [112, 96, 65, 0, 3]),  # nano widths: 16x16 transposes and every column chunking
        (2, 48, 48, 80, [80, 79]),  # widths that are not a multiple of the 4-vector chunk
    ],
)
def test_expert_gemms_match_bmm(n_exp, d, f, cap, counts):
    """Each product equals its bmm over the zero-padded operands (fp32 accumulation, one rounding),
    pad slots of the outputs included, which are zero."""
    o = _operands(n_exp, d, f, cap, counts)
    n = torch.tensor(counts, dtype=torch.long)
    for name, (ours, ref) in _products(o).items():
        got, want = ours(n), ref()
        assert got.shape == want.shape and got.dtype == bf16, name
        torch.testing.assert_close(
            got.float(), want.float(), atol=1e-2 * want.abs().max().item(), rtol=1e-2, msg=name
        )
        for e, c in enumerate(counts):  # the pad slots hold exact zeros
            if name in ("up", "down_dx"):
                assert not got[e, :, c:].any(), name
            elif name in ("down", "up_dx"):
                assert not got[e, c:].any(), name
        if name in ("down_dw", "up_dw"):
            assert not got[[e for e, c in enumerate(counts) if c == 0]].any(), name  # no rows, no gradient


@needs_expert_gemm
@pytest.mark.parametrize(
    "n_exp,d,f,cap,counts",
    [
        (3, 32, 16, 7, [7, 0, 3]),
        (5, 256, 256, 112, [112, 96, 65, 0, 3]),
        (2, 48, 48, 80, [80, 79]),
    ],
)
def test_whole_expert_passes_equal_the_separate_kernels(n_exp, d, f, cap, counts):
    """expert_ffn_fwd = gather, up, activation, down; expert_ffn_bwd = gathers, down_dx, the
    activation's backward, down_dw, up_dw, up_dx: the same outputs bit for bit (pad slots
    included), the same sums of squares and the same gate gradient. Token rows are read in place
    through the slot -> token index (in scrambled order, some tokens twice, pad slots pointing past
    the rows as the dispatch leaves them)."""
    o = _operands(n_exp, d, f, cap, counts, seed=5)
    k, n = kernels(), torch.tensor(counts, dtype=torch.long)
    gen = torch.Generator().manual_seed(6)
    gate = torch.rand(n_exp, cap, generator=gen).to(bf16)
    n_tok = max(sum(counts), 1) + 3
    x_ND = torch.randn(n_tok, d, generator=gen).to(bf16)
    dy_ND = torch.randn(n_tok, d, generator=gen).to(bf16)
    tok = torch.full((n_exp, cap), n_tok, dtype=torch.long)  # pad slots: the zero row past the end
    for e, c in enumerate(counts):
        tok[e, :c] = torch.randint(0, n_tok, (c,), generator=gen)
    tok = tok.view(-1)
    x = torch.cat([x_ND, x_ND.new_zeros(1, d)])[tok].view(n_exp, cap, d)  # what gather_rows gives
    dy = torch.cat([dy_ND, dy_ND.new_zeros(1, d)])[tok].view(n_exp, cap, d)

    h = k.expert_up(o["w13"], x, n)
    g = k.swiglu_gate_fwd(h, gate.view(n_exp, 1, cap), n)
    want_fwd = (h, g, k.expert_down(o["w2"], g, n))
    got_fwd = k.expert_ffn_fwd(o["w13"], o["w2"], x_ND, tok, gate, n)
    for name, a, b in zip(("h", "g", "y"), want_fwd, got_fwd):
        assert torch.equal(a, b), name

    d_g = k.expert_down_dx(o["w2"], dy, n)
    d_h, d_gate = k.swiglu_gate_bwd(d_g, h, gate.view(n_exp, 1, cap), n)
    dw2, sq2 = k.expert_down_dw(dy, g, n)
    dw13, sq13 = k.expert_up_dw(d_h, x, n)
    want_bwd = (k.expert_up_dx(d_h, o["w13"], n), dw13, sq13, dw2, sq2, d_gate)
    got_bwd = k.expert_ffn_bwd(o["w13"], o["w2"], x_ND, tok, h, g, gate, dy_ND, n)
    for name, a, b in zip(("dx", "dw13", "sq13", "dw2", "sq2", "d_gate"), want_bwd, got_bwd):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, name


@needs_expert_gemm
def test_whole_expert_passes_reject_mismatched_operands():
    o = _operands(2, 32, 16, 8, [8, 3])
    n, gate = torch.tensor([8, 3]), torch.ones(2, 8, dtype=bf16)
    x, tok = torch.randn(11, 32).to(bf16), torch.arange(16) % 11
    with pytest.raises(RuntimeError, match="gate \\[2, 7\\] and token index of 16 slots"):
        kernels().expert_ffn_fwd(o["w13"], o["w2"], x, tok, gate[:, :7].contiguous(), n)
    with pytest.raises(RuntimeError, match="expert_ffn_fwd: shapes"):
        kernels().expert_ffn_fwd(o["w13"], o["w2"][:, :16].contiguous(), x, tok, gate, n)
    bad = tok.clone()
    bad[9] = 11  # a valid slot of expert 1 (3 valid) naming a row past x
    with pytest.raises(RuntimeError, match="token index 11 outside \\[0, 11\\)"):
        kernels().expert_ffn_fwd(o["w13"], o["w2"], x, bad, gate, n)
    bad[9], bad[12] = 0, 11  # a pad slot may point anywhere: it is not read
    h, g, _ = kernels().expert_ffn_fwd(o["w13"], o["w2"], x, bad, gate, n)
    with pytest.raises(RuntimeError, match="expert_ffn_bwd: shapes"):
        kernels().expert_ffn_bwd(o["w13"], o["w2"], x, tok, h, g[:, :8].contiguous(), gate, x, n)


@needs_expert_gemm
def test_expert_gemm_rejects_bad_counts():
    o = _operands(2, 32, 16, 8, [8, 8])
    with pytest.raises(RuntimeError, match="valid count 9 outside"):
        kernels().expert_up(o["w13"], o["x"], torch.tensor([9, 1]))
    with pytest.raises(RuntimeError, match="one int64 count per expert"):
        kernels().expert_up(o["w13"], o["x"], torch.tensor([1, 2, 3]))
    with pytest.raises(RuntimeError, match="dtype"):
        kernels().expert_up(o["w13"].float(), o["x"], torch.tensor([1, 1]))


@needs_expert_gemm
def test_skip_padding_plan_is_one_level_with_row_counts():
    torch.manual_seed(0)
    n, e = 300, 16
    probs = torch.softmax(torch.randn(e) * 2.0, 0)
    ids = torch.stack([torch.multinomial(probs, 2) for _ in range(n)])
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    r = RouterOutput(ids, torch.rand(n, 2), counts, None, None)
    plan = plan_dispatch(r, n, skip_padding=True)
    assert len(plan.levels) == 1
    (lv,) = plan.levels
    assert lv.experts is None and lv.cap == _round_rows(int(counts.max()))
    assert torch.equal(lv.valid_E, counts)
    assert plan_dispatch(r, n).levels[0].valid_E is None  # the bmm path keeps its levels


@needs_expert_gemm
def test_moe_layer_takes_the_expert_gemms_and_matches_the_loop():
    """A bf16 layer at widths the kernels take routes through them (one level, row counts) and
    gives the naive loop's outputs and gradients, with skewed loads (many tails)."""
    torch.manual_seed(2)
    cfg = MoEConfig(n_experts=16, d_expert=32, top_k=2)
    layer = MoE(64, cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    squares = GradSquares()
    layer = apply_fast_paths(layer.to(bf16), grad_squares=squares)
    with torch.no_grad():
        layer.router_bias[:] = torch.linspace(1.5, 0, 16)
    x = torch.randn(1, 200, 64, dtype=bf16)
    assert ops.expert_gemm_fusable(x[0], layer.w13, layer.w2)

    def run(path):
        layer.path = path
        layer.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        y, _ = layer(xi)
        (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return [y.float(), xi.grad.float()] + [p.grad.float() for p in layer.parameters()]

    ref, got = run("loop"), run("sorted")
    for p in (layer.w13, layer.w2):  # the sorted path's backward recorded its weight gradients' squares
        assert squares.take(p, p.grad) == pytest.approx(p.grad.double().square().sum().item(), rel=1e-5)
    for a, b in zip(ref[:2], got[:2]):  # outputs, input gradient
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    for a, b in zip(ref[2:], got[2:]):  # weight gradients: sums of 2-60 bf16 products, rounded differently
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


@needs_expert_gemm
def test_weight_gradient_products_sum_their_squares_deterministically():
    counts = [112, 96, 65, 0, 3]
    o = _operands(5, 256, 256, 112, counts, seed=3)
    n = torch.tensor(counts, dtype=torch.long)
    for name, call in (
        ("down_dw", lambda: kernels().expert_down_dw(o["dy"], o["g"], n)),
        ("up_dw", lambda: kernels().expert_up_dw(o["dh"], o["x"], n)),
    ):
        dw, sumsq = call()
        assert sumsq == pytest.approx(dw.double().square().sum().item(), rel=1e-6), name
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert call()[1] == sumsq, name  # the same sum whichever thread took which expert
        finally:
            torch.set_num_threads(threads)


def test_recorded_sum_of_squares_is_used_only_for_the_unchanged_gradient():
    squares = GradSquares()
    w, g = torch.zeros(4), torch.ones(4)
    squares.record(w, g, 4.0)
    assert squares.take(w, g.clone()) is None  # another tensor
    assert squares.take(w, g) is None  # entries are consumed
    squares.record(w, g, 4.0)
    g.mul_(2)  # changed in place since (e.g. accumulated into)
    assert squares.take(w, g) is None
    squares.record(w, g, 16.0)
    assert squares.take(w, g) == 16.0
    squares.record(w, g, 16.0)
    squares.clear()
    assert squares.take(w, g) is None
