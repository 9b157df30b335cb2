"""Sub-model specs: string forms, one-line parse errors, resolution against a config, selections."""

from __future__ import annotations

import pytest
import torch

from ernie5.model.model import Ernie5Model
from ernie5.store.checkpoint import load_checkpoint, save_checkpoint
from ernie5.subnets.spec import (
    SubnetError,
    SubnetSpec,
    needs_calibration,
    parse_subnet,
    resolve,
    resolve_specs,
    resolve_subnet,
    select_layers,
)
from ernie5.tokenizers.text import TextTokenizer
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


def test_importance_selection_needs_statistics(tiny_cfg):
    with pytest.raises(SubnetError, match="importance"):
        resolve("d2-Limportance", tiny_cfg)


@pytest.mark.parametrize(
    ("text", "needed"),
    [
        ("full", False),
        ("d2", False),
        ("d2-Limportance", True),
        ("w4-Eimportance", True),
        ("k1", False),
        ("d4-Limportance", False),  # all layers kept: nothing to select
        ("w8-Eimportance", False),  # all experts kept
    ],
)
def test_calibration_is_needed_only_for_a_reduced_importance_dimension(tiny_cfg, text, needed):
    assert needs_calibration(parse_subnet(text), tiny_cfg) is needed


def test_resolve_subnet_loads_the_checkpoint_only_for_calibration(tmp_path):
    cfg = tiny_config(vocab_size=300)
    torch.manual_seed(0)
    path = save_checkpoint(
        tmp_path / "ck", Ernie5Model(cfg), tokenizer=TextTokenizer.train(["hello world"] * 10, vocab_size=280)
    )
    missing = tmp_path / "nothing-here"  # never read when no calibration is needed
    assert resolve_subnet("d0.5-w0.5-k1", cfg, missing) == resolve("d0.5-w0.5-k1", cfg)
    assert resolve_subnet(None, cfg, missing) == resolve("full", cfg)
    (want,) = resolve_specs(["d2-Limportance-w4-Eimportance"], load_checkpoint(path))
    assert resolve_subnet("d2-Limportance-w4-Eimportance", cfg, path) == want
    with pytest.raises(SubnetError, match="importance"):
        resolve_subnet("d2-Limportance", cfg)  # no checkpoint: no statistics
