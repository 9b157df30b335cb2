"""The report in a real browser: every figure loads, the console stays clean, a screenshot is saved."""

from __future__ import annotations

import pytest

from reports import compare_runs
from reports.browser import check_page, find_chromium, screenshot

pytestmark = pytest.mark.slow


@pytest.fixture
def chromium():
    if find_chromium() is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")


def test_report_renders_in_chromium(chromium, hostile_report):
    # A hostile run: a task name and a prediction carrying <script>; escaping and the page's CSP must hold.
    out = hostile_report
    check = check_page(out / "index.html")
    assert check.images_total == 8 and check.images_loaded == check.images_total
    assert check.script_errors == 0 and check.console == []
    shot = screenshot(out / "index.html", out / "screenshot.png", (1400, 3000))
    assert shot.stat().st_size > 50_000


def test_compare_page_renders_in_chromium(chromium, make_run):
    result = compare_runs(make_run("base"), make_run("new", shift={("full", "image_qa"): 0.5}))
    check = check_page(result.out_dir / "index.html")
    assert check.ok, check
