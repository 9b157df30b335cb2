"""Shipped run presets (YAML): ``micro`` (tests), ``mini`` (the main job), ``nano`` (CPU reference),
``mini_all`` (mini + images, clips and audio), ``nano_mm`` (nano + images and clips), ``nano_all``
(nano + images, clips and audio), ``paper``
(meta device only)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ernie5.config import ConfigError


def preset_names() -> list[str]:
    """Names of the shipped presets."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".yaml"))


def resolve_config_path(name_or_path: str) -> Path:
    """A preset name or a YAML file path -> the file to read."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError(f"config file not found: {name_or_path}")
        return p
    if name_or_path in preset_names():
        return Path(str(resources.files(__name__) / f"{name_or_path}.yaml"))
    raise ConfigError(
        f"unknown preset {name_or_path!r} (presets: {', '.join(preset_names())}; or a YAML file)"
    )
