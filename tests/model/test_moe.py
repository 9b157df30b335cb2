"""MoE maths (the eager layer): routing, the reference expert loop, aux-free balancing.

The fast expert paths and the fused router are tested against this layer in
``tests/fast/test_moe.py``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from ernie5.model.config import MoEConfig
from ernie5.model.moe import (
    MoE,
    RouterOutput,
    experts_loop,
    router_logits,
    select_experts,
    swiglu,
    update_router_bias,
)


def _layer(dtype=torch.float32, **kw):
    cfg = MoEConfig(**{"n_experts": 8, "d_expert": 16, "top_k": 2, **kw})
    layer = MoE(32, cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return layer.to(dtype)


@pytest.mark.parametrize("shared", [0, 1])
def test_forward_is_the_gated_sum_of_each_tokens_experts_plus_shared(shared):
    """The reference loop, token by token: ``y_i = sum_a gate_ia * SwiGLU_{e_ia}(x_i) (+ shared(x_i))``."""
    torch.manual_seed(1)
    layer = _layer(n_shared_experts=shared)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        y, r = layer(x)
        x_ND = x.reshape(-1, 32)
        for i in range(x_ND.shape[0]):
            want = sum(
                r.gates_NA[i, a] * swiglu(x_ND[i : i + 1], layer.w13[e], layer.w2[e])[0]
                for a, e in enumerate(r.expert_ids_NA[i].tolist())
            )
            if shared:
                want = want + layer.shared(x_ND[i])
            torch.testing.assert_close(y.reshape(-1, 32)[i], want, atol=1e-6, rtol=1e-5)
    assert r.expert_ids_NA.shape == (18, 2) and int(r.counts_E.sum()) == 18 * 2
    assert torch.equal(r.counts_E, torch.bincount(r.expert_ids_NA.flatten(), minlength=8))


def test_experts_loop_skips_idle_experts_and_gives_unrouted_tokens_zero():
    w13, w2 = torch.randn(4, 8, 6), torch.randn(4, 6, 4)
    x = torch.randn(3, 6)
    ids = torch.tensor([[2], [2], [0]])
    gates = torch.tensor([[0.5], [0.0], [1.0]])
    counts = torch.bincount(ids.flatten(), minlength=4)
    y = experts_loop(x, w13, w2, RouterOutput(ids, gates, counts))
    torch.testing.assert_close(y[0], 0.5 * swiglu(x[:1], w13[2], w2[2])[0])
    assert torch.equal(y[1], torch.zeros(6))  # a zero gate adds nothing
    torch.testing.assert_close(y[2], swiglu(x[2:], w13[0], w2[0])[0])
    w13[[1, 3]] = float("nan")  # idle experts are never read
    assert torch.isfinite(experts_loop(x, w13, w2, RouterOutput(ids, gates, counts))).all()


def test_router_logits_are_fp32_under_autocast():
    x, w = torch.randn(5, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(x.float(), w.float()))


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
    for fn in (MoE.route, router_logits, select_experts):
        assert not any("modal" in p for p in inspect.signature(fn).parameters), fn.__name__


def test_aux_free_bias_moves_load_toward_balance():
    torch.manual_seed(0)
    layer = _layer(n_experts=8, top_k=2)
    x = torch.randn(1, 512, 32) + 0.5
    with torch.no_grad():
        layer.router.weight[0] = 0.1  # expert 0 wins for most tokens at the start

    def imbalance(forward=False):
        with torch.no_grad():  # the loads the forward returns are its routing's (steps 1-3, 5)
            r = layer(x)[1] if forward else layer.route(x[0], 2, None, 512)
        c = r.counts_E.float()
        return float(c.max() / c.mean()), r.counts_E

    start, _ = imbalance(forward=True)
    for _ in range(300):
        _, counts = imbalance()
        update_router_bias(layer, counts, 0.01, torch.ones(8, dtype=torch.bool))
    end, _ = imbalance(forward=True)
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
