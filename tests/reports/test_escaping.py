"""Strings from tasks, configs and model outputs are escaped in the HTML and Markdown outputs."""

from __future__ import annotations

import re

import pytest

from reports import compare_runs
from reports.html import esc
from reports.render.markdown import cell

from .conftest import HOSTILE_PREDICTION, HOSTILE_TASK


def _raw_markup(page: str) -> list[str]:
    """Script tags and the hostile image tag in a page, other than the page's own final script."""
    own = page.rfind("<script>")
    return re.findall(r"<script|<img src=x", page[:own]) + re.findall(r"<script|<img src=x", page[own + 1 :])


def test_report_escapes_task_names_and_predictions(hostile_report):
    out = hostile_report
    page = (out / "index.html").read_text()
    assert _raw_markup(page) == []
    assert esc(HOSTILE_TASK) in page  # shown, as text
    assert esc(HOSTILE_PREDICTION) in page
    summary = (out / "summary.md").read_text()
    assert "<script" not in summary


def test_compare_page_escapes(make_run):
    base, new = make_run("base", hostile=True), make_run("new", hostile=True, seed=3)
    result = compare_runs(base, new)
    page = (result.out_dir / "index.html").read_text()
    assert _raw_markup(page) == [] and esc(HOSTILE_TASK) in page
    assert "<script" not in result.summary_markdown


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<script>alert(1)</script>", "\\<script\\>alert(1)\\</script\\>"),
        ("a | b", "a \\| b"),
        ("two\nlines", "two lines"),
        (None, "n/a"),
    ],
)
def test_markdown_cell(text, expected):
    assert cell(text) == expected


@pytest.mark.parametrize("text", ['"><img src=x onerror=alert(1)>', "<script>", "a & b", "'quoted'"])
def test_html_escape_has_no_markup(text):
    assert not set(esc(text)) & set("<>\"'")
