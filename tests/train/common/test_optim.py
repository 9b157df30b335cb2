"""One AdamW config and one parameter-group rule for every trainer."""

from __future__ import annotations

import torch
from torch import nn

from train.common.optim import BACKBONE_DECAY, OptimConfig, make_adamw, make_optimizer, param_groups


def _names(module: nn.Module, group: dict) -> list[str]:
    ids = {id(p) for p in group["params"]}
    return [n for n, p in module.named_parameters() if id(p) in ids]


def test_backbone_decays_matrices_but_not_routers(tiny_cfg):
    from ernie5.model.model import Ernie5Model

    model = Ernie5Model(tiny_cfg)
    decay, rest = param_groups(model, 0.1, **BACKBONE_DECAY)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert not any("router" in n for n in _names(model, decay))
    assert any("router" in n for n in _names(model, rest))
    assert len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))
    opt = make_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1))
    assert [len(g["params"]) for g in opt.param_groups] == [len(decay["params"]), len(rest["params"])]


def test_min_ndim_picks_what_decays():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(4, 2), nn.LayerNorm(2))
    two = param_groups(net, 0.5, min_ndim=2)
    four = param_groups(net, 0.5, min_ndim=4)
    assert _names(net, two[0]) == ["0.weight", "1.weight"]  # conv and linear weights
    assert _names(net, four[0]) == ["0.weight"]  # conv kernels only (the vision tokenizer's rule)
    assert _names(net, four[1]) == ["0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]


def test_unfused_adamw_is_torchs_default_step():
    """The side trainers' ``fused=False`` takes the very step ``torch.optim.AdamW``'s defaults take."""
    torch.manual_seed(0)
    a = nn.Linear(8, 4)
    b = nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    cfg = OptimConfig(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, fused=False)
    opts = [
        make_adamw(param_groups(a, 0.1, min_ndim=2), cfg),
        torch.optim.AdamW(param_groups(b, 0.1, min_ndim=2), lr=1e-2, betas=(0.8, 0.99)),
    ]
    x = torch.randn(16, 8)
    for _ in range(3):
        for net, opt in zip((a, b), opts, strict=True):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
