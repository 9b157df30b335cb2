"""Saved side models (vision tokenizer, audio codec, refiner, teachers): one folder each.

A folder holds safetensors weights, ``config.yaml`` (the module's frozen config) and ``meta.json``
(a format ``version``, free metadata and ``files``: the sha256 and size of every other file). It has
the integrity of a checkpoint (:mod:`ernie5.store.checkpoint`):

* **Manifest.** The index file (``meta.json``, or a teacher's ``teacher.json``) is written last and
  lists every other file's sha256 and size; loading checks each file it reads against it, so flipped
  or truncated bytes are a one-line error of the caller's error type naming the file, never different
  weights. A folder written before manifests existed (an index without ``files``) still loads,
  unchecked.
* **Durability.** Every file and the folder are fsynced before the folder is published, and the
  parent after.
* **Atomic publish.** The folder is written under ``.<name>.tmp-<pid>``; an existing folder is renamed
  aside to ``.<name>.old-<pid>``, the new one renamed in, and only then the old one deleted (a failed
  rename puts the old one back). A crash between the two renames leaves both complete folders under
  those hidden names; the next save to the same path removes such leftovers of dead processes.

Loading never unpickles, and every problem (a missing or unreadable file, another format version,
bytes that differ from the manifest, weights that do not fit the config) is a one-line error of the
caller's error type.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ernie5.config import ConfigError, dump, from_dict, read_yaml
from ernie5.files import file_sha256, fsync_path, publish_folder

CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
MANIFEST_KEY = "files"
"""Key of the index file that holds the manifest: relative path -> ``{"sha256", "bytes"}``."""

M = TypeVar("M", bound=nn.Module)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _leftovers(path: Path) -> list[Path]:
    """Hidden ``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>`` siblings of ``path``, any process."""
    if not path.parent.is_dir():
        return []
    return sorted(
        p for kind in ("tmp", "old") for p in path.parent.glob(f".{path.name}.{kind}-*") if p.is_dir()
    )


def _clean_leftovers(path: Path) -> None:
    """Remove the leftovers of interrupted saves to ``path`` (not those of a save still running)."""
    for p in _leftovers(path):
        pid = p.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and _pid_alive(int(pid)):
            continue
        shutil.rmtree(p, ignore_errors=True)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def write_folder_atomic(
    path: str | Path, write: Callable[[Path], None], index: dict[str, Any], index_file: str = META_FILE
) -> Path:
    """Publish the folder ``path``: ``write(tmp_dir)`` writes its files, then ``index_file`` is written
    last as ``index`` plus the manifest (``files``) of every file ``write`` wrote; everything is
    fsynced and the folder replaces an existing ``path`` as the module docstring describes.

    Raises:
        ValueError: ``index`` uses the reserved key ``files`` or is not JSON-serialisable.
    """
    path = Path(path)
    if MANIFEST_KEY in index:
        raise ValueError(f"metadata key {MANIFEST_KEY!r} is reserved for the file manifest")
    try:
        json.dumps(index, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta is not JSON-serialisable: {e}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        files = {}
        for f in _files(tmp):
            fsync_path(f)
            files[f.relative_to(tmp).as_posix()] = {"sha256": file_sha256(f), "bytes": f.stat().st_size}
        if index_file in files:
            raise ValueError(f"{index_file} is written by write_folder_atomic, not by write()")
        text = json.dumps({**index, MANIFEST_KEY: files}, indent=2, sort_keys=True, allow_nan=False)
        with open(tmp / index_file, "w", encoding="utf-8") as fh:  # last: its presence means complete
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        for d in sorted({f.parent for f in _files(tmp)}, key=lambda p: -len(p.parts)):
            fsync_path(d)
        publish_folder(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_index(path: Path, index_file: str, error: type[Exception], what: str) -> dict[str, Any]:
    """The JSON object in ``path/index_file`` (one-line ``error`` when missing or not an object)."""
    if not (path / index_file).is_file():
        hint = ""
        if not path.exists() and (left := _leftovers(path)):
            hint = f"; an interrupted save left {left[-1]}"
        raise error(f"{path}: missing {index_file} (not a saved {what}{hint})")
    try:
        body = json.loads((path / index_file).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise error(f"{path / index_file}: unreadable JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(body, dict):
        raise error(f"{path / index_file}: expected a JSON object, got {type(body).__name__}")
    return body


def verify_files(
    path: Path, index: dict[str, Any], index_file: str, read: Iterable[str], error: type[Exception]
) -> None:
    """Check the files a loader reads against the manifest in ``index`` (see the module docstring).

    Every file in ``read`` must exist; when ``index`` has a manifest, each must be listed in it and
    every listed file must have its recorded size and sha256. Without a manifest (a folder saved
    before manifests) only existence is checked.

    Raises:
        error: one line naming the file and what is wrong with it.
    """
    read = list(read)
    for name in read:
        if not (path / name).is_file():
            raise error(f"{path}: missing {name}")
    if MANIFEST_KEY not in index:
        return
    files = index[MANIFEST_KEY]
    if not isinstance(files, dict) or not all(
        isinstance(k, str)
        and k
        and not PurePosixPath(k).is_absolute()
        and ".." not in PurePosixPath(k).parts
        and isinstance(v, dict)
        and isinstance(v.get("sha256"), str)
        and isinstance(v.get("bytes"), int)
        for k, v in files.items()
    ):
        raise error(f"{path / index_file}: {MANIFEST_KEY!r} must map relative names to {{sha256, bytes}}")
    for name in read:
        if name not in files:
            raise error(f"{path / index_file}: {name} is not in the file manifest")
    for name, want in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise error(f"{path}: missing {name} (listed in {index_file})")
        size = file.stat().st_size
        if size != want["bytes"]:
            raise error(f"{file}: {size} bytes, {index_file} says {want['bytes']} (truncated or replaced)")
        if file_sha256(file) != want["sha256"]:
            raise error(f"{file}: sha256 differs from {index_file} (corrupted or replaced)")


def save_module(
    path: str | Path, module: nn.Module, cfg: Any, version: str, weights_file: str, meta: dict | None
) -> Path:
    """Write ``module``'s state, ``cfg`` and ``meta`` (+ ``version``, ``n_params``) to the folder ``path``.

    Raises:
        ValueError: ``meta`` is not JSON-serialisable or uses the reserved key ``files``.
    """
    body = {**(meta or {}), "version": version, "n_params": sum(p.numel() for p in module.parameters())}

    def write(tmp: Path) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
        save_file(tensors, tmp / weights_file, metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(dump(cfg), encoding="utf-8")

    return write_folder_atomic(path, write, body)


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

    ``config.yaml`` and the weights are checked against the manifest in ``meta.json`` first (a folder
    saved before manifests, without ``files``, loads unchecked).

    Raises:
        error: one line naming the file and what is wrong with it (``what`` names the module kind).
    """
    path = Path(path)
    meta = read_index(path, META_FILE, error, what)
    for name in (CONFIG_FILE, weights_file):
        if not (path / name).is_file():
            raise error(f"{path}: missing {name} (not a saved {what})")
    if meta.get("version") != version:
        raise error(f"{path / META_FILE}: version {meta.get('version')!r}, expected {version!r}")
    verify_files(path, meta, META_FILE, (CONFIG_FILE, weights_file), error)
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
