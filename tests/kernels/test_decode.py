"""Few-row decoding kernels (``cpu_decode.cpp``) against fp64 and eager references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ernie5.fast.moe import experts_gather
from ernie5.kernels import kernels, ops
from ernie5.model.moe import RouterOutput

needs_rows = pytest.mark.skipif(
    kernels() is None or not kernels().rows_kernels_available(), reason="no AVX-512F kernel build here"
)
DTYPES = [torch.float32, torch.bfloat16]


def _on_one_thread(fn):
    """``fn()`` with PyTorch (and the kernels) on one thread."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn()
    finally:
        torch.set_num_threads(threads)


def _ulp_bound(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half a unit in the last place of ``dtype`` at ``ref`` (the rounding of one correct sum),
    plus fp32 summation slack."""
    eps = torch.finfo(dtype).eps
    return ref.abs() * eps + 1e-6


@needs_rows
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 384, 256), (2, 256, 256), (3, 4096, 256), (4, 7, 48), (1, 1, 16)])
def test_linear_rows_is_a_correctly_rounded_fp32_sum(dtype, shape):
    m, n, k = shape
    torch.manual_seed(0)
    x, w = torch.randn(m, k).to(dtype), (torch.randn(n, k) * 0.1).to(dtype)
    ref = F.linear(x.double(), w.double())
    got = kernels().linear_rows(x, w)
    assert got.dtype == dtype and got.shape == (m, n)
    assert ((got.double() - ref).abs() <= _ulp_bound(ref, dtype)).all()
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), **({"atol": 0, "rtol": 0.01}))


@needs_rows
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_each_row_independent_of_batch_and_threads(dtype):
    """A token's logits must not depend on what it is decoded with, nor on the thread count."""
    torch.manual_seed(1)
    x, w = torch.randn(4, 256).to(dtype), torch.randn(4093, 256).to(dtype)  # a ragged last block
    together = kernels().linear_rows(x, w)
    alone = _on_one_thread(lambda: [kernels().linear_rows(x[i : i + 1].contiguous(), w) for i in range(4)])
    assert torch.equal(together, torch.cat(alone))


@needs_rows
def test_linear_rows_rejects_what_it_cannot_take():
    k = kernels()
    with pytest.raises(RuntimeError, match="needs 1-4 rows"):
        k.linear_rows(torch.randn(5, 32), torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="in_features % 16"):
        k.linear_rows(torch.randn(1, 24), torch.randn(8, 24))
    with pytest.raises(RuntimeError, match="do not match"):
        k.linear_rows(torch.randn(1, 32), torch.randn(8, 48))


@needs_rows
def test_ops_linear_takes_the_kernel_only_without_gradients(monkeypatch):
    calls = []
    real = kernels()

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def linear_rows(self, *args):
            calls.append(1)
            return real.linear_rows(*args)

    monkeypatch.setattr(ops, "kernels", Counting)
    x = torch.randn(2, 1, 64)
    w = torch.randn(32, 64, requires_grad=True)
    y = ops.linear(x, w)  # grad needed: F.linear, and the gradient flows
    y.sum().backward()
    assert not calls and w.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(ops.linear(x, w), F.linear(x, w))
        assert calls == [1]
        ops.linear(torch.randn(5, 64), w)  # 5 rows: F.linear
        ops.linear(torch.randn(1, 40), torch.randn(8, 40))  # in_features not a multiple of 16
    assert calls == [1]


def _gather_eager(x, ids, gates, w13, w2):
    return experts_gather(x, w13, w2, RouterOutput(ids, gates, None, None, None))


@needs_rows
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,a", [(1, 1), (1, 2), (2, 2), (4, 4), (3, 1)])
def test_expert_rows_matches_the_gathered_experts(dtype, m, a):
    torch.manual_seed(m * 10 + a)
    e, d, f = 16, 64, 48
    w13, w2 = (torch.randn(e, 2 * f, d) * 0.1).to(dtype), (torch.randn(e, d, f) * 0.1).to(dtype)
    x = torch.randn(m, d).to(dtype)
    ids = torch.stack([torch.randperm(e)[:a] for _ in range(m)])
    gates = torch.rand(m, a).softmax(-1)
    got = kernels().expert_rows(x, ids, gates, w13, w2)
    ref = _gather_eager(x.double(), ids, gates.double(), w13.double(), w2.double())
    tol = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2e-2)}[dtype]
    torch.testing.assert_close(got.double(), ref, **tol)
    with torch.no_grad():  # the MoE gather path without gradients is this kernel
        assert torch.equal(_gather_eager(x, ids, gates, w13, w2), got)


