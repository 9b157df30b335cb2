"""The fp32 inference kernels (cpu_infer_f32.cpp): the experts against the naive per-expert loop,
attention against float64 SDPA, and when the model takes them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ernie5.fast import apply_fast_paths
from ernie5.fast.moe_levels import experts_sorted, plan_dispatch
from ernie5.kernels import kernels, ops
from ernie5.model.config import MoEConfig
from ernie5.model.moe import MoE, experts_loop, router_logits, select_experts

needs_f32 = pytest.mark.skipif(
    kernels() is None or not kernels().infer_f32_available(),
    reason="the fp32 expert kernel needs an AVX-512 build",
)


def _layer(n_exp: int, d: int, f: int, k: int, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(d, MoEConfig(n_experts=n_exp, d_expert=f, top_k=k))
    for p in (layer.w13, layer.w2, layer.router.weight):
        torch.nn.init.normal_(p, std=0.05)
    return layer


def _routed(layer: MoE, x_ND: torch.Tensor, mask_E: torch.Tensor | None = None, skew: float = 0.0):
    """Routing of x; ``skew`` adds a bias towards expert 0, so that it takes more than one work item
    (64 rows) of tokens."""
    bias = layer.router_bias.clone()
    bias[0] += skew
    logits_NE = router_logits(x_ND, layer.router.weight)
    return select_experts(logits_NE, bias, layer.cfg, layer.cfg.top_k, mask_E, x_ND.shape[0])


@needs_f32
@pytest.mark.parametrize(
    ("n", "n_exp", "d", "f", "k", "skew"),
    [
        (1, 8, 32, 16, 2, 0.0),  # one token
        (37, 8, 48, 32, 1, 0.0),  # top-1, rows that are not whole 16-row groups
        (300, 16, 64, 48, 4, 0.0),  # top-4
        (500, 8, 64, 64, 2, 0.5),  # an expert with several 64-row work items and a partial one
        (512, 64, 256, 256, 2, 0.0),  # the nano layer at a 512-token prefill
    ],
)
def test_inference_experts_match_the_naive_loop(n, n_exp, d, f, k, skew):
    layer = _layer(n_exp, d, f, k)
    x = torch.randn(n, d)
    r = _routed(layer, x, skew=skew)
    with torch.no_grad():
        assert ops.expert_infer_fusable(x, layer.w13, layer.w2)
        got = experts_sorted(x, layer.w13, layer.w2, r)
        want = experts_loop(x, layer.w13, layer.w2, r)
    if skew:
        assert int(r.counts_E.max()) > 128  # several work items for one expert
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_f32
def test_masked_experts_and_idle_experts():
    layer = _layer(16, 64, 32, 2)
    x = torch.randn(40, 64)
    mask = torch.zeros(16, dtype=torch.bool)
    mask[[1, 5, 6, 11]] = True  # a narrow subnet: 12 experts idle
    r = _routed(layer, x, mask)
    with torch.no_grad():
        got = experts_sorted(x, layer.w13, layer.w2, r)
        want = experts_loop(x, layer.w13, layer.w2, r)
    assert set(torch.nonzero(r.counts_E).flatten().tolist()) <= {1, 5, 6, 11}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@needs_f32
def test_taken_only_in_fp32_without_gradients():
    layer = _layer(8, 32, 16, 2)
    x = torch.randn(10, 32)
    with torch.no_grad():
        assert ops.expert_infer_fusable(x, layer.w13, layer.w2)
        assert not ops.expert_infer_fusable(x.bfloat16(), layer.w13.bfloat16(), layer.w2.bfloat16())
    assert not ops.expert_infer_fusable(x, layer.w13, layer.w2)  # the weights want gradients
    odd = _layer(8, 32, 24, 2)  # d_expert not a multiple of 16
    with torch.no_grad():
        assert not ops.expert_infer_fusable(x, odd.w13, odd.w2)
    # With gradients the padded path runs, and its gradients flow.
    r = _routed(layer, x)
    y = experts_sorted(x, layer.w13, layer.w2, r)
    y.sum().backward()
    assert layer.w13.grad is not None and layer.w13.grad.abs().sum() > 0


@needs_f32
def test_layer_forward_equals_the_training_path():
    """The MoE layer's eval forward (no gradients: this kernel) equals its forward with gradients
    (padded batched GEMMs), up to fp32 rounding."""
    layer = apply_fast_paths(_layer(16, 64, 32, 2))
    assert layer.path == "auto"
    x = torch.randn(2, 50, 64)
    with torch.no_grad():
        assert layer.expert_path(x.view(-1, 64), 2, x.dtype) == "sorted"
        assert ops.expert_infer_fusable(x.view(-1, 64), layer.w13, layer.w2)
        y_eval, _ = layer(x)
    y_train, _ = layer(x)
    torch.testing.assert_close(y_eval, y_train.detach(), rtol=1e-5, atol=1e-6)


@needs_f32
def test_bad_indices_are_errors():
    layer = _layer(4, 32, 16, 2)
    x = torch.randn(6, 32)
    r = _routed(layer, x)
    plan = plan_dispatch(r, 6, skip_padding=True)
    lv = plan.levels[0]
    gates = r.gates_NA.reshape(-1).contiguous()
    args = (layer.w13.detach(), layer.w2.detach(), x, gates)
    first = int(torch.nonzero(lv.valid_E).flatten()[0]) * lv.cap  # a valid slot
    bad_tok = lv.tok_EC.clone()
    bad_tok[first] = 99
    with pytest.raises(RuntimeError, match="token index 99 outside"):
        kernels().expert_ffn_infer(*args, bad_tok, lv.pair_EC, lv.valid_E)
    bad_pair = lv.pair_EC.clone()
    bad_pair[first] = (int(lv.pair_EC[first]) + 2) % 12  # a pair of another token
    with pytest.raises(RuntimeError, match="pair index"):
        kernels().expert_ffn_infer(*args, lv.tok_EC, bad_pair, lv.valid_E)
    short = lv.valid_E.clone()
    short[short.argmax()] -= 1  # a routed pair left out
    with pytest.raises(RuntimeError, match="in no expert's valid slots"):
        kernels().expert_ffn_infer(*args, lv.tok_EC, lv.pair_EC, short)


@needs_f32
@pytest.mark.parametrize(
    ("b", "h", "kv", "t", "s", "dh", "kind"),
    [
        (1, 8, 2, 70, 70, 32, "causal"),  # rows that are not whole 32-row items, keys not whole vectors
        (2, 4, 2, 1, 1, 16, "causal"),
        (2, 4, 2, 9, 40, 64, "mask"),  # queries after a cached prefix
        (1, 4, 4, 33, 33, 128, "none"),
        (3, 6, 3, 50, 50, 16, "mask"),
    ],
)
def test_fp32_attention_matches_float64_sdpa(b, h, kv, t, s, dh, kind):
    torch.manual_seed(t * s + dh)
    q = torch.randn(b, h, t, dh)
    # Keys and values as a KV-cache view: the first s of 50 + s positions, strided.
    k_buf, v_buf = torch.randn(b, kv, s + 50, dh), torch.randn(b, kv, s + 50, dh)
    k, v = k_buf[:, :, :s], v_buf[:, :, :s]
    mask = None
    if kind == "mask":
        mask = torch.rand(b, 1, t, s) > 0.4
        mask[0, 0, 0] = False  # a query that sees no key
    assert ops.attend_f32_fusable(q, k, v)
    with torch.no_grad():
        got = ops.attend_f32(q, k, v, mask, kind == "causal")
    want = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, is_causal=kind == "causal", enable_gqa=True
    )
    if mask is not None:
        want = torch.nan_to_num(want, nan=0.0)
        want[0, :, 0] = 0.0  # the blind query: zeros (SDPA gives NaN)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@needs_f32
def test_fp32_attention_is_taken_at_inference_only(monkeypatch):
    from ernie5.fast.attention import attend
    from ernie5.model.mask import AttnMask

    calls = []
    real = ops.attend_f32
    monkeypatch.setattr(ops, "attend_f32", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    q, k, v = torch.randn(1, 4, 12, 32), torch.randn(1, 2, 12, 32), torch.randn(1, 2, 12, 32)
    causal = AttnMask(is_causal=True)
    with torch.no_grad():
        out = attend(q, k, v, causal)
        attend(q[:, :, :10], k, v, causal)  # causal with T != S: PyTorch's rule, PyTorch's SDPA
    assert calls == [12]
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    q.requires_grad_()
    attend(q, k, v, causal).sum().backward()  # with a gradient: PyTorch's SDPA
    assert calls == [12] and q.grad is not None
    with torch.no_grad():
        assert not ops.attend_f32_fusable(q.bfloat16(), k.bfloat16(), v.bfloat16())
        assert not ops.attend_f32_fusable(q[..., :24], k[..., :24], v[..., :24])  # head dim 24


@needs_f32
def test_fp32_model_prefill_then_decode_equals_the_training_path():
    """A fp32 micro model's cached prefill and decode steps (the inference kernels) give the logits
    of one forward with gradients enabled (PyTorch's SDPA and the padded experts)."""
    from ernie5.model.model import Ernie5Model
    from tests.conftest import tiny_config

    torch.manual_seed(0)
    m = apply_fast_paths(Ernie5Model(tiny_config(d_model=64)).eval())
    x = torch.randint(0, 64, (2, 20))
    want = m(x).logits_BTV.detach()
    with torch.no_grad():
        cache = m.new_cache(2, 20)
        first = m(x[:, :17], cache=cache).logits_BTV
        rest = [m(x[:, i : i + 1], cache=cache).logits_BTV for i in range(17, 20)]
    got = torch.cat([first, *rest], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
