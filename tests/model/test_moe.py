"""MoE: fast dispatch == naive loop (outputs and gradients), routing semantics, aux-free balancing."""

from __future__ import annotations

import inspect

import pytest
import torch

from ernie5.model.config import MoEConfig
from ernie5.model.moe import (
    MAX_LEVELS,
    MoE,
    _round_rows,
    plan_dispatch,
    plan_levels,
    route,
    update_router_bias,
)


def _layer(dtype=torch.float32, **kw):
    cfg = MoEConfig(**{"n_experts": 8, "d_expert": 16, "top_k": 2, **kw})
    layer = MoE(32, cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return layer.to(dtype)


def _run(layer, x, dispatch, mask=None, top_k=None):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y, r = layer(x, top_k=top_k, expert_mask_E=mask, dispatch=dispatch)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in layer.named_parameters()}
    return y.detach().float(), x.grad.float(), grads, r


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_sorted_dispatch_matches_loop_fp32(score_func, shared, tokens):
    torch.manual_seed(tokens)
    layer = _layer(score_func=score_func, n_shared_experts=shared)
    x = torch.randn(1, tokens, 32)
    ref = _run(layer, x, "loop")
    got = _run(layer, x, "sorted")
    assert torch.allclose(ref[0], got[0], atol=1e-5)
    assert torch.allclose(ref[1], got[1], atol=1e-5)
    for name in ref[2]:
        assert torch.allclose(ref[2][name], got[2][name], atol=1e-5), name


def test_sorted_dispatch_matches_loop_bf16():
    layer = _layer(torch.bfloat16)
    x = torch.randn(2, 50, 32, dtype=torch.bfloat16)
    ref, got = _run(layer, x, "loop"), _run(layer, x, "sorted")
    assert torch.allclose(ref[0], got[0], atol=2e-2, rtol=2e-2)
    for name in ref[2]:
        assert torch.allclose(ref[2][name], got[2][name], atol=5e-2, rtol=5e-2), name


