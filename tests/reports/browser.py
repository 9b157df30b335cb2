"""Open a report page in headless Chromium and check what a reader would see.

Used by the browser test (and handy by hand: ``python -m tests.reports.browser PAGE.html [SHOT.png]``).
Each call starts a fresh Chromium with a throw-away profile and no network features and drives it
over the DevTools protocol on a pipe (``--remote-debugging-pipe``: no port, no extra package);
nothing here is needed to build a report.

:func:`check_page` loads the page, waits for its load event and then reports:

* every console message, uncaught exception and warning or error log entry (script errors, CSP
  violations, failed loads);
* every image: decoded (``img.decode()`` resolved), its natural size, whether it is laid out;
* every ``<section>``: its box and how much text it holds, and whether its part of a full-page
  screenshot is blank;
* every link: an in-page anchor must have its target, a relative or ``file:`` link must name an
  existing file; anything else (``http:``...) cannot resolve offline and counts as broken;
* the counters the page's own script sets on ``<html>`` (``data-images="loaded/total"``,
  ``data-errors``; see :mod:`reports.html`).

:func:`screenshot` saves a full-page PNG.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import io
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

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
    "--remote-debugging-pipe",
)
VIEWPORT = (1400, 900)
SHOT_SCALE = 0.5
"""Scale of the full-page screenshot used for the blankness checks (keeps tall pages small)."""
INK = 24
"""A pixel differing from its region's most common colour by more than this (any channel) is ink."""
MIN_INK_SHARE = 0.002
"""Below this share of ink pixels, a region of the screenshot is blank."""

_PROBE = """(async () => {
  const imgs = Array.from(document.images);
  const decoded = await Promise.all(imgs.map(i => i.decode().then(() => true, () => false)));
  const box = e => { const r = e.getBoundingClientRect();
    return {x: r.left + scrollX, y: r.top + scrollY, width: r.width, height: r.height}; };
  const d = document.documentElement;
  return {
    images: imgs.map((i, k) => ({alt: i.alt, decoded: decoded[k], complete: i.complete,
      natural_width: i.naturalWidth, natural_height: i.naturalHeight, ...box(i),
      folded: !!i.closest('details:not([open])')})),
    sections: Array.from(document.querySelectorAll('section')).map(s => ({id: s.id,
      title: (s.querySelector('h2') || {textContent: ''}).textContent, ...box(s),
      text_chars: s.innerText.trim().length})),
    links: Array.from(document.querySelectorAll('a[href]')).map(a => ({href: a.getAttribute('href'),
      url: a.href, same_page: a.href.split('#')[0] === location.href.split('#')[0],
      target_found: a.hash ? !!document.getElementById(decodeURIComponent(a.hash.slice(1))) : null})),
    data_images: d.getAttribute('data-images'), data_errors: d.getAttribute('data-errors'),
  };
})()"""


@dataclass(frozen=True)
class PageCheck:
    """What the browser saw."""

    images_loaded: int
    """Images decoded with a non-zero natural size."""
    images_total: int
    script_errors: int
    """Uncaught exceptions (and the page script's own ``data-errors`` count, whichever is larger)."""
    console: list[str]
    """Console messages, uncaught exceptions and warning/error log entries, one line each."""
    images: list[dict[str, Any]] = field(default_factory=list)
    sections: list[dict[str, Any]] = field(default_factory=list)
    """Per ``<section>``: id, title, box, ``text_chars`` and ``blank`` (its part of the screenshot)."""
    broken_links: list[str] = field(default_factory=list)
    """``href`` values that do not resolve, each with why."""
    links_total: int = 0
    screenshot_blank: bool = True
    page_size: tuple[int, int] = (0, 0)
    """Width and height of the whole page (CSS pixels)."""
    page_counters: str = ""
    """The page script's ``data-images`` attribute (empty if the script did not run)."""

    @property
    def problems(self) -> list[str]:
        """Everything wrong with the page, one line each (empty: the page is fine)."""
        out = list(self.console)
        if self.script_errors:
            out.append(f"{self.script_errors} script error(s)")
        if not self.images_total:
            out.append("no images")
        for im in self.images:
            if not (im["decoded"] and im["natural_width"] > 0 and im["natural_height"] > 0):
                out.append(
                    f"image {im['alt']!r} not decoded (natural size {im['natural_width']}x"
                    f"{im['natural_height']})"
                )
            elif not im["folded"] and not (im["width"] > 0 and im["height"] > 0):
                out.append(f"image {im['alt']!r} is not laid out")
        if not self.sections:
            out.append("no sections")
        for s in self.sections:
            if not (s["height"] > 0 and s["text_chars"] > 0) or s["blank"]:
                out.append(f"section {s['id']!r} renders blank ({s['height']:.0f} px high)")
        out += [f"link {b}" for b in self.broken_links]
        if self.screenshot_blank:
            out.append("the full-page screenshot is blank")
        if self.page_counters != f"{self.images_loaded}/{self.images_total}":
            out.append(f"the page's own script counted images {self.page_counters or '(did not run)'}")
        return out

    @property
    def ok(self) -> bool:
        """Nothing logged, every image decoded and laid out, every section drawn, every link resolves."""
        return not self.problems


