"""Generic strict loader for frozen-dataclass configs.

Configs are frozen dataclasses owned by the package that owns the concept
(`ernie5.model.config`, `train.pretrain.config`, ...). This module holds no fields: it only turns YAML
mappings and ``--set dotted.key=value`` overrides into those dataclasses, strictly:

* an unknown key is an error naming the dotted key and the valid keys;
* a value of the wrong type is an error naming the dotted key, the value and the expected type;
* an out-of-range value is rejected by the dataclass's own ``__post_init__``, whose
  ``ValueError`` is re-raised with the dotted prefix of where that dataclass sits;
* a key the dataclass has retired (its ``RETIRED`` mapping: key -> the value every file written
  before still holds) is skipped when it holds that value, so old checkpoints and run folders
  load, and is an error otherwise.

Every error is a :class:`ConfigError` with a one-line message.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

T = TypeVar("T")


def check(cond: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` unless ``cond``: what a config's ``__post_init__`` uses to reject a
    value (the loader turns it into a one-line error naming the dotted key)."""
    if not cond:
        raise ValueError(msg)


class ConfigError(ValueError):
    """A config value, key or file is invalid. The message is one line and names the dotted key."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is tuple:
        args = get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        k, v = get_args(tp)
        return f"mapping of {_type_name(k)} to {_type_name(v)}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert YAML shapes (list -> tuple)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {_type_name(tp)}")
        return value
    if origin in (types.UnionType, typing.Union):
        errors = []
        for arg in get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{key}: {value!r} is not a valid {_type_name(tp)}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: {value!r} is not null")
        return None
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: {value!r} is not a {_type_name(tp)}")
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: {value!r} is not a {_type_name(tp)}")
        kt, vt = get_args(tp)
        return {_coerce(k, kt, key): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for {tp.__name__}, got {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not a bool (use true/false)")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: {value!r} is not an int")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: {value!r} is not a float")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: {value!r} is not a string")
        return value
    raise ConfigError(f"{key}: unsupported annotation {tp!r}")  # a bug in a config class


def _field_default(f: dataclasses.Field) -> Any:
    """A field's default value (its factory called), or None when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _build(cls: type[T], data: dict[str, Any], prefix: str = "", base: Any = None) -> T:
    """``cls`` from ``data``; the keys ``data`` leaves out keep ``base``'s values (None: ``cls``'s
    defaults). A nested config given as a partial mapping starts from that field's own default, so
    ``optim.lr=...`` keeps the other values a ``field(default_factory=...)`` chose, not the nested
    class's defaults."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    retired = getattr(cls, "RETIRED", {})
    kwargs = {}
    for name, value in data.items():
        dotted = f"{prefix}.{name}" if prefix else str(name)
        if name in retired:
            if value != retired[name]:
                raise ConfigError(
                    f"{dotted}={value!r}: the key is retired; files written before may hold only "
                    f"{retired[name]!r} ({cls.__name__}.RETIRED says why)"
                )
            continue
        if name not in fields:
            valid = ", ".join(sorted(fields))
            raise ConfigError(f"unknown key {dotted!r} (valid keys: {valid})")
        hint = hints[name]
        if isinstance(value, dict) and dataclasses.is_dataclass(hint):
            default = getattr(base, name) if base is not None else _field_default(fields[name])
            if isinstance(default, hint):
                kwargs[name] = _build(hint, value, dotted, base=default)
                continue
        kwargs[name] = _coerce(value, hint, dotted)
    if base is not None:
        for name in fields:
            if name not in kwargs and name not in retired:
                kwargs[name] = getattr(base, name)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        where = f"{prefix}." if prefix else ""
        msg = str(e).splitlines()[0]
        raise ConfigError(f"{where}{msg}" if where and not msg.startswith(where) else msg) from None


def from_dict(cls: type[T], data: dict[str, Any] | None) -> T:
    """Build ``cls`` from a plain mapping, strictly."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping at the top level of {cls.__name__}, got {type(data).__name__}")
    return _build(cls, data)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain, YAML-safe mapping of a config dataclass (tuples become lists)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
        if isinstance(v, tuple | list):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(cfg)


def parse_scalar(text: str) -> Any:
    """Parse the right-hand side of ``--set key=value`` with YAML rules (``1e-3``, ``true``, ``[1,2]``)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    # YAML 1.1 reads "1e-3" as a string; accept it as a float, since that is what people mean.
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            return value
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` strings to a nested mapping (returns a new mapping)."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected dotted.key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"--set {item!r}: empty key")
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {key}: {p!r} is not a mapping")
            node = nxt
        node[parts[-1]] = parse_scalar(raw)
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing or malformed file is a one-line ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: malformed YAML{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Load ``cls`` from a YAML file (or defaults when ``path`` is None) plus ``--set`` overrides."""
    data = read_yaml(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, overrides))


def dump(cfg: Any) -> str:
    """YAML text of a config dataclass; ``load(dump(cfg)) == cfg``."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
