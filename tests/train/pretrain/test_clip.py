import pytest
import torch
from torch import nn

from train.pretrain.clip import clip_and_step


def _setup(fused, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    return net, opt


@pytest.mark.parametrize("max_norm", [0.05, 100.0, 0.0])
@pytest.mark.parametrize("fused", [True, False])
def test_clip_and_step_equals_clip_grad_norm_then_step(fused, max_norm):
    ref, ref_opt = _setup(fused)
    got, got_opt = _setup(fused)
    x = torch.randn(16, 6)
    for _ in range(3):
        for net in (ref, got):
            (net(x) ** 2).sum().backward()
        want = float("nan")
        if max_norm > 0:
            want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
        ref_opt.step()
        norm = clip_and_step(got_opt, list(got.parameters()), max_norm)
        if max_norm > 0:
            assert norm == pytest.approx(want, rel=1e-5)
        assert not hasattr(got_opt, "grad_scale")
        for a, b in zip(ref.parameters(), got.parameters()):
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
        ref_opt.zero_grad()
        got_opt.zero_grad()
