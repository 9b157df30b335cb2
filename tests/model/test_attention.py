"""Attention maths (the eager model): causality, block masks, document isolation, SDPA vs flex,
KV cache, Uni-RoPE.

The attention back-ends of :mod:`ernie5.fast.attention` are tested against the eager
``Attention.attend`` in ``tests/fast/test_attention.py``.
"""

from __future__ import annotations

import pytest
import torch

from ernie5.model.inputs import Inputs
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
        a = m(Inputs(x, block_ids_BT=blk)).logits_BTV
        b = m(Inputs(y, block_ids_BT=blk)).logits_BTV
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
        a = m(Inputs(x, doc_ids_BT=doc, positions_3BT=pos)).logits_BTV
        b = m(Inputs(y, doc_ids_BT=doc, positions_3BT=pos)).logits_BTV
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
        a = sd(Inputs(x, doc_ids_BT=doc, block_ids_BT=blk)).logits_BTV
        b = fx(Inputs(x, doc_ids_BT=doc, block_ids_BT=blk)).logits_BTV
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
    angles = torch.arange(9).float()[:, None] * inv
    assert torch.allclose(cos[0], angles.cos()) and torch.allclose(sin[0], angles.sin())
    # The general (t, h, w) path gives text the same tables: one more token, whose h differs, makes
    # the axes unequal, so the whole batch takes that path.
    extra = torch.tensor([9, 3, 9]).view(3, 1, 1)
    pos_general = torch.cat([pos, extra], dim=2)
    cos_g, sin_g = rope_cos_sin(pos_general, inv, (4, 2, 2))
    axis = torch.repeat_interleave(torch.arange(3), torch.tensor([4, 2, 2]))
    ang3 = pos_general.permute(1, 2, 0).float()[..., axis] * inv
    assert torch.equal(cos_g, ang3.cos()) and torch.equal(sin_g, ang3.sin())
    assert not torch.allclose(cos_g[0, 9], (9 * inv).cos())  # the extra token's h section: not 1-D RoPE
    assert torch.equal(cos_g[:, :9], cos) and torch.equal(sin_g[:, :9], sin)
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
def test_gqa_attention_equals_attention_over_repeated_kv_heads(causal):
    """``Attention.attend``: each kv head serves ``H / K`` consecutive query heads, softmax(QK^T /
    sqrt(Dh)) V under the mask."""
    from ernie5.model.attention import Attention
    from ernie5.model.mask import AttnMask

    torch.manual_seed(2)
    attn = Attention(tiny_config())
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    dense = None if causal else torch.rand(2, 1, 6, 6) > 0.3
    if dense is not None:
        dense[..., 0] = True  # every query sees a key
    got = attn.attend(q, k, v, AttnMask(dense_B1TS=dense, is_causal=causal))
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ kr.transpose(-1, -2) / 8**0.5
    allow = torch.ones(6, 6, dtype=torch.bool).tril() if causal else dense
    want = scores.masked_fill(~allow, float("-inf")).softmax(-1) @ vr
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
