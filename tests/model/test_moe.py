"""MoE: fast dispatch == naive loop (outputs and gradients), routing semantics, aux-free balancing."""

from __future__ import annotations

import inspect

import pytest
import torch

from ernie5.model.config import MoEConfig
from ernie5.model.moe import MoE, _capacity, plan_dispatch, route, update_router_bias


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


def test_gather_path_matches_loop_at_inference():
    layer = _layer()
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        a, _ = layer(x, dispatch="loop")
        b, _ = layer(x, dispatch="gather")
        c, _ = layer(x)  # auto picks gather for a few pairs without grad
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(a, c, atol=1e-6)


def test_capacity_overflow_level_is_exercised():
    counts = [100, 10, 10, 10, 10, 10, 10, 10]
    cap = _capacity(counts)
    assert cap < 100  # the busy expert overflows into a second, small GEMM
    layer = _layer()
    torch.manual_seed(3)
    x = torch.randn(1, 64, 32)
    with torch.no_grad():
        layer.router_bias[0] = 10.0  # send every token to expert 0 (plus one other)
    r = route(x[0], layer.router.weight, layer.router_bias, layer.cfg, 2, None, 64)
    assert len(plan_dispatch(r, 64)) == 2
    ref, got = _run(layer, x, "loop"), _run(layer, x, "sorted")
    assert torch.allclose(ref[0], got[0], atol=1e-5)
    for name in ref[2]:
        assert torch.allclose(ref[2][name], got[2][name], atol=1e-5), name


def test_padded_shapes_are_quantised_and_padding_experts_are_inert():
    """Row counts above 8 are multiples of 16 and overflow expert counts multiples of 4 (so that
    oneDNN's kernel cache hits); padding slots and padding experts change nothing."""
    assert _capacity([3, 5, 2, 1]) <= 8  # small counts stay exact
    assert _capacity([70, 64, 50, 66]) % 16 == 0
    torch.manual_seed(5)
    layer = _layer(n_experts=16)
    with torch.no_grad():
        layer.router_bias[:3] = 0.05  # three busy experts overflow into a padded second level
    x = torch.randn(1, 200, 32)
    r = route(x[0], layer.router.weight, layer.router_bias, layer.cfg, 2, None, 200)
    levels = plan_dispatch(r, 200)
    assert len(levels) == 2
    for lv in levels:
        assert lv.cap <= 8 or lv.cap % 16 == 0
    assert levels[1].experts.numel() % 4 == 0
    assert levels[1].experts.unique().numel() == levels[1].experts.numel()
    ref, got = _run(layer, x, "loop"), _run(layer, x, "sorted")
    assert torch.allclose(ref[0], got[0], atol=1e-5) and torch.allclose(ref[1], got[1], atol=1e-5)
    for name in ref[2]:
        assert torch.allclose(ref[2][name], got[2][name], atol=1e-5), name


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
