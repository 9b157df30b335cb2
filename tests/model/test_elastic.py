"""Elastic sub-models: spec strings, resolution errors, full == plain, extraction == masked forward."""

from __future__ import annotations

import pytest
import torch

from ernie5.model.elastic import Subnet, SubnetError, SubnetSpec, parse_subnet, resolve, select_layers
from ernie5.model.model import Ernie5Model
from ernie5.subnets.extract import extract_subnet, subnet_config
from ernie5.subnets.importance import compute_importance
from ernie5.subnets.params import count_instantiated, count_params
from tests.conftest import tiny_config


@pytest.mark.parametrize(
    ("text", "spec", "compact"),
    [
        ("full", SubnetSpec(), "full"),
        ("", SubnetSpec(), "full"),
        ("depth=0.75,width=0.5,top_k=2", SubnetSpec(depth=0.75, width=0.5, top_k=2), "d0.75-w0.5-k2"),
        ("d0.75-w0.5-k2", SubnetSpec(depth=0.75, width=0.5, top_k=2), "d0.75-w0.5-k2"),
        ("k1", SubnetSpec(top_k=1), "k1"),
        ("d6", SubnetSpec(depth=6), "d6"),
        ("depth=1.0", SubnetSpec(depth=1.0), "full"),
        ("d3-Lprefix", SubnetSpec(depth=3, layers="prefix"), "d3-Lprefix"),
        ("depth=3,layers=random:7", SubnetSpec(depth=3, layers="random:7"), "d3-Lrandom7"),
        ("w4-Eimportance", SubnetSpec(width=4, experts="importance"), "w4-Eimportance"),
    ],
)
def test_spec_strings_round_trip(text, spec, compact):
    parsed = parse_subnet(text)
    assert parsed == spec
    assert parsed.compact() == compact
    assert parse_subnet(parsed.compact()) == parsed
    assert parse_subnet(parsed.long()) == parsed
    assert "," not in compact and "=" not in compact and ":" not in compact


@pytest.mark.parametrize(
    "text",
    ["d0", "depth=0", "k0", "d1.5", "w-1", "x3", "depth=abc", "d0.5-Lsideways", "size=3", "d0.5,k1", "depth"],
)
def test_bad_spec_strings_are_one_line_errors(text):
    with pytest.raises(SubnetError) as e:
        parse_subnet(text)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "fragment"), [("k9", "top_k=9"), ("w1-k2", "top_k=2"), ("d9", "depth=9"), ("w20", "width=20")]
)
def test_subnets_outside_the_model_are_rejected(tiny_cfg, text, fragment):
    with pytest.raises(SubnetError, match=fragment):
        resolve(text, tiny_cfg)


def test_resolution_counts_and_fractions(tiny_cfg):
    s = resolve("d0.5-w0.5-k1", tiny_cfg)
    assert len(s.layers) == 2 and s.top_k == 1
    assert all(len(e) == 4 for e in s.experts)
    assert s.layers == (0, 3)  # "even" keeps the first and the last layer
    assert resolve("k0.25", tiny_cfg).top_k == 1


@pytest.mark.parametrize(
    ("n", "keep", "how", "expected"),
    [
        (8, 6, "prefix", (0, 1, 2, 3, 4, 5)),
        (8, 4, "even", (0, 2, 5, 7)),
        (8, 1, "even", (7,)),
        (8, 8, "even", tuple(range(8))),
    ],
)
def test_layer_selection(n, keep, how, expected):
    assert select_layers(n, keep, how) == expected


def test_random_layer_selection_keeps_first_and_last():
    kept = select_layers(10, 5, "random:3")
    assert kept[0] == 0 and kept[-1] == 9 and len(kept) == 5 and kept == select_layers(10, 5, "random:3")


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


def test_importance_selection_needs_statistics(tiny_cfg):
    with pytest.raises(SubnetError, match="importance"):
        resolve("d2-Limportance", tiny_cfg)
