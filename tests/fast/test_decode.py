"""Fused decoding layers (:class:`ernie5.fast.decode.FastBlock`, the ``decode_layer`` kernel) against
the module-by-module path they replace (the same fast model with the fused step off): the same
kernels in the same order, so equal bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ernie5.fast.decode as decode_mod
from ernie5.fast import apply_fast_paths
from ernie5.fast.decode import FastBlock, FastErnie5Model
from ernie5.fast.layers import RowsLinear
from ernie5.fast.moe import FastMoE
from ernie5.kernels import kernels
from ernie5.model.inputs import Inputs
from ernie5.model.model import Ernie5Model
from ernie5.subnets.spec import resolve
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


def _fast(m: Ernie5Model) -> Ernie5Model:
    """``m`` with the fast paths applied: fused decoding steps in the backbone's blocks."""
    m = apply_fast_paths(m)
    assert isinstance(m, FastErnie5Model) and all(isinstance(b, FastBlock) for b in m.layers)
    return m


class _Counting:
    """Stands in for ``kernels()`` in :mod:`ernie5.fast.decode`, counting ``decode_layer`` calls."""

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
    monkeypatch.setattr(decode_mod, "kernels", c)
    return c


def _module_path(monkeypatch):
    """The fused step off: every forward's context says it is not a fused decoding step, so each
    FastBlock runs its (fast) modules."""
    monkeypatch.setattr(FastErnie5Model, "_fused_decode_ok", lambda *a, **k: False)


def _steps(m, subnet, prompt, prompt_doc, steps):
    """Prefill ``prompt`` (padded rows marked by document -1), then feed each of ``steps``; returns
    every forward's output and the cache."""
    b, t = prompt.shape
    cache = m.new_cache(b, t + sum(s.shape[1] for s in steps))
    outs = []
    with torch.inference_mode():
        pos = (torch.arange(t).expand(b, t) - (prompt_doc < 0).sum(1, keepdim=True)).clamp_min(0)
        outs.append(
            m(
                Inputs(prompt, positions_3BT=pos.expand(3, b, t), doc_ids_BT=prompt_doc),
                subnet=subnet,
                cache=cache,
            )
        )
        nxt = pos[:, -1:] + 1
        for s in steps:
            n = s.shape[1]
            p = nxt + torch.arange(n)
            outs.append(m(Inputs(s, positions_3BT=p.expand(3, b, n)), subnet=subnet, cache=cache))
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
    m = _fast(Ernie5Model(cfg).eval().to(dtype))
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
    """Against independent paths: the whole sequence in one forward without a cache, by the same
    fast model and by the eager model it was made from."""
    torch.manual_seed(1)
    eager = Ernie5Model(_config()).eval()
    m = _fast(copy.deepcopy(eager))
    x = torch.randint(0, 64, (2, 12))
    with torch.inference_mode():
        full = m(x).logits_BTV
        full_eager = eager(x).logits_BTV
        cache = m.new_cache(2, 12)
        outs = [m(x[:, :8], cache=cache).logits_BTV]
        outs += [m(x[:, i : i + 1], cache=cache).logits_BTV for i in range(8, 10)]
        outs.append(m(x[:, 10:12], cache=cache).logits_BTV)  # 2 rows x 2 tokens = 4 rows: fused
    assert counting.calls == 3 * m.cfg.n_layers
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(outs, dim=1), full_eager, atol=1e-5, rtol=1e-5)


def _one_step(m, moe_path=None, grad=False, autocast=False, rows=1):
    """Prefill 5 tokens, then one decoding step of ``rows`` rows whose MoE layers take ``moe_path``
    (None: as set); returns the step's logits."""
    cache = m.new_cache(rows, 8)
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        m(torch.randint(0, 64, (rows, 5)), cache=cache)
        moes = [mod for mod in m.modules() if isinstance(mod, FastMoE)]
        paths = [mod.path for mod in moes]
        try:
            for mod in moes:
                mod.path = moe_path or mod.path
            return m(torch.randint(0, 64, (rows, 1)), cache=cache).logits_BTV
        finally:
            for mod, path in zip(moes, paths):
                mod.path = path


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # autocast's RMSNorm
def test_fused_path_only_where_it_applies(counting):
    m = _fast(Ernie5Model(_config()).eval())
    n, n_dense = m.cfg.n_layers, m.cfg.n_dense_layers
    assert n_dense == 1 and n > n_dense
    _one_step(m)
    assert counting.calls == n
    _one_step(m, moe_path="gather")  # the path a decoding step takes anyway
    assert counting.calls == 2 * n
    # Another expert path: the MoE layers run their modules; the dense layer's step is still fused.
    for moe_path in ("sorted", "loop"):
        before = counting.calls
        _one_step(m, moe_path=moe_path)
        assert counting.calls == before + n_dense, moe_path
    calls = counting.calls
    for kwargs in (
        {"grad": True},
        {"autocast": True},
        {"rows": 5},
    ):
        _one_step(m, **kwargs)
        assert counting.calls == calls, kwargs
    _one_step(Ernie5Model(_config()).eval())  # the eager model: no fused steps
    assert counting.calls == calls


def test_fused_layers_follow_the_parameters(monkeypatch, counting):
    """The layers keep their kernel arguments between steps; a new module, a new parameter, a new
    dtype or new values in place must all show."""
    torch.manual_seed(2)
    m = _fast(Ernie5Model(_config()).eval())
    _one_step(m)  # the arguments are built
    blk = m.layers[1]
    plan = blk._plan
    assert plan is not None and plan[1] is not None
    _one_step(m)
    assert blk._plan is plan  # kept between steps while nothing changed
    blk.attn.wo.weight = nn.Parameter(torch.randn_like(blk.attn.wo.weight))
    wqkv = m.layers[2].attn.wqkv
    m.layers[2].attn.wqkv = RowsLinear(wqkv.in_features, wqkv.out_features, bias=False)  # a new module
    m.layers[3].ffn.router = nn.Linear(m.cfg.d_model, m.cfg.moe.n_experts, bias=False)
    with torch.no_grad():
        blk.ffn.w2.mul_(3.0)
        blk.ffn.router_bias.add_(torch.linspace(-1, 1, blk.ffn.router_bias.numel()))
    m.to(torch.bfloat16)
    torch.manual_seed(3)
    fused = _one_step(m)
    assert counting.calls == 3 * m.cfg.n_layers
    assert blk._plan is not plan  # rebuilt
    _module_path(monkeypatch)
    torch.manual_seed(3)
    assert torch.equal(fused, _one_step(m))


def test_hooks_see_fused_steps(counting):
    """A block with a hook takes the fused step through ``nn.Module.__call__``: the hook fires with
    the fused output, and the result equals the hook-free shortcut's."""
    torch.manual_seed(0)
    cfg = _config()
    m = _fast(Ernie5Model(cfg).eval())
    sub = resolve("full", cfg)
    prompt, doc = torch.randint(0, 64, (1, 5)), torch.zeros(1, 5, dtype=torch.long)
    steps = [torch.randint(0, 64, (1, 1)) for _ in range(2)]
    plain = _steps(m, sub, prompt, doc, steps)
    calls_plain = counting.calls
    seen = []
    handle = m.layers[1].register_forward_hook(lambda mod, args, out: seen.append(out[0].clone()))
    try:
        hooked = _steps(m, sub, prompt, doc, steps)
    finally:
        handle.remove()
    assert counting.calls == 2 * calls_plain  # still fused, with the hook on
    assert len(seen) == 1 + len(steps)  # the prefill and every decoding step
    _assert_same(hooked, plain)