def find_chromium() -> str | None:
    """The path of a Chromium/Chrome executable, or None."""
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


_EXEC_WITH_PIPE = (
    "import fcntl, os, sys\n"
    "r, w = (fcntl.fcntl(int(a), fcntl.F_DUPFD, 10) for a in sys.argv[1:3])\n"
    "os.dup2(r, 3); os.dup2(w, 4)\n"
    "[os.close(fd) for fd in {r, w, int(sys.argv[1]), int(sys.argv[2])} - {3, 4}]\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n"
)


class Browser:
    """A headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4 of Chromium)."""

    def __init__(self, timeout: float = 60.0) -> None:
        exe = find_chromium()
        if exe is None:
            raise FileNotFoundError("no chromium executable on PATH (apt-get install -y chromium)")
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="ernie5-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        for fd in (self._to_chrome, self._from_chrome):
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
        args = [*FLAGS, f"--user-data-dir={self._profile.name}", "about:blank"]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _EXEC_WITH_PIPE, str(to_chrome_r), str(from_chrome_w), exe, *args],
            pass_fds=(to_chrome_r, from_chrome_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Ask Chromium to quit, then make sure it has."""
        try:
            if self.proc.poll() is None:
                self._write({"id": -1, "method": "Browser.close", "params": {}})
                self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            for fd in (self._to_chrome, self._from_chrome):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._profile.cleanup()

    def _write(self, msg: dict[str, Any]) -> None:
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self._to_chrome, data) :]

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_chrome], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError(f"chromium did not answer within {self.timeout:.0f} s")
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited (rc={self.proc.poll()})")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict:
        """Send one command and return its result (events that arrive meanwhile are kept)."""
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._write(msg)
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"chromium: {method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, session: str | None = None) -> dict:
        """The first event ``method`` (of ``session``) received, waiting for it if needed."""
        deadline = time.monotonic() + self.timeout
        seen = 0
        while True:
            for ev in self.events[seen:]:
                if ev.get("method") == method and ev.get("sessionId") == session:
                    return ev
            seen = len(self.events)
            self.events.append(self._read(deadline))

    def open(self, url: str, viewport: tuple[int, int] = VIEWPORT) -> str:
        """A new tab showing ``url`` after its load event; returns its session id."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable", session=session)
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": viewport[0], "height": viewport[1], "deviceScaleFactor": 1, "mobile": False},
            session,
        )
        self.send("Page.navigate", {"url": url}, session)
        self.wait_for("Page.loadEventFired", session)
        return session

    def full_page_png(self, session: str, scale: float = 1.0) -> bytes:
        """A PNG of the whole page (not only the viewport) at ``scale``."""
        size = self.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": scale}
        shot = self.send(
            "Page.captureScreenshot",
            {"format": "png", "captureBeyondViewport": True, "clip": clip},
            session,
        )
        return base64.b64decode(shot["data"])

    def messages(self, session: str) -> tuple[list[str], int]:
        """Console lines (see :attr:`PageCheck.console`) and the number of uncaught exceptions."""
        lines, exceptions = [], 0
        for ev in self.events:
            if ev.get("sessionId") != session:
                continue
            p = ev.get("params", {})
            if ev.get("method") == "Runtime.consoleAPICalled":
                args = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
                lines.append(f"console.{p.get('type')}: {args}")
            elif ev.get("method") == "Runtime.exceptionThrown":
                exceptions += 1
                d = p.get("exceptionDetails", {})
                lines.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif ev.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") in (
                "warning",
                "error",
            ):
                e = p["entry"]
                lines.append(
                    f"log {e['level']} ({e.get('source')}): {e.get('text')} {e.get('url', '')}".rstrip()
                )
        return lines, exceptions


