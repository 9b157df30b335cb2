"""A :class:`~reports.render.document.Document` as one self-contained HTML page (the page machinery of
:mod:`reports.html`: escaped text, inline CSS, embedded figures, a Content-Security-Policy)."""

from __future__ import annotations

from reports import html as h
from reports.render.document import Block, Definitions, Document, Figure, KeyValues, Table, Text


def block_html(block: Block) -> str:
    """One block as HTML."""
    if isinstance(block, Text):
        if block.style == "callout":
            badge = f"{h.badge(block.badge)} " if block.badge else ""
            return f'<div class="callout">{badge}{h.esc(block.text)}</div>'
        return h.paragraph(block.text, block.style)
    if isinstance(block, Table):
        if block.frame.empty:
            return h.paragraph(block.empty)
        frame = block.frame.copy()
        for col in block.badges:
            frame[col] = [h.badge(str(v)) for v in frame[col]]
        return h.table(frame, block.formats, block.headers, raw=block.badges)
    if isinstance(block, Figure):
        return h.figure(block.png_b64, block.alt, block.caption)
    if isinstance(block, KeyValues):
        return h.key_values(block.items)
    if isinstance(block, Definitions):
        return h.definitions(block.items)
    raise TypeError(f"not a report block: {type(block).__name__}")


def to_html(doc: Document) -> str:
    """The document as a complete HTML page."""
    return h.page(
        doc.title,
        doc.subtitle,
        [(s.anchor, s.title, "".join(block_html(b) for b in s.blocks)) for s in doc.sections],
    )
