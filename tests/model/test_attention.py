"""Attention: causality, block masks, document isolation, SDPA vs flex, KV cache, Uni-RoPE."""

from __future__ import annotations

import pytest
import torch

from ernie5.kernels import kernels
from ernie5.model.mask import allowed, build_mask
from ernie5.model.model import Ernie5Model
from ernie5.model.rope import apply_rope, inv_frequencies, rope_cos_sin, text_positions
from tests.conftest import tiny_config


def _model(**kw):
    return Ernie5Model(tiny_config(**kw)).eval()


def test_causal_future_tokens_do_not_change_the_past():
    m = _model()
    x = torch.randint(0, 64, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        a, b = m(x).logits_BTV, m(y).logits_BTV
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize(
    ("doc", "blk", "expected"),
    [
        # text: one-token blocks -> lower triangle
        ([0, 0, 0], [0, 1, 2], [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
        # a 2-token block is bidirectional inside, causal across
        ([0, 0, 0, 0], [0, 1, 1, 2], [[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]]),
        # two documents never see each other
        ([0, 0, 1, 1], [0, 1, 2, 3], [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]),
    ],
)
def test_mask_predicate(doc, blk, expected):
    d = torch.tensor([doc])
    b = torch.tensor([blk])
    assert allowed(d, b, d, b)[0].int().tolist() == expected


def test_mask_fast_paths():
    t = torch.arange(6)[None]
    zeros = torch.zeros(1, 6, dtype=torch.long)
    assert build_mask(zeros, t, zeros, t).is_causal
    # a decode step over a cache sees everything
    one = build_mask(zeros[:, :1], t[:, -1:] + 1, torch.zeros(1, 7, dtype=torch.long), torch.arange(7)[None])
    assert one.dense_B1TS is None and not one.is_causal
    two_docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert build_mask(two_docs, t, two_docs, t).dense_B1TS is not None


@pytest.mark.parametrize("seed", range(6))
def test_mask_of_a_few_queries_over_a_cache_is_the_predicate(seed):
    """The small-query path (dense mask first, dropped when it allows everything) against the
    predicate, for padded rows, several documents and multi-token blocks."""
    g = torch.Generator().manual_seed(seed)
    b, s = 2, 9
    for tq in (1, 2, 4):
        doc_k = torch.randint(-1, 2, (b, s), generator=g).sort(dim=1).values
        if seed % 2:
            doc_k.zero_()  # one document: everything visible
        blk_k = torch.arange(s).expand(b, s) // (1 + seed % 3)
        doc_q, blk_q = doc_k[:, -tq:], blk_k[:, -tq:]
        m = build_mask(doc_q, blk_q, doc_k, blk_k)
        expected = allowed(doc_q, blk_q, doc_k, blk_k)[:, None]
        got = m.dense_B1TS if m.dense_B1TS is not None else torch.ones_like(expected)
        assert not m.is_causal and torch.equal(got, expected)
        assert (m.dense_B1TS is None) == bool(expected.all())


def test_block_bidirectional_inside_block_in_the_model():
    m = _model()
    x = torch.randint(0, 64, (1, 8))
    blk = torch.tensor([[0, 1, 2, 3, 3, 3, 4, 5]])  # positions 3..5 form one block
    y = x.clone()
    y[0, 5] = (x[0, 5] + 1) % 64
    with torch.no_grad():
        a = m(x, block_ids_BT=blk).logits_BTV
        b = m(y, block_ids_BT=blk).logits_BTV
    assert torch.allclose(a[0, :3], b[0, :3], atol=1e-6)
    assert not torch.allclose(a[0, 3], b[0, 3])  # position 3 sees position 5 (same block)


def test_documents_are_isolated():
    m = _model()
    x = torch.randint(0, 64, (1, 12))
    doc = torch.tensor([[0] * 6 + [1] * 6])
    y = x.clone()
    y[0, :6] = torch.randint(0, 64, (6,))
    # document 1 is unaffected by document 0 (its positions restart at 0)
    pos = torch.cat([torch.arange(6), torch.arange(6)]).expand(3, 1, 12)
    with torch.no_grad():
        a = m(x, doc_ids_BT=doc, positions_3BT=pos).logits_BTV
        b = m(y, doc_ids_BT=doc, positions_3BT=pos).logits_BTV
    assert torch.allclose(a[0, 6:], b[0, 6:], atol=1e-6)


def test_sdpa_and_flex_agree():
    torch.manual_seed(1)
    sd = _model()
    fx = Ernie5Model(tiny_config(attn_impl="flex")).eval()
    fx.load_state_dict(sd.state_dict())
    x = torch.randint(0, 64, (2, 16))
    doc = torch.tensor([[0] * 9 + [1] * 7, [0] * 16])
    blk = torch.tensor([[0, 1, 1, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8, 8, 8, 9], list(range(16))])
    with torch.no_grad():
        a = sd(x, doc_ids_BT=doc, block_ids_BT=blk).logits_BTV
        b = fx(x, doc_ids_BT=doc, block_ids_BT=blk).logits_BTV
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("split", [[16], [10, 1, 1, 4], [1] * 16, [7, 9]])
def test_kv_cache_decode_equals_full_forward(split):
    m = _model()
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        full = m(x).logits_BTV
        cache = m.new_cache(2, 32)
        outs, at = [], 0
        for n in split:
            outs.append(m(x[:, at : at + n], cache=cache).logits_BTV)
            at += n
    assert torch.allclose(full, torch.cat(outs, dim=1), atol=1e-5)


def test_cache_truncate_rolls_back():
    m = _model()
    x = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        cache = m.new_cache(1, 16)
        m(x[:, :8], cache=cache)
        m(torch.tensor([[5, 6]]), cache=cache)  # speculative positions, then rejected
        cache.truncate(8)
        a = m(x[:, 8:], cache=cache).logits_BTV
        b = m(x).logits_BTV[:, 8:]
    assert torch.allclose(a, b, atol=1e-5)


def test_uni_rope_equals_1d_rope_for_text():
    head_dim, theta = 16, 10_000.0
    inv = inv_frequencies(head_dim, theta)
    pos = text_positions(1, 9)
    cos, sin = rope_cos_sin(pos, inv, (4, 2, 2))
    # the general (t, h, w) path with equal axes gives the same tables
    pos_general = pos.clone()
    pos_general[1, 0, 0] += 0  # same values, but force the (t, h, w) code path below
    from ernie5.model import rope

    axis = torch.repeat_interleave(torch.arange(3), torch.tensor([4, 2, 2]))
    ang3 = pos_general.permute(1, 2, 0).float()[..., axis] * inv
    cos3, sin3 = ang3.cos(), ang3.sin()
    assert rope is not None
    angles = torch.arange(9).float()[:, None] * inv
    assert torch.allclose(cos[0], angles.cos()) and torch.allclose(sin[0], angles.sin())
    assert torch.equal(cos, cos3) and torch.equal(sin, sin3)
    # the expanded positions (stride 0 over the axes) skip the equal-axes test: same tables
    assert pos.stride(0) == 0
    assert all(torch.equal(a, b) for a, b in zip(rope_cos_sin(pos.contiguous(), inv, (4, 2, 2)), (cos, sin)))


def test_uni_rope_uses_each_axis_for_its_section():
    inv = inv_frequencies(16, 100.0)
    pos = torch.tensor([[[2]], [[5]], [[7]]])  # t=2, h=5, w=7
    cos, _ = rope_cos_sin(pos, inv, (4, 2, 2))
    expected = torch.cat([2 * inv[:4], 5 * inv[4:6], 7 * inv[6:]]).cos()
    assert torch.allclose(cos[0, 0], expected)


def test_rope_preserves_norm():
    x = torch.randn(1, 2, 5, 16)
    inv = inv_frequencies(16, 1e4)
    cos, sin = rope_cos_sin(text_positions(1, 5), inv, (4, 2, 2))
    assert torch.allclose(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1), atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_short_bf16_training_attention_runs_a_bf16_forward_and_an_fp32_backward(causal):
    import torch.nn.functional as F

    from ernie5.model.attention import FP32_TRAIN_ATTN_MAX_KEYS, _sdpa
    from ernie5.model.mask import AttnMask

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
    ref = _sdpa(q, k, v, mask)
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    do = torch.randn(2, 4, 16, 8)
    out = _sdpa(qb, kb, vb, mask)
    out.backward(do.bfloat16())
    assert out.dtype == torch.bfloat16 and qb.grad.dtype == torch.bfloat16
    # The forward is bf16 attention on the bf16 inputs.
    with torch.no_grad():
        bf16 = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=dense, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out.detach().float(), bf16.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(out.float(), ref, atol=5e-2)
    # The backward is fp32 attention's gradient at the bf16-rounded inputs, rounded once.
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (qb, kb, vb))
    _sdpa(q32, k32, v32, mask).backward(do.bfloat16().float())
    for got, exp in ((qb, q32), (kb, k32), (vb, v32)):
        torch.testing.assert_close(got.grad.float(), exp.grad, atol=3e-2, rtol=3e-2)
    assert k.shape[2] <= FP32_TRAIN_ATTN_MAX_KEYS


@pytest.mark.skipif(kernels() is None, reason="fused CPU kernels did not build here")
@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_kernels_match_the_eager_model(monkeypatch, qk_norm):
    """A training forward + backward (norms, QK-norm + RoPE prologue, MoE activations) on the fused
    CPU kernels equals the eager PyTorch one."""
    torch.manual_seed(0)
    m = Ernie5Model(tiny_config(qk_norm=qk_norm)).train()
    x = torch.randint(0, 64, (2, 24))

    def loss_and_grads():
        m.zero_grad(set_to_none=True)
        out = m(x, targets_BT=x)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    fused_loss, fused_grads = loss_and_grads()
    monkeypatch.setenv("ERNIE5_KERNELS", "off")
    eager_loss, eager_grads = loss_and_grads()
    torch.testing.assert_close(fused_loss, eager_loss, atol=1e-5, rtol=1e-5)
    assert fused_grads.keys() == eager_grads.keys()
    for name, g in fused_grads.items():
        torch.testing.assert_close(g, eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)


needs_fused_attention = pytest.mark.skipif(
    kernels() is None or not kernels().attention_available(),
    reason="the fused attention kernel needs a build on a CPU with AVX512-BF16",
)


def _doc_mask(b: int, t: int, cuts: list[int]) -> torch.Tensor:
    """Causal attention inside documents that start at ``cuts``: ``(B, 1, T, T)`` bool."""
    doc = torch.zeros(t, dtype=torch.long)
    for c in cuts:
        doc[c:] += 1
    doc_bt = doc.expand(b, t)
    pos = torch.arange(t).expand(b, t)
    return allowed(doc_bt, pos, doc_bt, pos)[:, None]


@needs_fused_attention
@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("kind", ["causal", "documents", "none"])
@pytest.mark.parametrize("t,d", [(1, 16), (17, 32), (40, 64)])
def test_fused_attention_matches_fp32_attention(amx, kind, t, d):
    """The fused kernel (AMX and AVX512-BF16 paths) against fp32 SDPA at the same bf16 inputs:
    output, log-sum-exp and the three gradients, with GQA (4 query heads over 2 kv heads)."""
    import torch.nn.functional as F

    from ernie5.model.mask import AttnMask

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
    ref = F.scaled_dot_product_attention(
        q32, k32, v32, attn_mask=dense, is_causal=mask.is_causal, enable_gqa=True
    )
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
def test_training_attention_takes_the_fused_kernel_only_where_it_fits():
    from ernie5.model import attention
    from ernie5.model.mask import AttnMask

    causal = AttnMask(is_causal=True)
    q, k = torch.zeros(1, 4, 8, 32), torch.zeros(1, 2, 8, 32)
    assert attention._fused_attention_fits(q, k, causal)
    assert not attention._fused_attention_fits(q[..., :8], k[..., :8], causal)  # head dim 8
    assert not attention._fused_attention_fits(q, torch.zeros(1, 3, 8, 32), causal)  # 4 heads over 3
    assert not attention._fused_attention_fits(q, torch.zeros(1, 2, 9, 32), causal)  # causal needs T == S
    calls = []
    real = attention._FusedAttention.apply
    attention._FusedAttention.apply = lambda *a: calls.append(1) or real(*a)
    try:
        qb = torch.randn(1, 4, 8, 32).bfloat16().requires_grad_()
        kb, vb = torch.randn(1, 2, 8, 32).bfloat16(), torch.randn(1, 2, 8, 32).bfloat16()
        attention._sdpa(qb, kb, vb, causal).float().sum().backward()
        with torch.no_grad():  # inference calls the kernel's forward directly (no autograd Function)
            attention._sdpa(qb, kb, vb, causal)
    finally:
        attention._FusedAttention.apply = real
    assert calls == [1] and qb.grad is not None


@needs_fused_attention
@pytest.mark.parametrize("kind", ["causal", "documents", "cached prefix"])
def test_bf16_inference_attention_runs_the_fused_forward(monkeypatch, kind):
    """bf16 attention without gradients (prefill, scoring) runs the fused kernel's forward: causal,
    under a document mask, and for queries after a cached prefix (T < S, a dense mask); it matches
    fp32 SDPA at the same bf16 inputs. Past FUSED_INFER_MAX_KEYS keys, PyTorch's SDPA runs."""
    import torch.nn.functional as F

    from ernie5.model import attention
    from ernie5.model.mask import AttnMask

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
    monkeypatch.setattr(attention, "kernels", lambda: recorder)
    with torch.no_grad():
        got = attention._sdpa(q, k, v, mask)
    assert calls == [(t, s)]
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask.dense_B1TS, is_causal=mask.is_causal, enable_gqa=True
    )
    torch.testing.assert_close(got.float(), ref, atol=1e-2, rtol=1e-2)
    monkeypatch.setattr(attention, "FUSED_INFER_MAX_KEYS", s - 1)
    with torch.no_grad():
        fallback = attention._sdpa(q, k, v, mask)
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


@needs_fused_attention
def test_bf16_model_training_step_with_fused_attention_matches_pytorch_attention(monkeypatch):
    """A bf16 micro model's loss and gradients with every fused kernel (attention included) against
    ERNIE5_KERNELS=off (PyTorch's flash attention with the fp32 backward, eager everything). Every
    token uses all experts (top-k = E), so bf16 rounding differences cannot flip a routing choice,
    which would move whole expert gradients."""
    torch.manual_seed(0)
    cfg = tiny_config(d_model=64, moe=dict(top_k=8))
    assert cfg.dim_head % 16 == 0  # so the fused attention runs
    m = Ernie5Model(cfg).train().bfloat16()
    x = torch.randint(0, 64, (2, 24))

    def loss_and_grads():
        m.zero_grad(set_to_none=True)
        out = m(x, targets_BT=x)
        out.loss.backward()
        return out.loss.detach().float(), {
            n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None
        }

    fused_loss, fused_grads = loss_and_grads()
    monkeypatch.setenv("ERNIE5_KERNELS", "off")
    eager_loss, eager_grads = loss_and_grads()
    torch.testing.assert_close(fused_loss, eager_loss, atol=2e-2, rtol=1e-2)
    assert fused_grads.keys() == eager_grads.keys()
    for name, g in fused_grads.items():  # bf16 rounding differs op by op: compare whole tensors
        e = eager_grads[name]
        assert float((g - e).norm() / e.norm().clamp_min(1e-12)) < 0.05, name
