"""Elastic sub-models in the forward: full == plain, no mutation, extraction == masked forward."""

from __future__ import annotations

import pytest
import torch

from ernie5.model.elastic import Subnet
from ernie5.model.model import Ernie5Model
from ernie5.subnets.extract import extract_subnet, subnet_config
from ernie5.subnets.importance import compute_importance
from ernie5.subnets.params import count_instantiated, count_params
from ernie5.subnets.spec import resolve
from tests.conftest import tiny_config


def test_full_subnet_is_bit_identical_to_plain_forward(tiny_cfg):
    m = Ernie5Model(tiny_cfg).eval()
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        a = m(x).logits_BTV
        b = m(x, subnet=Subnet.full(tiny_cfg)).logits_BTV
        c = m(x, subnet=resolve("full", tiny_cfg)).logits_BTV
    assert torch.equal(a, b) and torch.equal(a, c)


def test_forward_never_mutates_the_model(tiny_cfg):
    m = Ernie5Model(tiny_cfg).eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        m(torch.randint(0, 64, (1, 8)), subnet=resolve("d0.5-w0.5-k1", tiny_cfg))
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("spec", ["d0.5-w0.5-k1", "w4", "k1", "d3-Lprefix", "d2-Limportance-w5-Eimportance"])
def test_extracted_subnet_equals_masked_forward(score_func, spec):
    cfg = tiny_config(n_dense_layers=1, moe={"score_func": score_func})
    torch.manual_seed(0)
    m = Ernie5Model(cfg).eval()
    with torch.no_grad():
        for mod in m.modules():
            if hasattr(mod, "router_bias"):
                mod.router_bias.normal_(0, 0.05)
    x = torch.randint(0, 64, (2, 12))
    sub = resolve(spec, cfg, compute_importance(m, [x]))
    child = extract_subnet(m, sub).eval()
    with torch.no_grad():
        a = m(x, subnet=sub).logits_BTV
        b = child(x).logits_BTV
    assert torch.allclose(a, b, atol=1e-6)
    assert child.cfg == subnet_config(cfg, sub)
    n_child = count_instantiated(child)
    assert n_child == count_params(cfg, sub).total_params == count_params(child.cfg).total_params
    assert n_child < count_instantiated(m) if spec != "k1" else n_child == count_instantiated(m)
