"""Saved side models (vision tokenizer, audio codec, refiner, teachers): one folder each.

A folder holds safetensors weights, ``config.yaml`` (the module's frozen config) and ``meta.json``
(a format ``version`` plus free metadata). It is written under a temporary name and renamed into
place, so a reader sees the old folder or the new one, never a half-written one. Loading never
unpickles, and every problem (a missing or unreadable file, another format version, weights that do
not fit the config) is a one-line error of the caller's error type.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ernie5.config import ConfigError, dump, from_dict, read_yaml

CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"

M = TypeVar("M", bound=nn.Module)


def write_folder_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_dir)`` and rename the result onto ``path`` (replacing an existing folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def save_module(
    path: str | Path, module: nn.Module, cfg: Any, version: str, weights_file: str, meta: dict | None
) -> Path:
    """Write ``module``'s state, ``cfg`` and ``meta`` (+ ``version``, ``n_params``) to the folder ``path``."""
    body = {**(meta or {}), "version": version, "n_params": sum(p.numel() for p in module.parameters())}
    try:
        meta_text = json.dumps(body, indent=2, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta is not JSON-serialisable: {e}") from None

    def write(tmp: Path) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
        save_file(tensors, tmp / weights_file, metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(dump(cfg), encoding="utf-8")
        (tmp / META_FILE).write_text(meta_text, encoding="utf-8")  # last: its presence means complete

    return write_folder_atomic(path, write)


def load_module(
    path: str | Path,
    build: Callable[[Any], M],
    cfg_type: type,
    version: str,
    weights_file: str,
    error: type[Exception],
    what: str,
    device: str | torch.device = "cpu",
) -> M:
    """Load a folder written by :func:`save_module`: ``build(cfg)`` on ``device`` with the saved weights.

    Raises:
        error: one line naming the file and what is wrong with it (``what`` names the module kind).
    """
    path = Path(path)
    for name in (META_FILE, CONFIG_FILE, weights_file):
        if not (path / name).is_file():
            raise error(f"{path}: missing {name} (not a saved {what})")
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise error(f"{path / META_FILE}: unreadable JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("version") != version:
        found = meta.get("version") if isinstance(meta, dict) else None
        raise error(f"{path / META_FILE}: version {found!r}, expected {version!r}")
    try:
        cfg = from_dict(cfg_type, read_yaml(path / CONFIG_FILE))
    except ConfigError as e:
        raise error(f"{path / CONFIG_FILE}: {e}") from None
    try:
        tensors = load_file(path / weights_file, device=str(torch.device(device)))
    except (SafetensorError, OSError) as e:
        raise error(f"{path / weights_file}: unreadable ({str(e).splitlines()[0]})") from None
    model = build(cfg).to(device)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise error(
            f"{path / weights_file}: does not match config.yaml (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]})"
        )
    for name, value in tensors.items():
        if value.shape != expected[name].shape:
            raise error(
                f"{path / weights_file}: {name} has shape {tuple(value.shape)}, config.yaml needs "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(tensors)
    return model
