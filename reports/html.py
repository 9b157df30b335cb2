"""HTML building blocks for self-contained report pages.

Every piece of text goes through :func:`esc` (``html.escape`` with quotes), so task names, configs
and model outputs cannot inject markup. Pages carry their CSS inline and figures as ``data:`` PNGs,
and a Content-Security-Policy that allows nothing else: no network fetches, and no script except the
page's own (pinned by hash), which records on ``<html>`` how many images loaded
(``data-images="loaded/total"``) and how many script errors occurred (``data-errors``), for the
browser test.
"""

from __future__ import annotations

import base64
import hashlib
import html
from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd

from reports import formatting

MODALITY_COLORS = {"text": "#0072B2", "image": "#E69F00", "video": "#009E73", "audio": "#CC79A7"}
"""Okabe-Ito colour-blind-safe colours, one per modality, used by every figure and table."""

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1b1f23;margin:0;
background:#f6f7f9}
main{max-width:1320px;margin:0 auto;padding:18px 28px 60px;background:#fff}
h1{font-size:24px;margin:6px 0 4px}
h2{font-size:19px;border-bottom:2px solid #dde1e6;padding-bottom:4px;margin-top:34px}
h3{font-size:15px;margin:20px 0 6px}
nav{font-size:13px;margin:4px 0 10px}nav a{margin-right:14px;color:#0b5cad;text-decoration:none}
.muted{color:#5f6b7a}.lead{font-size:15px}
table{border-collapse:collapse;margin:8px 0 14px;font-size:13px;max-width:100%}
.tablewrap{overflow-x:auto;max-width:100%}
th,td{border:1px solid #dde1e6;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef1f4;font-weight:600}tr:nth-child(even) td{background:#fafbfc}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
figure{margin:10px 0 18px}figure img{max-width:100%;height:auto;border:1px solid #e3e6ea}
figcaption{font-size:12.5px;color:#5f6b7a;max-width:1100px}
.badge{display:inline-block;padding:0 7px;border-radius:9px;font-size:12px;font-weight:600;color:#fff}
.b-ok,.b-improvement{background:#2e7d32}
.b-skipped,.b-new,.b-compared,.b-nochange{background:#78849a}
.b-error,.b-regression,.b-failing{background:#c62828}.b-missing,.b-versionchanged,.b-na{background:#b26a00}
.chip{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:4px;vertical-align:-1px}
dl.about dt{font-weight:600;margin-top:8px}dl.about dd{margin:2px 0 0 18px;max-width:1050px}
pre{white-space:pre-wrap;word-break:break-word;background:#f4f5f7;padding:6px 8px;margin:2px 0;font-size:12px}
details{margin:6px 0}summary{cursor:pointer;font-weight:600}
.kv td:first-child{font-weight:600;white-space:nowrap}
.callout{background:#f1f6fd;border-left:4px solid #0b5cad;padding:8px 12px;margin:10px 0}
@media (min-width:1100px){section#overview{display:grid;grid-template-columns:minmax(0,5fr) minmax(0,7fr);
column-gap:20px;align-items:start}section#overview>*{grid-column:1/-1}
section#overview>div.callout:first-of-type{grid-column:1;grid-row:2}
section#overview>figure:first-of-type{grid-column:2;grid-row:2}}
"""

_SCRIPT = (
    "(function(){var d=document.documentElement,n=0;"
    "window.addEventListener('error',function(){n++;d.setAttribute('data-errors',String(n));},true);"
    "window.addEventListener('load',function(){var im=Array.prototype.slice.call(document.images);"
    "var ok=im.filter(function(i){return i.complete&&i.naturalWidth>0;}).length;"
    "d.setAttribute('data-images',ok+'/'+im.length);d.setAttribute('data-errors',String(n));});})();"
)
_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_SCRIPT.encode()).digest()).decode()
CSP = (
    "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    f"script-src 'sha256-{_SCRIPT_HASH}'; base-uri 'none'; form-action 'none'"
)


def esc(x: Any) -> str:
    """``x`` as HTML-escaped text (``n/a`` for None/NaN)."""
    return html.escape(formatting.text(x), quote=True)


def badge(status: str) -> str:
    """A coloured status label (``ok``, ``error``, ``regression``, ...)."""
    key = "".join(ch for ch in status.lower() if ch.isalpha())
    return f'<span class="badge b-{esc(key)}">{esc(status)}</span>'


def chip(modality: str) -> str:
    """The modality's name after a square of its colour."""
    color = MODALITY_COLORS.get(modality, "#888888")
    return f'<span class="chip" style="background:{color}"></span>{esc(modality)}'


def table(
    df: pd.DataFrame,
    formats: dict[str, Callable[[Any], str]] | None = None,
    headers: dict[str, str] | None = None,
    raw: Iterable[str] = (),
) -> str:
    """An HTML table of ``df``.

    Args:
        df: the rows to show (all columns, in order).
        formats: column -> formatter to text (escaped afterwards); numbers default to 3 decimals.
        headers: column -> header text.
        raw: columns whose values are already HTML (built with :func:`esc`, :func:`badge`, ...).
    """
    formats, headers, raw = formats or {}, headers or {}, set(raw)
    head = "".join(f"<th>{esc(headers.get(c, c))}</th>" for c in df.columns)
    numeric = {c for c in df.columns if pd.api.types.is_numeric_dtype(df[c]) and df[c].dtype != bool}
    body = []
    for row in df.itertuples(index=False):
        cells = []
        for c, v in zip(df.columns, row):
            if c in raw:
                content = str(v)
            else:
                fn = formats.get(c, formatting.num if c in numeric else formatting.text)
                content = esc(fn(v))
            cls = ' class="num"' if c in numeric else ""
            cells.append(f"<td{cls}>{content}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    rows = "".join(body)
    return f'<div class="tablewrap"><table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>'


def key_values(items: Iterable[tuple[str, Any]]) -> str:
    """A two-column table of labels and (escaped) values."""
    rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in items)
    return f'<table class="kv"><tbody>{rows}</tbody></table>'


def figure(png_b64: str, alt: str, caption: str = "") -> str:
    """An embedded PNG with alt text and a caption."""
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    return f'<figure><img src="data:image/png;base64,{png_b64}" alt="{esc(alt)}">{cap}</figure>'


def paragraph(text: str, cls: str = "") -> str:
    """A paragraph of escaped text."""
    attr = f' class="{esc(cls)}"' if cls else ""
    return f"<p{attr}>{esc(text)}</p>"


def pre(text: Any) -> str:
    """Preformatted, escaped text."""
    return f"<pre>{esc(text)}</pre>"


def details(summary: str, body_html: str, open_: bool = False) -> str:
    """A collapsible block."""
    return f"<details{' open' if open_ else ''}><summary>{esc(summary)}</summary>{body_html}</details>"


def definitions(items: Iterable[tuple[str, str]]) -> str:
    """A definition list of (term, explanation)."""
    body = "".join(f"<dt>{esc(t)}</dt><dd>{esc(d)}</dd>" for t, d in items)
    return f'<dl class="about">{body}</dl>'


def section(anchor: str, title: str, body_html: str) -> str:
    """A titled section with an anchor for the navigation bar."""
    return f'<section id="{esc(anchor)}"><h2>{esc(title)}</h2>{body_html}</section>'


def page(title: str, subtitle: str, sections: list[tuple[str, str, str]]) -> str:
    """A complete HTML document.

    Args:
        title: page title (escaped).
        subtitle: one line under the title (escaped).
        sections: ``(anchor, title, body_html)`` per section, in order.
    """
    nav = "".join(f'<a href="#{esc(a)}">{esc(t)}</a>' for a, t, _ in sections)
    body = "".join(section(a, t, b) for a, t, b in sections)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body><main>"
        f'<h1>{esc(title)}</h1><p class="muted">{esc(subtitle)}</p><nav>{nav}</nav>{body}'
        f"</main><script>{_SCRIPT}</script></body></html>\n"
    )
