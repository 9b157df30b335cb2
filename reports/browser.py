"""Open a report page in headless Chromium: did every figure load, did the console stay clean?

Used by the browser test (and handy by hand). Each call starts a fresh Chromium with a throw-away
profile and no network features; nothing here is needed to build a report.

* :func:`check_page` dumps the DOM after the load event and reads the attributes the page's own
  script sets on ``<html>`` (``data-images="loaded/total"``, ``data-errors``; see
  :mod:`reports.html`), and collects every ``CONSOLE`` line of Chromium's log (script errors, CSP
  violations, failed loads).
* :func:`screenshot` saves a PNG of the page.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
)
_ATTR = re.compile(r'<html[^>]*?\bdata-images="(\d+)/(\d+)"')
_ERRORS = re.compile(r'<html[^>]*?\bdata-errors="(\d+)"')


@dataclass(frozen=True)
class PageCheck:
    """What the browser saw."""

    images_loaded: int
    images_total: int
    script_errors: int
    console: list[str]
    """Chromium's ``CONSOLE`` log lines (any message the page produced)."""

    @property
    def ok(self) -> bool:
        """Every image loaded and nothing was logged."""
        return (
            self.images_total > 0
            and self.images_loaded == self.images_total
            and not self.script_errors
            and (not self.console)
        )


def find_chromium() -> str | None:
    """The path of a Chromium/Chrome executable, or None."""
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("no chromium executable on PATH")
    with tempfile.TemporaryDirectory(prefix="ernie5-chromium-") as profile:
        cmd = [exe, *FLAGS, f"--user-data-dir={profile}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def check_page(path: str | Path, timeout: float = 90.0) -> PageCheck:
    """Load ``path`` (a file) and report images loaded, script errors and console messages."""
    url = Path(path).resolve().as_uri()
    proc = _run(
        ["--enable-logging=stderr", "--v=0", "--virtual-time-budget=15000", "--dump-dom", url], timeout
    )
    images = _ATTR.search(proc.stdout)
    errors = _ERRORS.search(proc.stdout)
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    if images is None:
        raise RuntimeError(
            f"chromium did not report the page's image count (rc={proc.returncode}): "
            f"{proc.stderr.strip().splitlines()[-1:] or ''}"
        )
    return PageCheck(
        int(images.group(1)), int(images.group(2)), int(errors.group(1)) if errors else 0, console
    )


def screenshot(
    path: str | Path, png: str | Path, size: tuple[int, int] = (1400, 3000), timeout: float = 90.0
) -> Path:
    """Save a ``size`` screenshot of the page at ``path`` to ``png``."""
    png = Path(png).resolve()
    url = Path(path).resolve().as_uri()
    _run(
        [f"--screenshot={png}", f"--window-size={size[0]},{size[1]}", "--virtual-time-budget=15000", url],
        timeout,
    )
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png
