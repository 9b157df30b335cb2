"""File integrity helpers shared by checkpoints (:mod:`ernie5.store.checkpoint`) and side-model
folders (:mod:`ernie5.tokenizers.folder`): content hashes for their sha256 manifests, and fsync."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_CHUNK = 1 << 20


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
