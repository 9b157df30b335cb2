"""What a report is made of: a :class:`Document` of :class:`Section` s, each a list of blocks.

Blocks hold data, not markup: text is plain (escaped by each renderer), tables are data frames with
formatters, figures are PNG bytes. The renderers (:mod:`reports.render.html`,
:mod:`reports.render.markdown`) decide how each block looks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd


@dataclass(frozen=True)
class Text:
    """A paragraph of plain text. ``style``: ``lead`` (the answer first), ``callout`` (a boxed verdict,
    with an optional coloured ``badge``), ``muted``."""

    text: str
    style: Literal["", "lead", "callout", "muted"] = ""
    badge: str = ""
    rich: bool = False
    """Whether ``**word**`` marks are kept: bold in both renderers, a coloured label in the page when the
    word is a status of :data:`reports.render.html.STATUS_CLASSES` (the text is escaped either way)."""


@dataclass(frozen=True)
class Table:
    """Rows of a data frame. ``formats``: column -> value to text (numbers default to 3 decimals);
    ``headers``: column -> header text; ``badges``: columns shown as coloured status labels."""

    frame: pd.DataFrame
    formats: dict[str, Callable[[Any], str]] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    badges: tuple[str, ...] = ()
    chips: tuple[str, ...] = ()
    """Columns of modality names, shown after a square of the modality's colour."""
    code: tuple[str, ...] = ()
    """Columns of verbatim text (prompts, predictions, error messages): preformatted."""
    rich: tuple[str, ...] = ()
    """Columns of rich text (``**word**`` marks as for :class:`Text`, newlines kept in the page)."""
    empty: str = "None."
    """What stands in for a table with no rows."""


@dataclass(frozen=True)
class Figure:
    """A PNG figure (base64, as :mod:`reports.plots` draws them); ``file`` is its name beside the
    Markdown (the product writes it there), if any."""

    png_b64: str
    alt: str
    caption: str = ""
    file: str = ""


@dataclass(frozen=True)
class Heading:
    """A sub-heading inside a section."""

    text: str


@dataclass(frozen=True)
class Bullets:
    """A bulleted list of rich text (``**word**`` marks as for :class:`Text`); ``callout`` boxes it."""

    items: tuple[str, ...]
    callout: bool = False
    title: str = ""


@dataclass(frozen=True)
class Code:
    """Verbatim text (a command, a config): preformatted in the page, a fenced block in Markdown."""

    text: str


@dataclass(frozen=True)
class KeyValues:
    """Labels and values, one pair per row."""

    items: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Definitions:
    """Terms and what they mean."""

    items: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Details:
    """Blocks folded under a one-line summary (open on request) in the page; in Markdown, the summary
    in bold followed by the blocks."""

    summary: str
    blocks: tuple[Block, ...]
    open: bool = False


@dataclass(frozen=True)
class PageOnly:
    """Blocks the page shows in place and the Markdown leaves out (long tables, second figures), so a
    section can keep its headline in the Markdown and its detail on the page."""

    blocks: tuple[Block, ...]


Block = PageOnly | Text | Heading | Bullets | Code | Table | Figure | KeyValues | Definitions | Details


@dataclass(frozen=True)
class Section:
    """A titled part of a report; ``anchor`` names it in the page's navigation."""

    anchor: str
    title: str
    blocks: tuple[Block, ...]
    markdown: bool = True
    """Whether the Markdown carries it (the page always does)."""


@dataclass(frozen=True)
class Document:
    """A whole report: its title, one line under it, and its sections in order."""

    title: str
    subtitle: str
    sections: tuple[Section, ...]
