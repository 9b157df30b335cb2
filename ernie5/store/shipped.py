"""Checkpoints that travel with the package, loadable by name (``--checkpoint reference``).

A shipped checkpoint is an ordinary checkpoint folder (``ernie5.store.checkpoint``: safetensors,
a sha256 manifest in ``meta.json``) inside the package at ``ernie5/<name>/``. Its name is looked up
before the file system, as preset names are: a local folder called ``reference`` is passed as
``./reference``.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED = ("reference",)
"""Names of the shipped checkpoints."""


def shipped_dir(name: str) -> Path:
    """The package folder of the shipped checkpoint ``name`` (it may not exist yet)."""
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped checkpoint {name!r} (shipped: {', '.join(SHIPPED)})")
    return Path(__file__).resolve().parents[1] / name


def is_shipped_name(value: str | Path) -> bool:
    """Whether a ``--checkpoint`` value names a shipped checkpoint (a bare name, no path separator)."""
    return isinstance(value, str) and value in SHIPPED
