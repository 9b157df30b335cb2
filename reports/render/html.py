"""A :class:`~reports.render.document.Document` as one self-contained HTML page (the page machinery of
:mod:`reports.html`: escaped text, inline CSS, embedded figures, a Content-Security-Policy)."""

from __future__ import annotations

import re

from reports import formatting as f
from reports import html as h
from reports.render.document import (
    Block,
    Bullets,
    Code,
    Definitions,
    Details,
    Document,
    Figure,
    Heading,
    KeyValues,
    PageOnly,
    Table,
    Text,
)

STATUS_CLASSES = {
    "holds": "b-ok",
    "does not hold": "b-regression",
    "inconclusive": "b-nochange",
    "importance better": "b-compared",
    "random better": "b-compared",
    "no difference": "b-nochange",
    "not measured": "b-na",
}
"""Verdict words that a rich text's ``**word**`` shows as a coloured label (any other word: bold)."""


def rich(text: str) -> str:
    """Rich text as HTML: escaped, ``**word**`` as a status label or bold, newlines as line breaks."""

    def mark(m: re.Match) -> str:
        word = m.group(1)
        cls = STATUS_CLASSES.get(word)
        return f'<span class="badge {cls}">{word}</span>' if cls else f"<strong>{word}</strong>"

    return re.sub(r"\*\*(.+?)\*\*", mark, h.esc(text)).replace("\n", "<br>")


def _table(block: Table) -> str:
    if block.frame.empty:
        return h.paragraph(block.empty)
    frame = block.frame.copy()
    shown = {
        **{c: lambda v: h.badge(str(v)) for c in block.badges},
        **{c: lambda v: h.chip(str(v)) for c in block.chips},
        **{c: lambda v: h.pre(v) for c in block.code},
        **{c: rich for c in block.rich},
    }
    for col, show in shown.items():
        fmt = block.formats.get(col, f.text)
        frame[col] = [show(fmt(v)) for v in frame[col]]
    return h.table(frame, block.formats, block.headers, raw=shown)


def block_html(block: Block) -> str:
    """One block as HTML."""
    if isinstance(block, Text):
        body = rich(block.text) if block.rich else h.esc(block.text)
        if block.style == "callout":
            badge = f"{h.badge(block.badge)} " if block.badge else ""
            return f'<div class="callout">{badge}{body}</div>'
        cls = f' class="{block.style}"' if block.style else ""
        return f"<p{cls}>{body}</p>"
    if isinstance(block, Heading):
        return f"<h3>{h.esc(block.text)}</h3>"
    if isinstance(block, Bullets):
        if not block.items:
            return ""
        title = f"<strong>{h.esc(block.title)}</strong>" if block.title else ""
        items = "<ul>" + "".join(f"<li>{rich(i)}</li>" for i in block.items) + "</ul>"
        return f'<div class="callout">{title}{items}</div>' if block.callout else title + items
    if isinstance(block, Code):
        return h.pre(block.text)
    if isinstance(block, Table):
        return _table(block)
    if isinstance(block, Figure):
        return h.figure(block.png_b64, block.alt, block.caption)
    if isinstance(block, KeyValues):
        return h.key_values(block.items)
    if isinstance(block, Definitions):
        return h.definitions(block.items)
    if isinstance(block, PageOnly):
        return "".join(block_html(b) for b in block.blocks)
    if isinstance(block, Details):
        return h.details(block.summary, "".join(block_html(b) for b in block.blocks), block.open)
    raise TypeError(f"not a report block: {type(block).__name__}")


def to_html(doc: Document) -> str:
    """The document as a complete HTML page."""
    return h.page(
        doc.title,
        doc.subtitle,
        [(s.anchor, s.title, "".join(block_html(b) for b in s.blocks)) for s in doc.sections],
    )
