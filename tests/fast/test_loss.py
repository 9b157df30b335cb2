"""The fused, chunked cross-entropy of :class:`ernie5.fast.loss.FastTextHead` against the reference,
:meth:`ernie5.model.head.TextHead.linear_cross_entropy` (fp32 logits and ``F.cross_entropy``)."""

import copy

import pytest
import torch

import ernie5.fast.loss as L
from ernie5.fast import apply_fast_paths
from ernie5.fast.loss import FastTextHead, linear_cross_entropy
from ernie5.model.head import TextHead
from ernie5.model.inputs import IGNORE


def _inputs(dtype, n=301, d=24, v=97, seed=0):
    """Hidden rows, a fast text head in ``dtype`` and its weight, targets with IGNORE rows, row weights."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    head = apply_fast_paths(TextHead(d, v).to(dtype))
    assert isinstance(head, FastTextHead)
    w = head.weight
    with torch.no_grad():
        w.copy_((torch.randn(v, d, generator=g) * 0.3).to(dtype))
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = IGNORE
    wts = torch.rand(n, generator=g) + 0.5
    return h, head, w, t, wts


def _reference(head, h, t, wts):
    """The model's loss of the same head: :meth:`TextHead.linear_cross_entropy`."""
    return TextHead.linear_cross_entropy(head, h, t, wts)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_matches_reference_loss_nll_and_grads(monkeypatch, dtype, tol, weighted):
    monkeypatch.setattr(L, "CHUNK_ROWS", 64)  # several chunks and a ragged last one
    h, head, w, t, wts = _inputs(dtype)
    wts = wts if weighted else None
    loss_r, nll_r = _reference(head, h, t, wts)
    (loss_r * 3.0).backward()
    gh_r, gw_r = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    loss_f, nll_f = head.linear_cross_entropy(h, t, wts)
    (loss_f * 3.0).backward()
    assert loss_f.dtype == torch.float32 and nll_f.dtype == torch.float32
    assert torch.allclose(loss_f, loss_r, atol=tol, rtol=tol)
    assert torch.allclose(nll_f, nll_r, atol=tol, rtol=tol)
    assert bool((nll_f[t == IGNORE] == 0).all())
    assert torch.allclose(h.grad.float(), gh_r.float(), atol=tol, rtol=tol)
    assert torch.allclose(w.grad.float(), gw_r.float(), atol=tol, rtol=tol)


def test_fused_under_bf16_autocast_with_fp32_weights_gives_fp32_grads():
    # Under autocast the logits are bf16 while h and W stay fp32: the backward must cast, not fail.
    h, head, w, t, wts = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_r, _ = _reference(head, h, t, wts)
    loss_r.backward()
    gh_r, gw_r = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_f, _ = head.linear_cross_entropy(h, t, wts)
    loss_f.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert torch.allclose(loss_f, loss_r, atol=2e-2, rtol=2e-2)
    assert torch.allclose(h.grad, gh_r, atol=2e-2, rtol=2e-2)
    assert torch.allclose(w.grad, gw_r, atol=2e-2, rtol=2e-2)


def test_without_grad_the_fused_path_is_not_taken_and_values_agree(monkeypatch):
    h, head, w, t, wts = _inputs(torch.float32)
    with torch.no_grad():
        ref = _reference(head, h, t, wts)

    def fused(*args):
        raise AssertionError("the fused autograd function ran without a gradient to compute")

    monkeypatch.setattr(L._FusedLinearCE, "apply", fused)
    with torch.no_grad():
        got = linear_cross_entropy(h, w, t, wts)
    assert not got[0].requires_grad
    assert torch.allclose(got[0], ref[0], atol=1e-6) and torch.allclose(got[1], ref[1], atol=1e-6)


def test_all_ignored_gives_zero_loss_and_zero_grads():
    h, head, w, t, _ = _inputs(torch.float32, n=10)
    t[:] = IGNORE
    loss, nll = head.linear_cross_entropy(h, t, None)
    loss.backward()
    assert float(loss.detach()) == 0.0 and bool((nll == 0).all())
    assert float(h.grad.abs().sum()) == 0.0 and float(w.grad.abs().sum()) == 0.0


def test_fast_model_loss_and_gradients_equal_the_eager_model():
    """Through a whole model: the fast head's fused loss and the gradients it sends back equal the
    eager model's (fp32 logits and ``F.cross_entropy``)."""
    from ernie5.config import from_dict, read_yaml
    from ernie5.model.config import ModelConfig
    from ernie5.model.model import Ernie5Model
    from ernie5.presets import resolve_config_path

    cfg = from_dict(ModelConfig, read_yaml(resolve_config_path("micro"))["model"])
    torch.manual_seed(0)
    eager = Ernie5Model(cfg)
    fast = apply_fast_paths(copy.deepcopy(eager))
    assert isinstance(fast.head, FastTextHead) and not isinstance(eager.head, FastTextHead)
    ids = torch.randint(16, cfg.vocab_size, (2, 17))
    tgt = ids[:, 1:].clone()
    tgt[0, :3] = IGNORE
    losses = []
    for m in (eager, fast):
        out = m(ids[:, :-1], targets=tgt)
        (out.losses.text + out.losses.mtp[0]).backward()
        losses.append((out.losses.text.detach(), out.losses.mtp[0].detach()))
    assert torch.allclose(losses[0][0], losses[1][0], atol=1e-5)
    assert torch.allclose(losses[0][1], losses[1][1], atol=1e-5)
    for name in ("head.weight", "tok_emb.weight", "layers.0.attn.wqkv.weight"):
        ge, gf = eager.get_parameter(name).grad, fast.get_parameter(name).grad
        assert torch.allclose(gf, ge, atol=1e-5, rtol=1e-4), name
        assert float(ge.abs().sum()) > 0, name
