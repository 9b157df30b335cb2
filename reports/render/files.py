"""The files a document's Markdown points at: each figure with a ``file`` name, written beside it."""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator
from pathlib import Path

from ernie5.store.runs import write_atomic
from reports.render.document import Block, Details, Document, Figure


def _markdown_figures(blocks: Iterable[Block]) -> Iterator[Figure]:
    for block in blocks:
        if isinstance(block, Figure) and block.file:
            yield block
        elif isinstance(block, Details):
            yield from _markdown_figures(block.blocks)


def write_figures(doc: Document, folder: Path) -> list[Path]:
    """Write every figure the Markdown of ``doc`` shows that names a file (not those of page-only
    sections or blocks) into ``folder``, atomically; the paths written."""
    out = []
    for block in _markdown_figures(b for s in doc.sections if s.markdown for b in s.blocks):
        path = Path(folder) / block.file
        write_atomic(path, base64.b64decode(block.png_b64))
        out.append(path)
    return out
