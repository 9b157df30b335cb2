"""Strict config loading: unknown keys, wrong types and out-of-range values are one-line errors."""

from __future__ import annotations

import pytest

from ernie5.config import ConfigError, apply_overrides, dump, from_dict, load, parse_scalar
from ernie5.presets import preset_names, resolve_config_path
from train.config import RunConfig


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"model": {"d_modle": 3}}, "unknown key 'model.d_modle'"),
        ({"model": {"moe": {"top_k": 99}}}, "model.moe.top_k=99"),
        ({"model": {"n_layers": "eight"}}, "model.n_layers: 'eight' is not an int"),
        ({"model": {"qk_norm": "yes"}}, "model.qk_norm"),
        ({"train": {"dtype": "fp8"}}, "train.dtype"),
        ({"train": {"steps": 0}}, "train.steps=0"),
        ({"optim": {"betas": [0.9]}}, "optim.betas"),
        ({"data": {"seq_len": 4096}}, "exceeds model.max_seq_len"),
        ({"elastic": {"p_full_depth": 1.5}}, "elastic.p_full_depth=1.5"),
        ({"model": {"n_heads": 8, "n_kv_heads": 3}}, "model.n_kv_heads=3"),
        ({"bogus": 1}, "unknown key 'bogus'"),
    ],
)
def test_bad_values_name_the_dotted_key(data, fragment):
    with pytest.raises(ConfigError) as e:
        from_dict(RunConfig, data)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", preset_names())
def test_presets_round_trip(name):
    cfg = load(RunConfig, resolve_config_path(name))
    assert load(RunConfig, None, []) is not None
    import yaml

    assert from_dict(RunConfig, yaml.safe_load(dump(cfg))) == cfg


def test_set_overrides():
    cfg = load(
        RunConfig, resolve_config_path("micro"), ["train.steps=7", "optim.lr=1e-3", "model.moe.top_k=1"]
    )
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-3 and cfg.model.moe.top_k == 1
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        apply_overrides({}, ["train.steps"])


@pytest.mark.parametrize(
    ("text", "value"), [("1e-3", 1e-3), ("true", True), ("7", 7), ("[1, 2]", [1, 2]), ("abc", "abc")]
)
def test_parse_scalar(text, value):
    assert parse_scalar(text) == value


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load(RunConfig, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load(RunConfig, bad)
    with pytest.raises(ConfigError, match="unknown preset"):
        resolve_config_path("tiny-but-missing")
