"""Strict config loading: unknown keys, wrong types and out-of-range values are one-line errors."""

from __future__ import annotations

import copy
import dataclasses
import typing

import pytest
import yaml

from ernie5.config import ConfigError, apply_overrides, dump, from_dict, load, parse_scalar, read_yaml
from ernie5.model.config import ModelConfig, MoEConfig
from ernie5.presets import preset_names, resolve_config_path
from train.common.optim import OptimConfig
from train.pretrain.config import RunConfig, TrainConfig


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


def _assert_loaded(cfg, data: dict, prefix: str = "") -> None:
    """Every field of ``cfg`` holds what ``data`` (a YAML mapping) says, with its annotated type,
    nested dataclasses included, and every field ``data`` leaves out holds its default."""
    assert dataclasses.is_dataclass(cfg), prefix
    hints = typing.get_type_hints(type(cfg))
    fields = dataclasses.fields(cfg)
    retired = getattr(type(cfg), "RETIRED", {})
    assert set(data) <= {f.name for f in fields} | set(retired), prefix
    for f in fields:
        key, value, tp = f"{prefix}{f.name}", getattr(cfg, f.name), hints[f.name]
        if f.name not in data:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            assert value == default and type(value) is type(default), key
            continue
        raw = data[f.name]
        if dataclasses.is_dataclass(tp):
            assert type(value) is tp and isinstance(raw, dict), key
            _assert_loaded(value, raw, f"{key}.")
        elif typing.get_origin(tp) is tuple:
            assert type(value) is tuple and list(value) == list(raw), key
            item = typing.get_args(tp)[0]
            assert all(type(v) is item for v in value), key
        elif tp is float:
            assert type(value) is float and value == raw, key  # YAML's `1` loads as 1.0
        elif typing.get_origin(tp) is dict:
            assert type(value) is dict and value == raw, key
        else:
            assert type(value) is type(raw) and value == raw, key


def test_defaults_load_as_the_dataclass_defaults():
    cfg = load(RunConfig, None, [])
    assert cfg == RunConfig()
    assert type(cfg.model) is ModelConfig and type(cfg.model.moe) is MoEConfig
    assert type(cfg.train) is TrainConfig and type(cfg.optim) is OptimConfig
    assert cfg.optim.betas == (0.9, 0.95) and type(cfg.optim.betas) is tuple
    assert cfg.model.moe.top_k == 2 and cfg.train.dtype == "bf16"
    _assert_loaded(cfg, {})


RUN_PRESETS = [n for n in preset_names() if not n.startswith("study_")]
"""The run presets (``study_*`` are ``ernie5 study`` configs, tested in tests/jobs)."""


@pytest.mark.parametrize("name", RUN_PRESETS)
def test_presets_load_their_values(name):
    path = resolve_config_path(name)
    cfg = load(RunConfig, path)
    assert type(cfg) is RunConfig
    _assert_loaded(cfg, read_yaml(path))


@pytest.mark.parametrize("name", RUN_PRESETS)
def test_presets_round_trip(name, tmp_path):
    cfg = load(RunConfig, resolve_config_path(name))
    assert from_dict(RunConfig, yaml.safe_load(dump(cfg))) == cfg
    again = tmp_path / f"{name}.yaml"
    again.write_text(dump(cfg))
    assert load(RunConfig, again) == cfg  # load(dump(load(f))) == load(f), through a file
    assert dump(load(RunConfig, again)) == dump(cfg)
    assert "dispatch" not in dump(cfg)  # the retired key is never written


def test_retired_moe_dispatch_auto_still_loads(tmp_path):
    """``model.moe.dispatch`` is retired: every file written before holds ``auto``, which loads."""
    assert "dispatch" not in {f.name for f in dataclasses.fields(MoEConfig)}
    base = read_yaml(resolve_config_path("micro"))
    old = copy.deepcopy(base)
    old["model"]["moe"]["dispatch"] = "auto"
    want = from_dict(RunConfig, base)
    assert from_dict(RunConfig, old) == want
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    assert load(RunConfig, path) == want
    assert load(RunConfig, resolve_config_path("micro"), ["model.moe.dispatch=auto"]) == want
    assert from_dict(ModelConfig, {"moe": {"dispatch": "auto"}}) == ModelConfig()


@pytest.mark.parametrize("value", ["sorted", "loop", "grouped", "gather", "AUTO", None, 1])
def test_retired_moe_dispatch_other_values_are_one_line_errors(value, tmp_path):
    data = read_yaml(resolve_config_path("micro"))
    data["model"]["moe"]["dispatch"] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    for build in (lambda: from_dict(RunConfig, data), lambda: load(RunConfig, path)):
        with pytest.raises(ConfigError) as e:
            build()
        msg = str(e.value)
        assert msg.startswith(f"model.moe.dispatch={value!r}: the key is retired") and "'auto'" in msg
        assert "\n" not in msg
    with pytest.raises(ConfigError, match=r"^moe\.dispatch='sorted': the key is retired"):
        from_dict(ModelConfig, {"moe": {"dispatch": "sorted"}})
    with pytest.raises(ConfigError, match="unknown key 'model.dispatch'"):  # retired under moe only
        from_dict(RunConfig, {"model": {"dispatch": "auto"}})


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Inner:
    a: int = 1
    b: int = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=lambda: _Inner(a=10, b=20))
    plain: _Inner = dataclasses.field(default_factory=_Inner)


def test_a_partial_nested_mapping_keeps_the_fields_own_defaults():
    # the keys left out come from the field's default (its factory), not from the nested class's
    assert from_dict(_Outer, {"inner": {"a": 5}}).inner == _Inner(a=5, b=20)
    assert from_dict(_Outer, {"plain": {"b": 7}}).plain == _Inner(a=1, b=7)
    assert from_dict(_Outer, {}) == _Outer()
    with pytest.raises(ConfigError, match="unknown key 'inner.c'"):
        from_dict(_Outer, {"inner": {"c": 1}})


def test_an_rl_learning_rate_override_keeps_the_rl_optimizer_defaults():
    from train.rl.config import RLRunConfig

    default = RLRunConfig()
    cfg = load(RLRunConfig, None, ["optim.grad_clip=0.5", "elastic.min_depth=0.5"])
    assert cfg.optim == dataclasses.replace(default.optim, grad_clip=0.5)  # lr 5e-5, no weight decay
    assert cfg.elastic.enabled is False and cfg.elastic.min_depth == 0.5