def _ink_share(pixels: Any) -> float:
    """Share of pixels of an RGB array that differ from its most common colour (see :data:`INK`);
    the background colour is the mode of a sample of the pixels."""
    import numpy as np

    flat = pixels.reshape(-1, pixels.shape[-1]).astype(np.int32)
    if not len(flat):
        return 0.0
    packed = (flat[:, 0] << 16) | (flat[:, 1] << 8) | flat[:, 2]
    colours, counts = np.unique(packed[:: max(1, len(packed) // 20_000)], return_counts=True)
    mode = int(colours[counts.argmax()])
    background = np.array([(mode >> 16) & 255, (mode >> 8) & 255, mode & 255], dtype=np.int32)
    return float((np.abs(flat - background).max(axis=1) > INK).mean())


def _link_problem(link: dict[str, Any]) -> str:
    """Why ``link`` does not resolve ("" when it does)."""
    url = urlparse(link["url"])
    if link["same_page"] and url.fragment:
        return "" if link["target_found"] else f"{link['href']!r}: no element with id {url.fragment!r}"
    if url.scheme == "file":
        path = Path(unquote(url.path))
        return "" if path.exists() else f"{link['href']!r}: {path} does not exist"
    if link["same_page"]:
        return ""
    return f"{link['href']!r}: {url.scheme or 'relative'} link, not resolvable offline"


def check_page(path: str | Path, timeout: float = 60.0) -> PageCheck:
    """Load ``path`` (a file) in headless Chromium and report what rendered (see the module doc)."""
    import numpy as np
    from PIL import Image

    url = Path(path).resolve().as_uri()
    with Browser(timeout) as browser:
        session = browser.open(url)
        probe = browser.send(
            "Runtime.evaluate", {"expression": _PROBE, "awaitPromise": True, "returnByValue": True}, session
        )
        if "exceptionDetails" in probe:
            raise RuntimeError(f"the page probe failed: {probe['exceptionDetails'].get('text')}")
        seen = probe["result"]["value"]
        png = browser.full_page_png(session, SHOT_SCALE)
        console, exceptions = browser.messages(session)
    shot = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    sections = []
    for s in seen["sections"]:
        top, left = int(s["y"] * SHOT_SCALE), int(s["x"] * SHOT_SCALE)
        region = shot[top : top + int(s["height"] * SHOT_SCALE), left : left + int(s["width"] * SHOT_SCALE)]
        sections.append({**s, "blank": _ink_share(region) < MIN_INK_SHARE})
    images = seen["images"]
    loaded = sum(bool(i["decoded"] and i["natural_width"] > 0 and i["natural_height"] > 0) for i in images)
    page_errors = int(seen["data_errors"] or 0)
    return PageCheck(
        images_loaded=loaded,
        images_total=len(images),
        script_errors=max(exceptions, page_errors),
        console=console,
        images=images,
        sections=sections,
        broken_links=[p for link in seen["links"] if (p := _link_problem(link))],
        links_total=len(seen["links"]),
        screenshot_blank=_ink_share(shot) < MIN_INK_SHARE,
        page_size=(int(shot.shape[1] / SHOT_SCALE), int(shot.shape[0] / SHOT_SCALE)),
        page_counters=seen["data_images"] or "",
    )


def screenshot(path: str | Path, png: str | Path, width: int = VIEWPORT[0], timeout: float = 60.0) -> Path:
    """Save a full-page screenshot of the page at ``path`` (``width`` CSS pixels wide) to ``png``."""
    png = Path(png)
    with Browser(timeout) as browser:
        session = browser.open(Path(path).resolve().as_uri(), (width, VIEWPORT[1]))
        png.write_bytes(browser.full_page_png(session))
    return png


if __name__ == "__main__":
    page = sys.argv[1]
    result = check_page(page)
    print(json.dumps({"ok": result.ok, "problems": result.problems, "page_size": result.page_size}, indent=1))
    if len(sys.argv) > 2:
        print(screenshot(page, sys.argv[2]))
    sys.exit(0 if result.ok else 1)