@needs_rows
def test_expert_rows_each_token_independent_of_batch_and_threads():
    torch.manual_seed(3)
    e, d, f = 8, 256, 256  # large enough to run on every thread
    w13, w2 = torch.randn(e, 2 * f, d).bfloat16(), torch.randn(e, d, f).bfloat16()
    x, ids, gates = torch.randn(3, d).bfloat16(), torch.randint(0, e, (3, 2)), torch.rand(3, 2)
    together = kernels().expert_rows(x, ids, gates, w13, w2)
    alone = _on_one_thread(
        lambda: [
            kernels().expert_rows(x[i : i + 1], ids[i : i + 1], gates[i : i + 1], w13, w2) for i in range(3)
        ]
    )
    assert torch.equal(together, torch.cat(alone))


@needs_rows
def test_expert_rows_rejects_bad_ids_and_shapes():
    k = kernels()
    w13, w2 = torch.randn(4, 32, 16), torch.randn(4, 16, 16)
    with pytest.raises(RuntimeError, match=r"expert id 4 outside \[0, 4\)"):
        k.expert_rows(torch.randn(1, 16), torch.tensor([[4]]), torch.ones(1, 1), w13, w2)
    with pytest.raises(RuntimeError, match="do not match"):
        k.expert_rows(torch.randn(1, 32), torch.tensor([[0]]), torch.ones(1, 1), w13, w2)
    with pytest.raises(RuntimeError, match="must both be"):
        k.expert_rows(torch.randn(1, 16), torch.tensor([[0, 1]]), torch.ones(1, 1), w13, w2)


def _attention_fp64(q, k, v, allowed_B1TS, causal):
    """SDPA in float64 with grouped-query heads; a row that sees no key gives zero."""
    b, h, t, dh = q.shape
    kh, s = k.shape[1], k.shape[2]
    k, v = k.double().repeat_interleave(h // kh, 1), v.double().repeat_interleave(h // kh, 1)
    scores = q.double() @ k.transpose(-1, -2) / dh**0.5
    visible = torch.ones(b, 1, t, s, dtype=torch.bool)
    if allowed_B1TS is not None:
        visible = visible & allowed_B1TS
    if causal:
        visible = visible & torch.ones(t, s, dtype=torch.bool).tril(s - t)
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    return p @ v


def _cache_views(b, kh, s, dh, dtype, max_len=40):
    """Keys and values as a KV cache holds them: the first ``s`` positions of a longer buffer."""
    kbuf, vbuf = torch.randn(b, kh, max_len, dh).to(dtype), torch.randn(b, kh, max_len, dh).to(dtype)
    return kbuf[:, :, :s], vbuf[:, :, :s]


@needs_rows
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "b,t,h,kh,dh", [(1, 1, 8, 2, 32), (2, 1, 4, 4, 16), (1, 2, 4, 2, 64), (2, 2, 2, 1, 128)]
)
@pytest.mark.parametrize("masking", ["none", "causal", "dense"])
def test_attend_rows_matches_fp64_attention(dtype, b, t, h, kh, dh, masking):
    torch.manual_seed(b + t + h + dh)
    s = 29
    q = torch.randn(b, h, t, dh).to(dtype)
    k, v = _cache_views(b, kh, s, dh, dtype)
    allowed_B1TS = None
    if masking == "dense":  # row 0 sees keys 3.., the others everything but some early keys
        allowed_B1TS = torch.rand(b, 1, t, s) > 0.3
        allowed_B1TS[..., -t:] = True
        allowed_B1TS[0, :, :, :3] = False
    got = ops.attend_rows(q, k, v, allowed_B1TS, masking == "causal")
    assert got.shape == (b, h, t, dh) and got.dtype == dtype
    assert got.transpose(1, 2).is_contiguous()  # the output projection reads it without a copy
    ref = _attention_fp64(q, k, v, allowed_B1TS, masking == "causal")
    # Values are O(1): fp32 within summation slack, bf16 within one rounding of the output.
    tol = {torch.float32: dict(atol=2e-6, rtol=1e-5), torch.bfloat16: dict(atol=4e-3, rtol=8e-3)}[dtype]
    torch.testing.assert_close(got.double(), ref, **tol)


