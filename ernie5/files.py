"""File integrity helpers shared by checkpoints (:mod:`ernie5.store.checkpoint`), side-model folders
(:mod:`ernie5.tokenizers.folder`) and data fingerprints: content hashes, fsync, publishing a folder in
place of an old one, and a failed write as one ``OSError`` that names its path (:func:`write_failure`)."""

from __future__ import annotations

import errno
import hashlib
import os
import re
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


WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EACCES})
"""The errors of a write that failed at the operating system (disk full, quota, read-only, I/O, ...)."""
_OS_ERROR = re.compile(r"os error (\d+)")


def write_failure(e: BaseException, path: str | Path, what: str) -> OSError | None:
    """``e`` as one ``OSError`` naming ``path`` and what was being written, when ``e`` is a write that
    failed at the OS level (also as raised by libraries that wrap it: safetensors' ``SafetensorError``
    "... (os error 28)", torch's ``RuntimeError`` from its file writer); None for anything else."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        m = _OS_ERROR.search(str(e))
        if m:
            code = int(m.group(1))
        elif "No space left on device" in str(e):
            code = errno.ENOSPC
    if code is None or (not isinstance(e, OSError) and code not in WRITE_ERRNOS):
        return None
    return OSError(code, f"{os.strerror(code)} while writing {what}", str(path))
