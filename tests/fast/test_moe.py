"""Fast MoE (:mod:`ernie5.fast.moe`, :mod:`ernie5.fast.moe_levels`): every expert path and the fused
router against the eager layer, whose experts are the reference loop (outputs and gradients);
the padded-level plans; autocast handling.

A path is forced on a deep copy of an eager layer (``apply_fast_paths(copy, moe_path=...)``), so
both hold the same parameters and buffers.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ernie5.fast import apply_fast_paths
from ernie5.fast.moe import GATHER_MAX_PAIRS, FastMoE
from ernie5.fast.moe_levels import MAX_LEVELS, _round_rows, plan_dispatch, plan_levels
from ernie5.model.config import MoEConfig
from ernie5.model.moe import MoE


def _layer(dtype=torch.float32, d_model=32, **kw):
    cfg = MoEConfig(**{"n_experts": 8, "d_expert": 16, "top_k": 2, **kw})
    layer = MoE(d_model, cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return layer.to(dtype)


def _fast(layer: MoE, path: str) -> FastMoE:
    """A copy of the eager ``layer`` with its fast forward, on the expert path ``path``."""
    fast = apply_fast_paths(copy.deepcopy(layer), moe_path=path)
    assert isinstance(fast, FastMoE) and fast.path == path
    return fast


def _run(layer, x, mask=None, top_k=None):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y, r = layer(x, top_k=top_k, expert_mask_E=mask)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in layer.named_parameters()}
    return y.detach().float(), x.grad.float(), grads, r


def _assert_same(ref, got, atol=1e-5):
    assert torch.allclose(ref[0], got[0], atol=atol) and torch.allclose(ref[1], got[1], atol=atol)
    for name in ref[2]:
        assert torch.allclose(ref[2][name], got[2][name], atol=atol), name


def test_paths_are_forced_on_a_copy_and_the_state_dict_is_unchanged():
    layer = _layer()
    fast = _fast(layer, "sorted")
    assert type(layer) is MoE  # the eager reference stays eager
    assert fast.state_dict().keys() == layer.state_dict().keys()
    assert all(torch.equal(fast.state_dict()[k], v) for k, v in layer.state_dict().items())
    fast.path = "grouped"  # a FastMoE's path is an attribute
    assert fast.expert_path(torch.zeros(64, 32), 2, torch.float32) == "grouped"
    with pytest.raises(ValueError, match="moe_path"):
        apply_fast_paths(copy.deepcopy(layer), moe_path="fastest")


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_sorted_dispatch_matches_loop_fp32(score_func, shared, tokens):
    torch.manual_seed(tokens)
    layer = _layer(score_func=score_func, n_shared_experts=shared)
    x = torch.randn(1, tokens, 32)
    ref = _run(layer, x)
    got = _run(_fast(layer, "sorted"), x)
    assert torch.allclose(ref[0], got[0], atol=1e-5)
    assert torch.allclose(ref[1], got[1], atol=1e-5)
    for name in ref[2]:
        assert torch.allclose(ref[2][name], got[2][name], atol=1e-5), name


def test_sorted_dispatch_matches_loop_bf16():
    layer = _layer(torch.bfloat16)
    x = torch.randn(2, 50, 32, dtype=torch.bfloat16)
    ref, got = _run(layer, x), _run(_fast(layer, "sorted"), x)
    assert torch.allclose(ref[0], got[0], atol=2e-2, rtol=2e-2)
    for name in ref[2]:
        assert torch.allclose(ref[2][name], got[2][name], atol=5e-2, rtol=5e-2), name


def test_sorted_dispatch_under_autocast_matches_loop():
    layer = _layer()
    fast = _fast(layer, "sorted")
    x = torch.randn(1, 40, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _run(layer, x)
        got = _run(fast, x)
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
    ref, got = _run(layer, x), _run(_fast(layer, "grouped"), x)
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
    fast = _fast(layer, "grouped")
    mask = torch.zeros(16, dtype=torch.bool)
    mask[::2] = True
    x = torch.randn(1, 300, 32)
    for kw in ({}, {"mask": mask}, {"top_k": 1}, {"top_k": 3, "mask": mask}):
        _assert_same(_run(layer, x, **kw), _run(fast, x, **kw))


def test_grouped_dispatch_under_autocast_keeps_fp32_gradients():
    layer = _layer()
    fast = _fast(layer, "grouped")
    x = torch.randn(1, 40, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = _run(layer, x), _run(fast, x)
    assert torch.allclose(ref[0], got[0], atol=3e-2, rtol=3e-2)
    assert got[2]["w13"].dtype == torch.float32


def test_gather_path_matches_loop_at_inference():
    layer = _layer()
    gather, auto = _fast(layer, "gather"), _fast(layer, "auto")
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        assert 3 * layer.cfg.top_k <= GATHER_MAX_PAIRS
        assert auto.expert_path(x[0], layer.cfg.top_k, x.dtype) == "gather"
        a, _ = layer(x)
        b, _ = gather(x)
        c, _ = auto(x)  # auto picks gather for a few pairs without grad
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(a, c, atol=1e-6)


def test_auto_path_on_cpu_is_sorted_for_batches_and_gather_only_for_a_few_inference_pairs():
    auto = _fast(_layer(), "auto")
    few, many = torch.zeros(3, 32), torch.zeros(64, 32)
    assert auto.expert_path(few, 2, torch.float32) == "sorted"  # a gradient: no gather
    assert auto.expert_path(many, 2, torch.bfloat16) == "sorted"
    with torch.no_grad():
        assert auto.expert_path(few, 2, torch.float32) == "gather"
        assert auto.expert_path(many, 2, torch.float32) == "sorted"


@pytest.mark.parametrize("path", ["sorted", "grouped", "gather", "loop"])
def test_every_forced_path_matches_the_eager_layer_at_inference(path):
    torch.manual_seed(2)
    layer = _layer(n_shared_experts=1)
    x = torch.randn(2, 20, 32)
    with torch.no_grad():
        ref, r_ref = layer(x)
        got, r = _fast(layer, path)(x)
    assert torch.equal(r.counts_E, r_ref.counts_E)
    assert torch.allclose(ref, got, atol=1e-5)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d_model", [32, 64])  # 64: the fused router logits take it (AVX-512F)
def test_fused_router_routes_as_the_eager_router(score_func, dtype, d_model):
    """The fused router (fp32 logits from the activations' dtype, top-k, gates, counts in one pass)
    decides what the eager router decides: the same experts (in any slot order), gates and counts,
    with the aux-free bias, a subnet's expert mask and a smaller top-k."""
    torch.manual_seed(4)
    layer = _layer(dtype, d_model, n_experts=16, score_func=score_func, route_scale=2.0)
    with torch.no_grad():
        layer.router_bias[:] = torch.linspace(-0.05, 0.05, 16)
    fast = _fast(layer, "auto")
    x = torch.randn(90, d_model, dtype=dtype)
    mask = torch.arange(16) % 3 != 0
    with torch.no_grad():
        for top_k, m in ((2, None), (2, mask), (1, mask)):
            ref, got = layer.route(x, top_k, m, 90), fast.route(x, top_k, m, 90)
            o_ref, o_got = ref.expert_ids_NA.argsort(-1), got.expert_ids_NA.argsort(-1)
            assert torch.equal(ref.expert_ids_NA.gather(-1, o_ref), got.expert_ids_NA.gather(-1, o_got))
            torch.testing.assert_close(got.gates_NA.gather(-1, o_got), ref.gates_NA.gather(-1, o_ref))
            assert torch.equal(ref.counts_E, got.counts_E)
            if m is not None:
                assert got.counts_E[~m].sum() == 0


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_fused_router_never_selects_masked_experts_and_gates_renormalise(score_func):
    fast = _fast(_layer(score_func=score_func), "auto")
    x = torch.randn(1, 100, 32)
    mask = torch.tensor([True, False, True, False, True, True, False, False])
    with torch.no_grad():
        _, r = fast(x, expert_mask_E=mask, top_k=1)
    assert set(r.expert_ids_NA.unique().tolist()) <= {0, 2, 4, 5}
    assert r.counts_E[~mask].sum() == 0
    assert torch.allclose(r.gates_NA.sum(-1), torch.ones(100))


def test_fused_router_routes_like_the_eager_one_under_a_bias():
    """The balancing bias moves the selection of the fused router exactly as the eager router's
    (gates from the unbiased scores; the eager semantics are tested in tests/model/test_moe.py)."""
    layer = _layer()
    fast = _fast(layer, "auto")
    x = torch.randn(30, 32)
    picked = []
    for bias in (torch.zeros(8), torch.linspace(-1, 1, 8)):
        layer.router_bias[:] = bias
        fast.router_bias[:] = bias
        with torch.no_grad():
            r_eager, r_fast = layer.route(x, 2, None, 30), fast.route(x, 2, None, 30)
        ids = r_fast.expert_ids_NA.sort(-1).values
        assert torch.equal(ids, r_eager.expert_ids_NA.sort(-1).values)
        assert torch.allclose(r_fast.gates_NA.sort(-1).values, r_eager.gates_NA.sort(-1).values, atol=1e-6)
        assert torch.equal(r_fast.counts_E, r_eager.counts_E)
        picked.append(ids)
    assert not torch.equal(picked[0], picked[1])  # the bias did move the selection


def test_fast_router_keeps_the_aux_and_z_losses_with_gradients():
    layer = _layer(aux_loss_coef=1e-2, z_loss_coef=1e-3)
    fast = _fast(layer, "sorted")
    x = torch.randn(2, 16, 32)
    _, r_ref = layer(x)
    _, r = fast(x)
    assert r.aux_loss is not None and r.z_loss is not None
    torch.testing.assert_close(r.aux_loss, r_ref.aux_loss)
    torch.testing.assert_close(r.z_loss, r_ref.z_loss)
    (r.aux_loss + r.z_loss).backward()
    assert fast.router.weight.grad.abs().sum() > 0


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
    r = layer.route(x[0], 2, None, 600)
    levels = plan_dispatch(r, 600).levels
    assert len(levels) >= 2 and levels[-1].experts is not None  # the hot expert runs alone
    _assert_same(_run(layer, x), _run(_fast(layer, "sorted"), x))


@pytest.mark.parametrize("skew", [0.5, 2.0, 4.0])
def test_skewed_routing_three_levels_and_padding_experts_are_inert(skew):
    """Padding slots and padding experts of subset levels change nothing, however skewed the load."""
    torch.manual_seed(5)
    layer = _layer(n_experts=16)
    with torch.no_grad():
        layer.router_bias[:] = torch.linspace(skew, 0, 16)
    x = torch.randn(1, 400, 32)
    r = layer.route(x[0], 2, None, 400)
    levels = plan_dispatch(r, 400).levels
    for lv in levels:
        assert lv.cap == _round_rows(lv.cap)
        if lv.experts is not None:
            assert lv.experts.numel() % 4 == 0 or lv.experts.numel() == 16
            assert lv.experts.unique().numel() == lv.experts.numel()
    _assert_same(_run(layer, x), _run(_fast(layer, "sorted"), x))


def test_masked_width_subnet_matches_loop():
    torch.manual_seed(6)
    layer = _layer(n_experts=16)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[::2] = True
    x = torch.randn(1, 300, 32)
    _assert_same(_run(layer, x, mask=mask), _run(_fast(layer, "sorted"), x, mask=mask))
