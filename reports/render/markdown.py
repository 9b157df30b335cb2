"""A :class:`~reports.render.document.Document` as GitHub-flavoured Markdown; sections marked
``markdown=False`` are left out.

Text from runs is escaped for GitHub-flavoured Markdown and stays readable in a CI log: ``<``, ``>``
and ``|`` get a backslash and newlines become spaces (:func:`cell`); inside code spans backticks become
quotes (:func:`code`). A task name or model output can neither break a table nor inject HTML.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pandas as pd

from reports import formatting as f
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


def cell(x: Any) -> str:
    """``x`` as Markdown text safe in a table cell (no raw HTML, no column break, one line)."""
    text = f.text(x).replace("\\", "\\\\")
    for ch in "<>|":
        text = text.replace(ch, "\\" + ch)
    return " ".join(text.split())


def code(x: Any) -> str:
    """``x`` as an inline code span."""
    return "`" + " ".join(f.text(x).replace("`", "'").split()) + "`"


def md_table(df: pd.DataFrame, formats: dict[str, Callable[[Any], str]] | None = None) -> str:
    """A GitHub-flavoured Markdown table; numbers default to 3 decimals."""
    formats = formats or {}
    if df.empty:
        return "_(none)_\n"
    numeric = {c for c in df.columns if pd.api.types.is_numeric_dtype(df[c]) and df[c].dtype != bool}
    lines = [
        "| " + " | ".join(cell(c) for c in df.columns) + " |",
        "|" + "|".join("---:" if c in numeric else "---" for c in df.columns) + "|",
    ]
    for row in df.itertuples(index=False):
        vals = [formats.get(c, f.num if c in numeric else f.text)(v) for c, v in zip(df.columns, row)]
        lines.append("| " + " | ".join(cell(v) for v in vals) + " |")
    return "\n".join(lines) + "\n"


def block_markdown(block: Block) -> str:
    """One block as Markdown ("" for a :class:`PageOnly` one)."""
    if isinstance(block, PageOnly):
        return ""
    if isinstance(block, Text):
        text = cell(block.text)
        if block.style == "callout":
            return f"> **{cell(block.badge)}**: {text}" if block.badge else f"> {text}"
        return f"**{text}**" if block.style == "lead" else text
    if isinstance(block, Heading):
        return f"### {cell(block.text)}"
    if isinstance(block, Bullets):
        title = [f"**{cell(block.title)}**", ""] if block.title else []
        return "\n".join(title + [f"- {cell(i)}" for i in block.items])
    if isinstance(block, Code):
        text = f.text(block.text)
        fence = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", text)), default=0))
        return f"{fence}\n{text}\n{fence}"
    if isinstance(block, Table):
        if block.frame.empty:
            return cell(block.empty)
        formats = dict(block.formats)
        for col in block.code:
            fmt = formats.get(col, f.text)
            formats[col] = lambda v, fmt=fmt: code(fmt(v))
        frame = block.frame.rename(columns=block.headers)
        formats = {block.headers.get(c, c): fn for c, fn in formats.items()}
        return md_table(frame, formats).rstrip("\n")
    if isinstance(block, Figure):
        caption = f" {cell(block.caption)}" if block.caption else ""
        return (
            f"![{cell(block.alt)}]({block.file}){caption}"
            if block.file
            else f"_Figure: {cell(block.alt)}._{caption}"
        )
    if isinstance(block, KeyValues):
        return "\n".join(f"- **{cell(k)}**: {cell(f.text(v))}" for k, v in block.items)
    if isinstance(block, Definitions):
        return "\n".join(f"- **{cell(t)}**: {cell(d)}" for t, d in block.items)
    if isinstance(block, Details):
        parts = [f"**{cell(block.summary)}**"] + [block_markdown(b) for b in block.blocks]
        return "\n\n".join(p for p in parts if p)
    raise TypeError(f"not a report block: {type(block).__name__}")


def to_markdown(doc: Document) -> str:
    """The document as Markdown: the title, the line under it, then each section it carries."""
    out = [f"# {cell(doc.title)}", "", cell(doc.subtitle), ""]
    for section in (s for s in doc.sections if s.markdown):
        out += [f"## {cell(section.title)}", ""]
        for text in (block_markdown(b) for b in section.blocks):
            out += [text, ""] if text else []
    return "\n".join(out).rstrip("\n") + "\n"
