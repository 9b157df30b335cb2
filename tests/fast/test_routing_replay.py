"""Routing replay (R3) through the fast paths: :meth:`FastMoE.route` honours forced expert ids like
the eager router, and :class:`FastBlock` never takes the fused decoding step for a replayed layer."""

from __future__ import annotations

import copy

import pytest
import torch

import ernie5.fast.decode as decode_mod
from ernie5.fast import apply_fast_paths
from ernie5.fast.decode import FastBlock, FastErnie5Model
from ernie5.fast.moe import FastMoE
from ernie5.kernels import kernels
from ernie5.model.config import MoEConfig
from ernie5.model.model import Ernie5Model
from ernie5.model.moe import MoE
from tests.conftest import tiny_config


def _layer(dtype=torch.float32, d_model=32, **kw) -> MoE:
    cfg = MoEConfig(**{"n_experts": 16, "d_expert": 16, "top_k": 2, **kw})
    layer = MoE(d_model, cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return layer.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_fast_route_honours_forced_ids_like_the_eager_router(dtype, score_func):
    torch.manual_seed(4)
    layer = _layer(dtype, d_model=64, score_func=score_func, route_scale=2.0)
    with torch.no_grad():
        layer.router_bias[:] = torch.linspace(-0.05, 0.05, 16)
    fast = apply_fast_paths(copy.deepcopy(layer))
    assert isinstance(fast, FastMoE)
    x = torch.randn(40, 64, dtype=dtype)
    mask = torch.arange(16) % 3 != 0
    avail = torch.nonzero(mask).flatten()
    forced = avail[torch.randint(0, len(avail), (40, 1))]
    forced = torch.cat([forced, avail[(torch.searchsorted(avail, forced) + 1) % len(avail)]], 1)
    forced[::3] = -1
    with torch.no_grad():
        ref, got = layer.route(x, 2, mask, 40, forced), fast.route(x, 2, mask, 40, forced)
    rows = forced[:, 0] >= 0
    assert torch.equal(got.expert_ids_NA[rows], forced[rows])
    assert torch.equal(got.expert_ids_NA, ref.expert_ids_NA)
    torch.testing.assert_close(got.gates_NA, ref.gates_NA)
    assert torch.equal(got.counts_E, ref.counts_E)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_moe_forward_with_replay_equals_eager(dtype):
    torch.manual_seed(5)
    layer = _layer(dtype)
    fast = apply_fast_paths(copy.deepcopy(layer))
    x = torch.randn(2, 3, 32, dtype=dtype)
    forced = torch.tensor([[3, 7], [-1, -1], [0, 15], [9, 2], [4, 5], [-1, -1]]).view(2, 3, 2)
    with torch.no_grad():
        y_ref, r_ref = layer(x, None, None, forced)
        y_got, r_got = fast(x, None, None, forced)
    assert torch.equal(r_got.expert_ids_NA, r_ref.expert_ids_NA)
    tol = {} if dtype == torch.float32 else dict(atol=4e-3, rtol=2e-2)  # bf16 expert-path rounding
    torch.testing.assert_close(y_got, y_ref, **tol)


def test_fast_block_skips_the_fused_step_for_replayed_layers(monkeypatch):
    """Every forward claims to be a fused decoding step; a replayed layer never asks for it."""
    asked: list[int] = []

    def decode_step(self, x_BTD, ctx, layer, top_k, expert_mask_E):
        asked.append(layer)
        return None  # then the module path

    monkeypatch.setattr(FastErnie5Model, "_fused_decode_ok", lambda *a, **k: True)
    monkeypatch.setattr(FastBlock, "_decode_step", decode_step)
    torch.manual_seed(0)
    m = apply_fast_paths(Ernie5Model(tiny_config()).eval())
    cache = m.new_cache(1, 8)
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]), cache=cache)
        asked.clear()
        forced = torch.tensor([[[0, 1]]])
        out = m(torch.tensor([[4]]), cache=cache, routing_replay={2: forced})
    assert sorted(set(asked)) == [0, 1, 3]  # (a declined step is asked again from forward)
    assert torch.equal(out.routing[2].expert_ids_NA, forced.view(1, 2))


needs_rows = pytest.mark.skipif(
    kernels() is None or not kernels().rows_kernels_available(), reason="no AVX-512F kernel build here"
)


@needs_rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replaying_a_fused_steps_ids_reproduces_it(monkeypatch, dtype):
    """A fused decoding step's own ids, replayed into the same step (module path for the replayed
    layers), give the same step."""
    calls = []
    real = kernels()

    class Counting:
        def __call__(self):
            return self

        def __getattr__(self, name):
            return getattr(real, name)

        def decode_layer(self, *args):
            calls.append(1)
            return real.decode_layer(*args)

    monkeypatch.setattr(decode_mod, "kernels", Counting())
    torch.manual_seed(0)
    cfg = tiny_config(d_model=64, n_heads=4, n_kv_heads=2, n_dense_layers=1, qk_norm=True)
    m = apply_fast_paths(Ernie5Model(cfg).eval().to(dtype))
    prompt, step = torch.randint(0, 64, (2, 6)), torch.randint(0, 64, (2, 1))
    outs = []
    for replay in (None, "fill"):
        cache = m.new_cache(2, 8)
        calls.clear()
        with torch.inference_mode():
            m(prompt, cache=cache)
            if replay == "fill":
                replay = {i: r.expert_ids_NA.view(2, 1, -1) for i, r in outs[0].routing.items()}
            n0 = len(calls)
            outs.append(m(step, cache=cache, routing_replay=replay))
            n_step = len(calls) - n0
        expected = cfg.n_layers if replay is None else cfg.n_layers - len(replay)
        assert n_step == expected
    for i, r in outs[0].routing.items():
        assert torch.equal(outs[1].routing[i].expert_ids_NA, r.expert_ids_NA)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1].logits_BTV, outs[0].logits_BTV, atol=tol, rtol=tol)
