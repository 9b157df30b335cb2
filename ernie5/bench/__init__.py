"""Benchmarks behind ``ernie5 bench``: each returns a JSON-able dict of medians and ratios
measured in one process, at the nano shape of ``shared/reference/perf-anchors.md`` by default."""

from __future__ import annotations

from ernie5.model.config import ModelConfig


def preset_model(name: str = "nano") -> ModelConfig:
    """The model config of preset ``name`` (``nano``: perf-anchors.md's shape; ``gpu_fill``: one that
    fills an H100)."""
    from ernie5.config import from_dict, read_yaml
    from ernie5.presets import resolve_config_path

    return from_dict(ModelConfig, read_yaml(resolve_config_path(name))["model"])
