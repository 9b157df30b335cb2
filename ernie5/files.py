"""File integrity helpers shared by checkpoints (:mod:`ernie5.store.checkpoint`), side-model folders
(:mod:`ernie5.tokenizers.folder`) and data fingerprints: content hashes, fsync, and publishing a
folder in place of an old one."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

_CHUNK = 1 << 20


def _file_hash(path: str | Path) -> hashlib._Hash:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    return _file_hash(path).hexdigest()


def hash_file_into(digest: hashlib._Hash, name: str, path: str | Path) -> None:
    """Add one named file to a content fingerprint: ``name``, a NUL, then the file's sha256 (binary),
    so that renaming a file changes the fingerprint as much as editing it."""
    digest.update(name.encode("utf-8") + b"\0" + _file_hash(path).digest())


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_folder(tmp: Path, path: Path) -> None:
    """Rename the complete folder ``tmp`` to ``path``. An existing ``path`` is moved aside first
    (``.<name>.old-<pid>``), put back if the rename fails, and deleted only once the new folder is in
    place, so there is never a moment without a complete folder on disk or in the aside copy."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        if old is not None:
            os.replace(old, path)
        raise
    fsync_path(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
