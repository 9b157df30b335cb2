"""Fused decoding layers (``Block.forward_fused``, the ``decode_layer`` kernel) against the
module-by-module path they replace: the same kernels in the same order, so equal bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ernie5.model.model as model_mod
from ernie5.kernels import kernels
from ernie5.model.elastic import resolve
from ernie5.model.linear import Linear
from ernie5.model.model import Ernie5Model
from tests.conftest import tiny_config

needs_rows = pytest.mark.skipif(
    kernels() is None or not kernels().rows_kernels_available(), reason="no AVX-512F kernel build here"
)
pytestmark = needs_rows


def _config(**overrides):
    """Head dim 16 (the attention kernel's multiple), a dense first layer, a shared expert."""
    base = dict(d_model=64, n_heads=4, n_kv_heads=2, n_dense_layers=1, qk_norm=True)
    base.update(overrides)
    return tiny_config(**base)


class _Counting:
    """Stands in for ``kernels()`` in the model module, counting ``decode_layer`` calls."""

    def __init__(self):
        self.real, self.calls = kernels(), 0

    def __call__(self):
        return self

    def __getattr__(self, name):
        return getattr(self.real, name)

    def decode_layer(self, *args):
        self.calls += 1
        return self.real.decode_layer(*args)


@pytest.fixture
def counting(monkeypatch):
    c = _Counting()
    monkeypatch.setattr(model_mod, "kernels", c)
    return c


def _module_path(monkeypatch):
    monkeypatch.setattr(model_mod, "fused_decode_ok", lambda *a, **k: False)


def _steps(m, subnet, prompt, prompt_doc, steps):
    """Prefill ``prompt`` (padded rows marked by document -1), then feed each of ``steps``; returns
    every forward's output and the cache."""
    b, t = prompt.shape
    cache = m.new_cache(b, t + sum(s.shape[1] for s in steps))
    outs = []
    with torch.inference_mode():
        pos = (torch.arange(t).expand(b, t) - (prompt_doc < 0).sum(1, keepdim=True)).clamp_min(0)
        outs.append(
            m(prompt, positions_3BT=pos.expand(3, b, t), doc_ids_BT=prompt_doc, subnet=subnet, cache=cache)
        )
        nxt = pos[:, -1:] + 1
        for s in steps:
            n = s.shape[1]
            p = nxt + torch.arange(n)
            outs.append(m(s, positions_3BT=p.expand(3, b, n), subnet=subnet, cache=cache))
            nxt = nxt + n
    return outs, cache


def _assert_same(fused, module):
    (outs_f, cache_f), (outs_m, cache_m) = fused, module
    for a, b in zip(outs_f, outs_m):
        assert torch.equal(a.logits_BTV, b.logits_BTV)
        assert torch.equal(a.hidden_BTD, b.hidden_BTD)
        assert a.routing.keys() == b.routing.keys()
        for i in a.routing:
            ra, rb = a.routing[i], b.routing[i]
            assert torch.equal(ra.expert_ids_NA, rb.expert_ids_NA)
            assert torch.equal(ra.gates_NA, rb.gates_NA)
            assert torch.equal(ra.counts_E, rb.counts_E)
    for layer in range(len(cache_f.k)):
        assert torch.equal(cache_f.k[layer], cache_m.k[layer])
        assert torch.equal(cache_f.v[layer], cache_m.v[layer])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "overrides,spec",
    [
        ({}, "full"),
        ({}, "d0.75-w0.5-k1"),
        ({"qk_norm": False, "n_dense_layers": 0}, "k0.5"),
        ({"moe": {"score_func": "sigmoid", "n_shared_experts": 0, "route_scale": 2.5}}, "w0.5"),
        ({"moe": {"n_experts": 16, "top_k": 4}, "d_model": 128, "n_heads": 8}, "full"),  # the router kernel
    ],
)
def test_fused_steps_equal_the_module_path(monkeypatch, counting, dtype, overrides, spec):
    """Batched decoding with a padded row (dense masks), a two-token step (a speculative check:
    causal inside the step), a prompt short enough to be fused itself (causal mask)."""
    torch.manual_seed(0)
    cfg = _config(**overrides)
    m = Ernie5Model(cfg).eval().to(dtype)
    sub = resolve(spec, cfg)
    prompt = torch.randint(0, 64, (2, 6))
    doc = torch.zeros(2, 6, dtype=torch.long)
    doc[1, :2] = -1  # row 1 is left-padded
    steps = [torch.randint(0, 64, (2, 1)) for _ in range(3)]
    short, short_steps = prompt[:1, :3], [torch.randint(0, 64, (1, 2)), steps[0][:1]]
    fused = _steps(m, sub, prompt, doc, steps)
    assert counting.calls == 3 * len(sub.layers)
    fused_short = _steps(m, sub, short, doc[:1, :3], short_steps)
    assert counting.calls == 6 * len(sub.layers)  # the 3-token prompt is fused too
    _module_path(monkeypatch)
    _assert_same(fused, _steps(m, sub, prompt, doc, steps))
    _assert_same(fused_short, _steps(m, sub, short, doc[:1, :3], short_steps))
    assert counting.calls == 6 * len(sub.layers)


