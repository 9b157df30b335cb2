"""One document, two renderings: every block kind reaches the page and the Markdown, escaped, and
sections kept off the Markdown stay on the page."""

from __future__ import annotations

import base64

import pandas as pd
import pytest

from reports.render.document import (
    Bullets,
    Code,
    Definitions,
    Details,
    Document,
    Figure,
    Heading,
    KeyValues,
    PageOnly,
    Section,
    Table,
    Text,
)
from reports.render.files import write_figures
from reports.render.html import block_html, to_html
from reports.render.markdown import block_markdown, to_markdown

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode()


def _doc() -> Document:
    table = Table(
        pd.DataFrame({"task": ["a|b", "<c>"], "score": [0.12345, 1.0], "verdict": ["pass", "fail"]}),
        formats={"score": lambda v: f"{v:.2f}"},
        headers={"score": "Score"},
        badges=("verdict",),
    )
    return Document(
        "Title <x>",
        "one line",
        (
            Section(
                "answer", "The answer", (Text("lead <b>", "lead"), Text("ok", "callout", badge="pass"), table)
            ),
            Section("fig", "A figure", (Figure(PNG, "deltas", "caption", file="deltas.png"),)),
            Section(
                "long",
                "Only on the page",
                (
                    KeyValues((("seed", 0),)),
                    Definitions((("CI", "interval"),)),
                    Table(pd.DataFrame(), empty="No rows."),
                ),
                markdown=False,
            ),
        ),
    )


def test_page_carries_every_section_escaped():
    page = to_html(_doc())
    for title in ("The answer", "A figure", "Only on the page"):
        assert title in page
    assert "lead &lt;b&gt;" in page and "lead <b>" not in page
    assert "&lt;c&gt;" in page and "0.12" in page and "Score" in page
    assert "No rows." in page and "seed" in page and "interval" in page
    assert f"data:image/png;base64,{PNG}" in page


def test_markdown_leaves_out_page_only_sections_and_escapes_cells():
    md = to_markdown(_doc())
    assert md.startswith("# Title \\<x\\>\n")
    assert "## The answer" in md and "Only on the page" not in md and "seed" not in md
    assert "**lead \\<b\\>**" in md and "> **pass**: ok" in md
    assert "| task | Score | verdict |" in md
    assert "| a\\|b |" in md and "\\<c\\>" in md
    assert "0.12" in md and "0.123" not in md
    assert "![deltas](deltas.png) caption" in md


def test_figures_named_for_the_markdown_are_written_beside_it(tmp_path):
    written = write_figures(_doc(), tmp_path)
    assert written == [tmp_path / "deltas.png"]
    assert (tmp_path / "deltas.png").read_bytes() == base64.b64decode(PNG)


def test_figure_without_file_is_described_in_markdown():
    assert block_markdown(Figure(PNG, "a chart")) == "_Figure: a chart._"


@pytest.mark.parametrize("render", [block_html, block_markdown])
def test_unknown_block_is_refused(render):
    with pytest.raises(TypeError, match="not a report block: str"):
        render("text")


def _rich_doc() -> Document:
    cells = Table(
        pd.DataFrame(
            {
                "modality": ["image"],
                "prediction": ["<script>x</script>\n`tick`"],
                "claim": ["**holds**\n+0.01 <b>"],
                "status": ["error"],
            }
        ),
        chips=("modality",),
        code=("prediction",),
        rich=("claim",),
        badges=("status",),
    )
    return Document(
        "t",
        "s",
        (
            Section(
                "a",
                "A",
                (
                    Heading("Sub <h>"),
                    Bullets(("**does not hold** <i>", "plain **bold**"), callout=True, title="Verdicts"),
                    Code("run ```x``` <y>"),
                    cells,
                    Details("more <m>", (Text("inside"), Figure(PNG, "folded", file="folded.png"))),
                    PageOnly((Text("page only <p>"), Figure(PNG, "detail", file="detail.png"))),
                ),
            ),
        ),
    )


def test_rich_blocks_on_the_page_are_escaped_and_marked():
    page = to_html(_rich_doc())
    assert "<h3>Sub &lt;h&gt;</h3>" in page
    assert '<span class="badge b-regression">does not hold</span> &lt;i&gt;' in page  # a verdict word
    assert "<strong>bold</strong>" in page and "<strong>Verdicts</strong>" in page
    assert '<div class="callout"><strong>Verdicts</strong><ul>' in page
    assert "<pre>run ```x``` &lt;y&gt;</pre>" in page
    assert 'class="chip"' in page and "<pre>&lt;script&gt;x&lt;/script&gt;" in page
    assert '<span class="badge b-ok">holds</span><br>+0.01 &lt;b&gt;' in page
    assert '<span class="badge b-error">error</span>' in page
    assert "<details><summary>more &lt;m&gt;</summary><p>inside</p>" in page
    assert "page only &lt;p&gt;" in page and "<script>x" not in page


def test_rich_blocks_in_markdown_keep_their_meaning_and_leave_page_only_out():
    md = to_markdown(_rich_doc())
    assert "### Sub \\<h\\>" in md
    assert "**Verdicts**\n\n- **does not hold** \\<i\\>\n- plain **bold**" in md
    assert "````\nrun ```x``` <y>\n````" in md  # a fence longer than any backtick run inside
    assert "| image | `\\<script\\>x\\</script\\> 'tick'` | **holds** +0.01 \\<b\\> | error |" in md
    assert "**more \\<m\\>**\n\ninside\n\n![folded](folded.png)" in md
    assert "page only" not in md and "detail.png" not in md


def test_figures_written_are_those_the_markdown_shows(tmp_path):
    assert write_figures(_rich_doc(), tmp_path) == [tmp_path / "folded.png"]
