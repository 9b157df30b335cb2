"""The files a document's Markdown points at: each figure with a ``file`` name, written beside it."""

from __future__ import annotations

import base64
from pathlib import Path

from ernie5.store.runs import write_atomic
from reports.render.document import Document, Figure


def write_figures(doc: Document, folder: Path) -> list[Path]:
    """Write every figure of ``doc`` that names a file into ``folder`` (atomically); the paths written."""
    out = []
    for block in (b for s in doc.sections if s.markdown for b in s.blocks):
        if isinstance(block, Figure) and block.file:
            path = Path(folder) / block.file
            write_atomic(path, base64.b64decode(block.png_b64))
            out.append(path)
    return out