@needs_rows
def test_attend_rows_row_independent_of_batch_threads_and_cache_length():
    """A query's output depends only on the keys it sees: not on its batch, the thread count, or
    how long the buffer behind the cache view is."""
    torch.manual_seed(5)
    q = torch.randn(2, 8, 1, 32).bfloat16()
    k, v = _cache_views(2, 2, 300, 32, torch.bfloat16, max_len=512)  # enough work for every thread
    together = ops.attend_rows(q, k, v, None, False)
    alone = _on_one_thread(
        lambda: [
            ops.attend_rows(q[i : i + 1], k[i : i + 1].contiguous(), v[i : i + 1].contiguous(), None, False)
            for i in range(2)
        ]
    )
    assert torch.equal(together, torch.cat(alone))


@needs_rows
def test_attend_rows_gives_a_row_without_keys_zero_output():
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16)
    none_allowed = torch.zeros(1, 1, 1, 5, dtype=torch.bool)
    out = ops.attend_rows(q, k, v, none_allowed, False)
    assert torch.equal(out, torch.zeros_like(out))


@needs_rows
def test_attend_rows_rejects_what_it_cannot_take():
    kern = kernels()
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16)
    nomask = torch.empty(0, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kern.attend_rows(
            torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), nomask, False
        )
    with pytest.raises(RuntimeError, match="do not match"):
        kern.attend_rows(torch.randn(1, 3, 1, 16), k, k, nomask, False)  # 3 heads over 2 kv heads
    with pytest.raises(RuntimeError, match="one shape and layout"):
        kern.attend_rows(q, k, torch.randn(1, 2, 6, 16), nomask, False)
    with pytest.raises(RuntimeError, match="expected B\\*Tq\\*S"):
        kern.attend_rows(q, k, k, torch.ones(1, 1, 1, 4, dtype=torch.bool), False)
    with pytest.raises(RuntimeError, match="one dtype"):
        kern.attend_rows(q, k.bfloat16(), k.bfloat16(), nomask, False)


@needs_rows
def test_attend_takes_attend_rows_only_for_a_few_rows_without_gradients(monkeypatch):
    from ernie5.fast.attention import attend
    from ernie5.model.mask import AttnMask

    calls = []
    real = ops.attend_rows
    monkeypatch.setattr(ops, "attend_rows", lambda *a: calls.append(1) or real(*a))
    k, v, q1 = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 4, 1, 16)
    with torch.no_grad():
        one = attend(q1, k, v, AttnMask())
        assert calls == [1]
        attend(torch.randn(1, 4, 5, 16), k, v, AttnMask())  # 5 query rows: SDPA
        assert calls == [1]
    q = torch.randn(1, 4, 1, 16, requires_grad=True)
    out = attend(q, k, v, AttnMask())  # a gradient: SDPA
    out.sum().backward()
    assert calls == [1] and q.grad is not None
    ref = F.scaled_dot_product_attention(q1, k, v, enable_gqa=True)
    torch.testing.assert_close(one, ref, atol=2e-6, rtol=1e-5)
