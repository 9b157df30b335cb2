"""The report in a real browser: no console message, every section drawn, every image decoded and
laid out, a non-blank full-page screenshot, every link resolving; and the checks catch a broken page.

Part of the default test run. It skips only where no Chromium is installed, and never under
``.ci/run``, which installs Chromium and sets ``ERNIE5_REQUIRE_BROWSER=1``: there a missing browser fails.
"""

from __future__ import annotations

import os

import pytest

from reports import compare_runs, trend_runs
from tests.reports.browser import VIEWPORT, check_page, find_chromium, screenshot

SECTIONS = ["overview", "seesaw", "efficiency", "units", "routing", "tasks", "about"]


@pytest.fixture(scope="module")
def chromium():
    if find_chromium() is None:
        if os.environ.get("ERNIE5_REQUIRE_BROWSER") == "1":
            pytest.fail("ERNIE5_REQUIRE_BROWSER=1 but no chromium on PATH (apt-get install -y chromium)")
        pytest.skip("no chromium on PATH: .ci/run installs it as root (apt-get install -y chromium)")


def test_report_renders_in_chromium(chromium, hostile_report, tmp_path):
    # A hostile run: a task name and a prediction carrying <script>; escaping and the page's CSP must hold.
    check = check_page(hostile_report / "index.html")
    assert check.ok, check.problems
    assert check.images_total == 8 and check.images_loaded == 8 and check.page_counters == "8/8"
    assert [s["id"] for s in check.sections] == SECTIONS and all(not s["blank"] for s in check.sections)
    assert check.links_total >= len(SECTIONS) and check.broken_links == []
    assert check.page_size[1] > 3000 and not check.screenshot_blank
    shot = screenshot(hostile_report / "index.html", tmp_path / "report.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000


def test_compare_page_renders_in_chromium(chromium, make_run):
    result = compare_runs(make_run("base"), make_run("new", shift={("full", "image_qa"): 0.5}))
    check = check_page(result.out_dir / "index.html")
    assert check.ok, check.problems
    assert [s["id"] for s in check.sections] == ["overview", "flagged", "cells", "about"]


def test_trend_page_renders_in_chromium(chromium, make_run):
    drop = {("full", "image_qa"): 0.5}
    nights = [make_run(f"night-{i}", seed=i, shift=drop if i == 3 else None) for i in (1, 2, 3)]
    result = trend_runs(nights)
    check = check_page(result.out_dir / "index.html")
    assert check.ok, check.problems
    assert [s["id"] for s in check.sections] == ["drops", "cells", "about"]
    assert all(not s["blank"] for s in check.sections) and check.broken_links == []
    assert check.images_total == 1 and check.images_loaded == 1 and not check.screenshot_blank


BROKEN = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>broken</title></head><body>
<nav><a href="#fine">fine</a> <a href="#nowhere">nowhere</a> <a href="missing.html">missing</a>
<a href="https://example.org/">outside</a> <a href="other.html">other</a></nav>
<section id="fine"><h2>Fine</h2><p>Some text.</p>
<img alt="corrupt" src="data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAA">
<img alt="absent" src="absent.png"></section>
<section id="empty"></section>
<script>console.error("boom"); throw new Error("bad script");</script>
</body></html>
"""


def test_the_checks_catch_a_broken_page(chromium, tmp_path):
    (tmp_path / "other.html").write_text("<!DOCTYPE html><title>other</title>")
    (tmp_path / "broken.html").write_text(BROKEN)
    check = check_page(tmp_path / "broken.html")
    problems = "\n".join(check.problems)
    assert not check.ok and check.images_total == 2 and check.images_loaded == 0
    for expected in (
        "console.error: boom",
        "bad script",
        "image 'corrupt' not decoded",
        "image 'absent' not decoded",
        "section 'empty' renders blank",
        "'#nowhere': no element with id 'nowhere'",
        "'missing.html'",
        "'https://example.org/': https link",
    ):
        assert expected in problems, (expected, problems)
    assert "'#fine'" not in problems and "'other.html'" not in problems
    (tmp_path / "blank.html").write_text("<!DOCTYPE html><title>blank</title><body></body>")
    assert check_page(tmp_path / "blank.html").screenshot_blank


def test_the_first_screen_holds_the_verdict_and_the_seesaw_chart(chromium, hostile_report):
    """A reader who opens the report at 1400 x 900 sees the answer without scrolling: the overview's
    verdicts and the whole seesaw chart; run metadata and the unit grid come below."""
    check = check_page(hostile_report / "index.html")
    width, height = VIEWPORT
    first = {s["id"]: s for s in check.sections}
    assert first["overview"]["y"] < height / 3
    charts = [im for im in check.images if im["alt"] == "Relative score per modality by subnet"]
    assert charts, [im["alt"] for im in check.images]
    chart = charts[0]
    assert chart["y"] + chart["height"] <= height and chart["x"] + chart["width"] <= width, chart
    assert first["units"]["y"] > height  # the unit grid is below the first screen
