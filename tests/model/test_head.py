"""The text head's reference loss (:meth:`ernie5.model.head.TextHead.linear_cross_entropy`, fp32 logits
and ``F.cross_entropy``): the weighted next-token cross-entropy the fused loss of
:mod:`ernie5.fast.loss` is tested against (``tests/fast/test_loss.py``)."""

import torch
import torch.nn.functional as F

from ernie5.model.head import TextHead, row_weights
from ernie5.model.inputs import IGNORE, Targets


def _head_and_rows(n=301, d=24, v=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).requires_grad_()
    head = TextHead(d, v)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, d, generator=g) * 0.3)
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = IGNORE
    wts = torch.rand(n, generator=g) + 0.5
    return h, head, t, wts


def test_row_weights_are_zero_without_a_target():
    t = torch.tensor([3, IGNORE, 0, IGNORE])
    assert torch.equal(row_weights(t, None), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    w = torch.tensor([0.5, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    got = row_weights(t, w)
    assert got.dtype == torch.float32 and torch.equal(got, torch.tensor([0.5, 0.0, 3.0, 0.0]))


def test_loss_is_the_weighted_mean_nll_of_the_rows_with_a_target():
    h, head, t, wts = _head_and_rows()
    loss, nll = head.linear_cross_entropy(h, t, wts)
    logits = h.detach() @ head.weight.detach().t()
    picked = logits.log_softmax(-1).gather(1, t.clamp_min(0)[:, None]).squeeze(1)
    valid = t != IGNORE
    want_nll = torch.where(valid, -picked, 0.0)
    assert nll.dtype == torch.float32 and nll.shape == t.shape
    torch.testing.assert_close(nll, want_nll, atol=1e-5, rtol=1e-5)
    w = wts * valid
    torch.testing.assert_close(loss, (want_nll * w).sum() / w.sum(), atol=1e-6, rtol=1e-6)
    unweighted, _ = head.linear_cross_entropy(h, t, None)
    torch.testing.assert_close(
        unweighted, F.cross_entropy(logits, t, ignore_index=IGNORE), atol=1e-6, rtol=1e-6
    )


def test_loss_keeps_the_batch_shape_of_the_targets():
    h, head, t, wts = _head_and_rows(n=24)
    loss, nll_BT = head.loss(h.view(4, 6, -1), Targets(t.view(4, 6), wts.view(4, 6)))
    flat_loss, flat_nll = head.linear_cross_entropy(h, t, wts)
    assert nll_BT.shape == (4, 6)
    assert torch.equal(nll_BT.flatten(), flat_nll) and torch.equal(loss, flat_loss)


def test_all_ignored_gives_zero_loss_and_zero_grads():
    h, head, t, _ = _head_and_rows(n=10)
    t[:] = IGNORE
    loss, nll = head.linear_cross_entropy(h, t, None)
    loss.backward()
    assert float(loss.detach()) == 0.0 and bool((nll == 0).all())
    assert float(h.grad.abs().sum()) == 0.0 and float(head.weight.grad.abs().sum()) == 0.0


def test_model_loss_equals_naive_cross_entropy():
    from ernie5.config import from_dict, read_yaml
    from ernie5.model.config import ModelConfig
    from ernie5.model.model import Ernie5Model
    from ernie5.presets import resolve_config_path

    cfg = from_dict(ModelConfig, read_yaml(resolve_config_path("micro"))["model"])
    torch.manual_seed(0)
    model = Ernie5Model(cfg)
    ids = torch.randint(16, cfg.vocab_size, (2, 17))
    tgt = ids[:, 1:].clone()
    tgt[0, :3] = IGNORE
    out = model(ids[:, :-1], targets=tgt)
    naive = torch.nn.functional.cross_entropy(
        out.logits_BTV.float().flatten(0, 1), tgt.flatten(), ignore_index=IGNORE
    )
    assert torch.allclose(out.losses.text, naive, atol=1e-5)
    out.losses.text.backward()
    assert model.head.weight.grad is not None and model.tok_emb.weight.grad is not None
