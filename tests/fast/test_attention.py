"""Attention back-ends (:mod:`ernie5.fast.attention`) against the eager ``Attention.attend``: the
fused CPU attention kernel, PyTorch's bf16 flash forward with an fp32 backward, decoding rows over
a KV cache, fp32 and bf16 inference; and the fast model's training step against the eager one.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ernie5.fast import apply_fast_paths
from ernie5.fast import attention as fast_attention
from ernie5.fast.attention import FastAttention, attend
from ernie5.kernels import kernels, ops
from ernie5.model.attention import Attention
from ernie5.model.mask import AttnMask, allowed
from ernie5.model.model import Ernie5Model
from tests.conftest import tiny_config

needs_kernels = pytest.mark.skipif(kernels() is None, reason="fused CPU kernels did not build here")
needs_fused_attention = pytest.mark.skipif(
    kernels() is None or not kernels().attention_available(),
    reason="the fused attention kernel needs a build on a CPU with AVX512-BF16",
)


def eager_attend(q_BHTD, k_BKSD, v_BKSD, mask: AttnMask) -> torch.Tensor:
    """The reference: the eager model's ``Attention.attend`` (SDPA, or eager flex)."""
    return Attention(tiny_config()).attend(q_BHTD, k_BKSD, v_BKSD, mask)


def _doc_mask(b: int, t: int, cuts: list[int]) -> torch.Tensor:
    """Causal attention inside documents that start at ``cuts``: ``(B, 1, T, T)`` bool."""
    doc = torch.zeros(t, dtype=torch.long)
    for c in cuts:
        doc[c:] += 1
    doc_bt = doc.expand(b, t)
    pos = torch.arange(t).expand(b, t)
    return allowed(doc_bt, pos, doc_bt, pos)[:, None]


def test_apply_fast_paths_makes_attention_fast_and_keeps_its_state():
    m = Ernie5Model(tiny_config())
    fast = apply_fast_paths(copy.deepcopy(m))
    assert all(isinstance(b.attn, FastAttention) for b in fast.layers)
    assert all(type(b.attn) is Attention for b in m.layers)
    assert fast.state_dict().keys() == m.state_dict().keys()


@pytest.mark.parametrize("causal", [True, False])
def test_short_bf16_training_attention_runs_a_bf16_forward_and_an_fp32_backward(causal):
    import torch.nn.functional as F

    from ernie5.fast.attention import FP32_TRAIN_ATTN_MAX_KEYS

    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8)
    k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    dense = (
        None
        if causal
        else allowed(
            torch.zeros(2, 16),
            torch.arange(16).expand(2, 16) // 4,
            torch.zeros(2, 16),
            torch.arange(16).expand(2, 16) // 4,
        )[:, None]
    )
    mask = AttnMask(dense_B1TS=dense, is_causal=causal)
    ref = eager_attend(q, k, v, mask)
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    do = torch.randn(2, 4, 16, 8)
    out = attend(qb, kb, vb, mask)
    assert type(out.grad_fn).__name__ == "_BF16FlashFP32BackwardBackward"  # head dim 8: not the kernel
    out.backward(do.bfloat16())
    assert out.dtype == torch.bfloat16 and qb.grad.dtype == torch.bfloat16
    # The forward is bf16 attention on the bf16 inputs.
    with torch.no_grad():
        bf16 = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=dense, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out.detach().float(), bf16.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(out.float(), ref, atol=5e-2)
    # The backward is fp32 attention's gradient at the bf16-rounded inputs, rounded once.
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (qb, kb, vb))
    eager_attend(q32, k32, v32, mask).backward(do.bfloat16().float())
    for got, exp in ((qb, q32), (kb, k32), (vb, v32)):
        torch.testing.assert_close(got.grad.float(), exp.grad, atol=3e-2, rtol=3e-2)
    assert k.shape[2] <= FP32_TRAIN_ATTN_MAX_KEYS


