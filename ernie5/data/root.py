"""The data root: one directory holding every real dataset, found from an argument or ``ERNIE5_DATA_DIR``.

Datasets are never copied into the project. Each reader takes the root and a path relative to it
(``arc/ARC-Easy-test.jsonl``); a missing file is a :class:`DataMissing` error whose one-line message
names the file, the root and how to get it, so a nightly log says exactly what to fix. A root that is
given (``--data-dir`` or ``ERNIE5_DATA_DIR``) but is not a folder is a :class:`DataDirError`: it is
never taken for "no data" (every data task would then be skipped and the run would look fine).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "ERNIE5_DATA_DIR"


class DataMissing(Exception):
    """A dataset file is not under the data root (or no root is set). The message is one line."""

    def __init__(self, relpath: str, root: Path | None, how_to_get: str = "") -> None:
        self.relpath = relpath
        self.root = root
        where = (
            f"under data root {root}"
            if root is not None
            else f"(no data root: pass --data-dir or set {ENV_VAR})"
        )
        hint = f"; to get it: {how_to_get}" if how_to_get else ""
        super().__init__(f"missing {relpath} {where}{hint}")


class DataDirError(ValueError):
    """A data root was given but is not an existing folder. The message is one line."""


def resolve_data_dir(explicit: str | Path | None) -> Path | None:
    """The data root: ``explicit`` if given, else ``$ERNIE5_DATA_DIR`` if set and non-empty, else None.

    Raises:
        DataDirError: the root given (either way) does not exist or is not a folder.
    """
    if explicit is not None and str(explicit) != "":
        root, source = Path(explicit).expanduser(), "--data-dir"
    else:
        env = os.environ.get(ENV_VAR, "")
        if not env:
            return None
        root, source = Path(env).expanduser(), f"${ENV_VAR}"
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise DataDirError(f"{source} {str(root)!r} {what}; expected the data root folder")
    return root


def require_file(root: str | Path | None, relpath: str, how_to_get: str = "") -> Path:
    """``root / relpath`` if it is a file, else :class:`DataMissing`. ``root`` is used as given."""
    if root is None:
        raise DataMissing(relpath, None, how_to_get)
    path = Path(root) / relpath
    if not path.is_file():
        raise DataMissing(relpath, Path(root), how_to_get)
    return path