def test_fused_decoding_equals_the_full_forward(counting):
    """Against an independent path: the whole sequence in one forward without a cache."""
    torch.manual_seed(1)
    m = Ernie5Model(_config()).eval()
    x = torch.randint(0, 64, (2, 12))
    with torch.inference_mode():
        full = m(x).logits_BTV
        cache = m.new_cache(2, 12)
        outs = [m(x[:, :8], cache=cache).logits_BTV]
        outs += [m(x[:, i : i + 1], cache=cache).logits_BTV for i in range(8, 10)]
        outs.append(m(x[:, 10:12], cache=cache).logits_BTV)  # 2 rows x 2 tokens = 4 rows: fused
    assert counting.calls == 3 * m.cfg.n_layers
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)


def _one_step(m, dispatch=None, grad=False, autocast=False, rows=1):
    cache = m.new_cache(rows, 8)
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        m(torch.randint(0, 64, (rows, 5)), cache=cache)
        return m(torch.randint(0, 64, (rows, 1)), cache=cache, dispatch=dispatch).logits_BTV


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # autocast's RMSNorm
def test_fused_path_only_where_it_applies(counting):
    m = Ernie5Model(_config()).eval()
    n = m.cfg.n_layers
    _one_step(m)
    assert counting.calls == n
    _one_step(m, dispatch="gather")  # the path a decoding step takes anyway
    assert counting.calls == 2 * n
    for kwargs in (
        {"dispatch": "sorted"},
        {"dispatch": "loop"},
        {"grad": True},
        {"autocast": True},
        {"rows": 5},
    ):
        _one_step(m, **kwargs)
        assert counting.calls == 2 * n, kwargs


def test_fused_layers_follow_the_parameters(monkeypatch, counting):
    """The layers keep their kernel arguments between steps; a new module, a new parameter, a new
    dtype or new values in place must all show."""
    torch.manual_seed(2)
    m = Ernie5Model(_config()).eval()
    _one_step(m)  # the arguments are built
    blk = m.layers[1]
    blk.attn.wo.weight = nn.Parameter(torch.randn_like(blk.attn.wo.weight))
    m.layers[2].attn.wqkv = Linear(m.cfg.d_model, m.layers[2].attn.wqkv.out_features)  # a new module
    m.layers[3].ffn.router = nn.Linear(m.cfg.d_model, m.cfg.moe.n_experts, bias=False)
    with torch.no_grad():
        blk.ffn.w2.mul_(3.0)
        blk.ffn.router_bias.add_(torch.linspace(-1, 1, blk.ffn.router_bias.numel()))
    m.to(torch.bfloat16)
    torch.manual_seed(3)
    fused = _one_step(m)
    assert counting.calls == 2 * m.cfg.n_layers
    _module_path(monkeypatch)
    torch.manual_seed(3)
    assert torch.equal(fused, _one_step(m))
