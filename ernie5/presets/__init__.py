"""Shipped run presets (YAML): ``micro`` (tests), ``mini`` (small text-only), ``nano`` (the
shape of the Hugging Face MoE peer), ``mini_all`` (mini + images, clips and audio), ``nano_mm``
(nano + images and clips), ``nano_all`` (nano + images, clips and audio), ``reference`` (the
shipped all-modality model: 64 experts, top-4; ``ernie5 recipe reference``), ``reference_v1`` (the
first shipped reference, for the ablation: no vision options, unvaried understanding documents),
``paper`` (meta device
only), ``sft`` (the fine-tuning defaults of ``ernie5 sft``: no model section, the model is the
checkpoint's)."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from ernie5.config import ConfigError


def preset_names() -> list[str]:
    """Names of the shipped presets."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".yaml"))


def is_path(name_or_path: str | Path) -> bool:
    """Whether a ``--config``/``--suite`` value is a file path rather than a shipped name: it contains
    a ``/`` (or the platform's separator) or ends in ``.yaml``/``.yml``. A name is never looked up in
    the current directory, so a folder called ``micro`` there does not shadow the preset."""
    s = str(name_or_path)
    return "/" in s or os.sep in s or s.endswith((".yaml", ".yml"))


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A preset name or a YAML file path (see :func:`is_path`) -> the file to read."""
    if is_path(name_or_path):
        p = Path(name_or_path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {name_or_path}")
        return p
    if str(name_or_path) in preset_names():
        return Path(str(resources.files(__name__) / f"{name_or_path}.yaml"))
    raise ConfigError(
        f"unknown preset {str(name_or_path)!r} (presets: {', '.join(preset_names())}; "
        "or a YAML file: a path with a '/' or ending in .yaml)"
    )