@needs_kernels
@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_kernels_match_the_eager_model(qk_norm):
    """A training forward + backward (norms, QK-norm + RoPE prologue, MoE activations) on the fused
    CPU kernels (the fast model) equals the eager PyTorch one."""
    torch.manual_seed(0)
    m = Ernie5Model(tiny_config(qk_norm=qk_norm)).train()
    fast = apply_fast_paths(copy.deepcopy(m))
    x = torch.randint(0, 64, (2, 24))

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        out = model(x, targets=x)
        out.losses.text.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.losses.text.detach(), grads

    fused_loss, fused_grads = loss_and_grads(fast)
    eager_loss, eager_grads = loss_and_grads(m)
    torch.testing.assert_close(fused_loss, eager_loss, atol=1e-5, rtol=1e-5)
    assert fused_grads.keys() == eager_grads.keys()
    for name, g in fused_grads.items():
        torch.testing.assert_close(g, eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@needs_fused_attention
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("kind", ["causal", "documents", "none"])
@pytest.mark.parametrize("t,d", [(1, 16), (17, 32), (40, 64)])
def test_fused_attention_matches_fp32_attention(amx, kind, t, d):
    """The fused kernel (AMX and AVX512-BF16 paths) against fp32 eager attention at the same bf16
    inputs: output, log-sum-exp and the three gradients, with GQA (4 query heads over 2 kv heads)."""
    torch.manual_seed(t + d)
    b, h, kv = 2, 4, 2
    q = torch.randn(b, h, t, d).bfloat16()
    k, v = torch.randn(b, kv, t, d).bfloat16(), torch.randn(b, kv, t, d).bfloat16()
    do = torch.randn(b, h, t, d).bfloat16()
    dense = _doc_mask(b, t, [t // 3, t // 2]) if kind == "documents" else None
    mask = AttnMask(dense_B1TS=dense, is_causal=kind == "causal")
    bias = mask.additive_B1TS(torch.float32)
    bias = bias if bias is not None else torch.empty(0)
    o, lse = kernels().attn_fwd(q, k, v, mask.is_causal, bias, amx)
    dq, dk, dv = kernels().attn_bwd(do, q, k, v, o, lse, mask.is_causal, bias, amx)

    q32, k32, v32 = (x.float().requires_grad_() for x in (q, k, v))
    ref = eager_attend(q32, k32, v32, mask)
    ref.backward(do.float())
    torch.testing.assert_close(o.float(), ref.detach(), atol=1e-2, rtol=1e-2)
    scores = q32.detach() @ k32.detach().repeat_interleave(h // kv, 1).transpose(-1, -2) / d**0.5
    if mask.is_causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    elif dense is not None:
        scores = scores.masked_fill(~dense, float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=1e-4, rtol=1e-5)
    for got, exp in ((dq, q32), (dk, k32), (dv, v32)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), exp.grad, atol=3e-2, rtol=3e-2)
    again = kernels().attn_bwd(do, q, k, v, o, lse, mask.is_causal, bias, amx)
    assert all(torch.equal(x, y) for x, y in zip((dq, dk, dv), again))  # bit-identical rerun


@needs_fused_attention
def test_fused_attention_gives_a_fully_masked_row_zero_output_and_no_nan():
    q, k, v = (torch.randn(1, 2, 4, 16).bfloat16() for _ in range(3))
    bias = torch.zeros(1, 1, 4, 4)
    bias[0, 0, 2] = float("-inf")  # query 2 sees nothing
    o, lse = kernels().attn_fwd(q, k, v, False, bias, True)
    dq, dk, dv = kernels().attn_bwd(torch.ones_like(o), q, k, v, o, lse, False, bias, True)
    assert bool((o[:, :, 2] == 0).all()) and bool((dq[:, :, 2] == 0).all())
    assert all(bool(torch.isfinite(x.float()).all()) for x in (o, dq, dk, dv))


@needs_fused_attention
def test_training_attention_takes_the_fused_kernel_only_where_it_fits(monkeypatch):
    fits = fast_attention._fused_attention_fits
    causal = AttnMask(is_causal=True)
    q, k = torch.zeros(1, 4, 8, 32), torch.zeros(1, 2, 8, 32)
    assert fits(q, k, causal)
    assert not fits(q[..., :8], k[..., :8], causal)  # head dim 8
    assert not fits(q, torch.zeros(1, 3, 8, 32), causal)  # 4 heads over 3
    assert not fits(q, torch.zeros(1, 2, 9, 32), causal)  # causal needs T == S
    calls = []
    real = fast_attention._FusedAttention.apply
    monkeypatch.setattr(fast_attention._FusedAttention, "apply", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(1)
    qb = torch.randn(1, 4, 8, 32).bfloat16().requires_grad_()
    kb, vb = torch.randn(1, 2, 8, 32).bfloat16(), torch.randn(1, 2, 8, 32).bfloat16()
    out = attend(qb, kb, vb, causal)
    out.float().sum().backward()
    with torch.no_grad():  # inference calls the kernel's forward directly (no autograd Function)
        again = attend(qb, kb, vb, causal)
    assert calls == [1] and torch.equal(again, out.detach())
    q32 = qb.detach().float().requires_grad_()
    ref = eager_attend(q32, kb.float(), vb.float(), causal)
    ref.sum().backward()
    torch.testing.assert_close(out.detach().float(), ref.detach(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(qb.grad.float(), q32.grad, atol=3e-2, rtol=3e-2)


@needs_fused_attention
@pytest.mark.parametrize("kind", ["causal", "documents", "cached prefix"])
def test_bf16_inference_attention_runs_the_fused_forward(monkeypatch, kind):
    """bf16 attention without gradients (prefill, scoring) runs the fused kernel's forward: causal,
    under a document mask, and for queries after a cached prefix (T < S, a dense mask); it matches
    fp32 eager attention at the same bf16 inputs. Past FUSED_INFER_MAX_KEYS keys, PyTorch's SDPA runs."""
    torch.manual_seed(3)
    b, h, kv, d, s = 2, 4, 2, 32, 40
    t = 9 if kind == "cached prefix" else s
    q = torch.randn(b, h, t, d).bfloat16()
    k, v = torch.randn(b, kv, s, d).bfloat16(), torch.randn(b, kv, s, d).bfloat16()
    if kind == "causal":
        mask = AttnMask(is_causal=True)
    elif kind == "documents":
        mask = AttnMask(dense_B1TS=_doc_mask(b, s, [13, 30]))
    else:
        mask = AttnMask(dense_B1TS=_doc_mask(b, s, [13])[:, :, s - t :])
    calls = []
    recorder = _Recorder(kernels().attn_fwd, calls)
    monkeypatch.setattr(fast_attention, "kernels", lambda: recorder)
    with torch.no_grad():
        got = attend(q, k, v, mask)
    assert calls == [(t, s)]
    ref = eager_attend(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)
    monkeypatch.setattr(fast_attention, "FUSED_INFER_MAX_KEYS", s - 1)
    with torch.no_grad():
        fallback = attend(q, k, v, mask)
    assert calls == [(t, s)]  # PyTorch's SDPA this time
    torch.testing.assert_close(fallback.float(), ref, atol=2e-2, rtol=2e-2)


class _Recorder:
    """The kernel module, recording the (T, S) of each ``attn_fwd`` call."""

    def __init__(self, attn_fwd, calls):
        self._attn_fwd, self._calls = attn_fwd, calls

    def attn_fwd(self, q, k, *rest):
        self._calls.append((q.shape[2], k.shape[2]))
        return self._attn_fwd(q, k, *rest)

    def __getattr__(self, name):
        return getattr(kernels(), name)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masking", ["none", "dense"])
@pytest.mark.parametrize("b,t", [(1, 1), (2, 2), (4, 1)])
def test_decode_rows_over_a_cache_match_eager_attention(dtype, masking, b, t):
    """A decoding step (a few query rows over a KV cache read in place: strided views of a longer
    buffer) runs ``attend_rows`` and matches the eager attention."""
    if not kernels().rows_kernels_available():
        pytest.skip("the decoding kernels need AVX-512")
    torch.manual_seed(b * 10 + t)
    h, kv, d, s = 4, 2, 32, 23
    buf_k, buf_v = torch.randn(b, kv, 40, d, dtype=dtype), torch.randn(b, kv, 40, d, dtype=dtype)
    k, v = buf_k[:, :, :s], buf_v[:, :, :s]  # a cache's view: its first s positions
    q = torch.randn(b, h, t, d, dtype=dtype)
    dense = torch.rand(b, 1, t, s) > 0.4 if masking == "dense" else None
    if dense is not None:
        dense[..., -1] = True
    mask = AttnMask(dense_B1TS=dense)
    with torch.no_grad():
        assert ops.attend_rows_fusable(q, k, v)
        got = attend(q, k, v, mask)
        ref = eager_attend(q.float(), k.float(), v.float(), mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("kind", ["causal", "documents", "cached prefix"])
def test_fp32_inference_attention_matches_eager_attention(monkeypatch, kind):
    """fp32 attention without gradients (prefill, scoring) runs ``attend_f32`` and matches the
    eager attention; with gradients the eager SDPA runs."""
    if not kernels().infer_f32_available():
        pytest.skip("the fp32 inference kernels need AVX-512")
    torch.manual_seed(5)
    b, h, kv, d, s = 2, 4, 2, 32, 30
    t = 7 if kind == "cached prefix" else s
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, kv, s, d), torch.randn(b, kv, s, d)
    if kind == "causal":
        mask = AttnMask(is_causal=True)
    elif kind == "documents":
        mask = AttnMask(dense_B1TS=_doc_mask(b, s, [11, 20]))
    else:
        mask = AttnMask(dense_B1TS=_doc_mask(b, s, [11])[:, :, s - t :])
    calls = []
    real = ops.attend_f32
    monkeypatch.setattr(ops, "attend_f32", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        got = attend(q, k, v, mask)
        ref = eager_attend(q, k, v, mask)
    assert calls == [1]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    q.requires_grad_()
    trained = attend(q, k, v, mask)
    assert calls == [1] and trained.requires_grad  # a gradient: not the inference kernel
    torch.testing.assert_close(trained.detach(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_attention_layer_matches_the_eager_layer_with_a_cache(qk_norm, dtype):
    """The whole layer (fused split + QK-norm + RoPE projection, back-ends) against the eager layer:
    a prefill then decoding steps through a KV cache."""
    torch.manual_seed(6)
    m = Ernie5Model(tiny_config(d_model=64, qk_norm=qk_norm)).eval().to(dtype)
    fast = apply_fast_paths(copy.deepcopy(m))
    x = torch.randint(0, 64, (2, 12))
    outs = []
    with torch.no_grad():
        for model in (m, fast):
            cache = model.new_cache(2, 16)
            logits = [model(x[:, :9], cache=cache).logits_BTV]
            logits += [model(x[:, i : i + 1], cache=cache).logits_BTV for i in range(9, 12)]
            outs.append(torch.cat(logits, dim=1).float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@needs_fused_attention
def test_bf16_model_training_step_with_fused_attention_matches_pytorch_attention():
    """A bf16 micro model's loss and gradients with every fused kernel (attention included: the fast
    model) against the eager model (PyTorch's attention, eager everything). Every token uses all
    experts (top-k = E), so bf16 rounding differences cannot flip a routing choice, which would
    move whole expert gradients."""
    torch.manual_seed(0)
    cfg = tiny_config(d_model=64, moe=dict(top_k=8))
    assert cfg.dim_head % 16 == 0  # so the fused attention runs
    m = Ernie5Model(cfg).train().bfloat16()
    fast = apply_fast_paths(copy.deepcopy(m))
    x = torch.randint(0, 64, (2, 24))

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        out = model(x, targets=x)
        out.losses.text.backward()
        return out.losses.text.detach().float(), {
            n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None
        }

    fused_loss, fused_grads = loss_and_grads(fast)
    eager_loss, eager_grads = loss_and_grads(m)
    torch.testing.assert_close(fused_loss, eager_loss, atol=2e-2, rtol=1e-2)
    assert fused_grads.keys() == eager_grads.keys()
    for name, g in fused_grads.items():  # bf16 rounding differs op by op: compare whole tensors
        e = eager_grads[name]
        assert float((g - e).norm() / e.norm().clamp_min(1e-12)) < 0.05, name