def test_sorted_dispatch_under_autocast_matches_loop():
    layer = _layer()
    x = torch.randn(1, 40, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _run(layer, x, "loop")
        got = _run(layer, x, "sorted")
    assert torch.allclose(ref[0], got[0], atol=3e-2, rtol=3e-2)
    assert got[2]["w13"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_grouped_dispatch_matches_loop(dtype, shared, tokens):
    """The grouped-GEMM path (ragged groups, empty ones included) against the reference loop."""
    torch.manual_seed(tokens)
    layer = _layer(dtype, n_shared_experts=shared)
    x = torch.randn(1, tokens, 32, dtype=dtype)
    ref, got = _run(layer, x, "loop"), _run(layer, x, "grouped")
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.equal(ref[3].counts_E, got[3].counts_E)
    assert torch.allclose(ref[0], got[0], atol=tol, rtol=tol)
    assert torch.allclose(ref[1], got[1], atol=tol, rtol=tol)
    for name in ref[2]:
        assert torch.allclose(ref[2][name], got[2][name], atol=2 * tol, rtol=2 * tol), name


def test_grouped_dispatch_matches_loop_with_mask_skew_and_top_k():
    torch.manual_seed(7)
    layer = _layer(n_experts=16)
    with torch.no_grad():
        layer.router_bias[:] = torch.linspace(4.0, 0, 16)  # a few hot experts, several idle ones
    mask = torch.zeros(16, dtype=torch.bool)
    mask[::2] = True
    x = torch.randn(1, 300, 32)
    for kw in ({}, {"mask": mask}, {"top_k": 1}, {"top_k": 3, "mask": mask}):
        _assert_same(_run(layer, x, "loop", **kw), _run(layer, x, "grouped", **kw))


def test_grouped_dispatch_under_autocast_keeps_fp32_gradients():
    layer = _layer()
    x = torch.randn(1, 40, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = _run(layer, x, "loop"), _run(layer, x, "grouped")
    assert torch.allclose(ref[0], got[0], atol=3e-2, rtol=3e-2)
    assert got[2]["w13"].dtype == torch.float32


def test_gather_path_matches_loop_at_inference():
    layer = _layer()
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        a, _ = layer(x, dispatch="loop")
        b, _ = layer(x, dispatch="gather")
        c, _ = layer(x)  # auto picks gather for a few pairs without grad
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(a, c, atol=1e-6)


def _assert_same(ref, got, atol=1e-5):
    assert torch.allclose(ref[0], got[0], atol=atol) and torch.allclose(ref[1], got[1], atol=atol)
    for name in ref[2]:
        assert torch.allclose(ref[2][name], got[2][name], atol=atol), name


def test_plan_covers_every_row_with_nested_quantised_levels():
    g = torch.Generator().manual_seed(0)
    for skew in (0.0, 1.0, 3.0):
        p = torch.softmax(torch.randn(64, generator=g) * skew, 0)
        counts = torch.multinomial(p, 4096, replacement=True, generator=g).bincount(minlength=64).tolist()
        plan = plan_levels(counts)
        assert 1 <= len(plan) <= MAX_LEVELS
        bounds = [0] + [hi for hi, _ in plan]
        assert bounds == sorted(set(bounds)) and bounds[-1] >= max(counts)
        for lo, hi in zip(bounds, bounds[1:]):
            assert hi - lo == _round_rows(hi - lo)  # shapes recur across steps
    assert plan_levels([0, 0, 0]) == []
    assert plan_levels([3, 5, 2, 1]) == [(5, True)]  # small counts stay exact
    # A balanced layer is one level over the whole expert tensor; a hot expert gets its own level.
    assert len(plan_levels([64] * 64)) == 1
    assert len(plan_levels([600] + [56] * 63)) >= 2
    # Half the experts idle (a width-0.5 subnet): gathering the busy half beats padding the idle.
    assert plan_levels([0] * 32 + [60] * 32) == [(64, False)]


def test_overflow_levels_match_loop():
    layer = _layer(n_experts=32)
    torch.manual_seed(3)
    x = torch.randn(1, 600, 32)
    with torch.no_grad():
        layer.router_bias[0] = 10.0  # send every token to expert 0 (plus one other)
    r = route(x[0], layer.router.weight, layer.router_bias, layer.cfg, 2, None, 600)
    levels = plan_dispatch(r, 600).levels
    assert len(levels) >= 2 and levels[-1].experts is not None  # the hot expert runs alone
    _assert_same(_run(layer, x, "loop"), _run(layer, x, "sorted"))


@pytest.mark.parametrize("skew", [0.5, 2.0, 4.0])
def test_skewed_routing_three_levels_and_padding_experts_are_inert(skew):
    """Padding slots and padding experts of subset levels change nothing, however skewed the load."""
    torch.manual_seed(5)
    layer = _layer(n_experts=16)
    with torch.no_grad():
        layer.router_bias[:] = torch.linspace(skew, 0, 16)
    x = torch.randn(1, 400, 32)
    r = route(x[0], layer.router.weight, layer.router_bias, layer.cfg, 2, None, 400)
    levels = plan_dispatch(r, 400).levels
    for lv in levels:
        assert lv.cap == _round_rows(lv.cap)
        if lv.experts is not None:
            assert lv.experts.numel() % 4 == 0 or lv.experts.numel() == 16
            assert lv.experts.unique().numel() == lv.experts.numel()
    _assert_same(_run(layer, x, "loop"), _run(layer, x, "sorted"))


def test_masked_width_subnet_matches_loop():
    torch.manual_seed(6)
    layer = _layer(n_experts=16)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[::2] = True
    x = torch.randn(1, 300, 32)
    _assert_same(_run(layer, x, "loop", mask=mask), _run(layer, x, "sorted", mask=mask))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_masked_experts_are_never_selected_and_gates_renormalise(score_func):
    layer = _layer(score_func=score_func)
    x = torch.randn(1, 100, 32)
    mask = torch.tensor([True, False, True, False, True, True, False, False])
    with torch.no_grad():
        _, r = layer(x, expert_mask_E=mask, top_k=1)
    assert set(r.expert_ids_NA.unique().tolist()) <= {0, 2, 4, 5}
    assert r.counts_E[~mask].sum() == 0
    assert torch.allclose(r.gates_NA.sum(-1), torch.ones(100))


def test_bias_is_selection_only():
    layer = _layer()
    x = torch.randn(1, 30, 32)
    with torch.no_grad():
        _, r0 = layer(x)
        layer.router_bias[:] = torch.linspace(-1, 1, 8)
        _, r1 = layer(x)
    assert not torch.equal(r0.expert_ids_NA, r1.expert_ids_NA)
    logits = (x[0] @ layer.router.weight.T).softmax(-1)
    expected = logits.gather(-1, r1.expert_ids_NA)
    assert torch.allclose(r1.gates_NA, expected / expected.sum(-1, keepdim=True), atol=1e-6)


def test_router_sees_no_modality():
    params = inspect.signature(MoE.forward).parameters
    assert not any("modal" in p for p in params)
    assert not any("modal" in p for p in inspect.signature(route).parameters)


def test_aux_free_bias_moves_load_toward_balance():
    torch.manual_seed(0)
    layer = _layer(n_experts=8, top_k=2)
    x = torch.randn(1, 512, 32) + 0.5
    with torch.no_grad():
        layer.router.weight[0] = 0.1  # expert 0 wins for most tokens at the start

    def imbalance():
        with torch.no_grad():
            _, r = layer(x)
        c = r.counts_E.float()
        return float(c.max() / c.mean()), r.counts_E

    start, _ = imbalance()
    for _ in range(300):
        _, counts = imbalance()
        update_router_bias(layer, counts, 0.01, torch.ones(8, dtype=torch.bool))
    end, _ = imbalance()
    assert start > 2.0 and end < 1.3, (start, end)


def test_masked_experts_do_not_count_in_bias_update():
    layer = _layer()
    counts = torch.tensor([10, 0, 30, 0, 20, 20, 0, 0])
    avail = counts > 0
    update_router_bias(layer, counts, 0.1, avail)
    b = layer.router_bias
    assert torch.equal(b[~avail], torch.zeros(4))  # masked experts do not move
    assert b[0] > 0 and b[2] < 0 and b[4] == 0  # mean over the available experts is 20


def test_aux_and_z_losses_have_gradients():
    layer = _layer(aux_loss_coef=1e-2, z_loss_coef=1e-3)
    x = torch.randn(2, 16, 32)
    _, r = layer(x)
    assert r.aux_loss is not None and r.z_loss is not None
    (r.aux_loss + r.z_loss).backward()
    assert layer.router.weight.grad.abs().sum() > 0
