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
