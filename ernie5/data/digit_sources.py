"""Digit images from sources other than MNIST, framed the MNIST way: training variety and cross-source tests.

MNIST's framing: the digit's bounding box is scaled (aspect kept) to fit a 20 x 20 box, anti-aliased, and
placed in a 28 x 28 frame so that its centre of mass is at the centre (LeCun et al.). :func:`frame_like_mnist`
applies it to any grayscale digit, so digits of any collection enter the project exactly as MNIST's do
(:func:`ernie5.data.mnist.digit_image` then adds the 2 px border of the 32 x 32 image).

Sources:

* ``fonts`` (training): the digits 0-9 typeset in the fonts matplotlib ships (DejaVu Sans, Serif and Mono
  with their bold and oblique faces, STIX, Computer Modern), each drawn with a random slant, stretch,
  rotation and stroke weight. Printed digits are a second style of the same ten classes.
* ``strokes`` (never trained on; the harness's cross-source digit task, ``digit_vqa_strokes``): a
  procedural pen: every digit is one of a few hand-written allographs (an open or closed 4, a 7 with or
  without a bar, a 1 with or without a flag and foot, a looped or plain 2, a straight or curved 9 ...),
  each a few cubic Bezier strokes whose control points are jittered, slanted and stretched, drawn with a
  random pen width. It shares no pixels, writers or generator with MNIST or with the fonts.
* ``usps`` and ``semeion`` (data root, optional; never trained on): the USPS test set (``usps/zip.test.gz``,
  2,007 digits of 16 x 16 in [-1, 1], Hastie et al.'s ESL copy) and the Semeion handwritten digits
  (``semeion/semeion.data``, 1,593 binary 16 x 16 digits by about 80 writers, UCI). Both are real
  handwriting from other collections; a data root without them skips those tasks with how to get them.

scikit-learn's bundled 8 x 8 digits are read by no source here: they are kept for an independent check.

References:
  * Y. LeCun et al., "Gradient-based learning applied to document recognition", 1998 (MNIST's framing).
  * J. J. Hull, "A database for handwritten text recognition research", IEEE PAMI 1994 (USPS).
  * Semeion Research Center, "Semeion Handwritten Digit", UCI Machine Learning Repository, 2008.

Deviations:
  1. The mass centring rounds to whole pixels and clips the box inside the frame, as most re-implementations
     do; MNIST's own centring was done at 28 x 28 with the same rounding.
  2. The pen model draws constant-width strokes (no pressure, no ink dynamics); its allographs are the
     common Latin-script forms, not a writer survey.
"""

from __future__ import annotations

import gzip
import random
from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ernie5.data.root import require_file
from ernie5.data.text import DataCorrupt

USPS_PATH = "usps/zip.test.gz"
USPS_HOW_TO_GET = (
    "the USPS test digits zip.test.gz (hastie.su.domains/ElemStatLearn/datasets/zip.test.gz) -> <root>/usps/"
)
SEMEION_PATH = "semeion/semeion.data"
SEMEION_HOW_TO_GET = (
    "semeion.data (archive.ics.uci.edu/dataset/178/semeion+handwritten+digit) -> <root>/semeion/"
)
INK_THRESHOLD = 20
"""Pixels above this (0-255, after stretching the digit to 0-255) count as ink for the bounding box."""


def frame_like_mnist(gray: np.ndarray) -> np.ndarray:
    """A grayscale digit (bright ink on dark, any size and range) as MNIST frames it: ``uint8 (28, 28)``.

    The values are stretched to 0-255, the ink's bounding box is resized (Lanczos, aspect kept) so that its
    longer side is 20 px, and it is placed with its centre of mass at (14, 14), clipped inside the frame.
    An image without ink is all zeros.
    """
    g = np.asarray(gray, dtype=np.float64)
    if g.ndim != 2:
        raise ValueError(f"digit image must be 2-D (h, w), got shape {g.shape}")
    span = g.max() - g.min()
    if span <= 0:
        return np.zeros((28, 28), np.uint8)
    g = (g - g.min()) / span * 255.0
    ys, xs = np.nonzero(g > INK_THRESHOLD)
    g = g[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    h, w = g.shape
    scale = 20.0 / max(h, w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    box = np.asarray(Image.fromarray(g.astype(np.uint8)).resize((nw, nh), Image.LANCZOS), dtype=np.float64)
    mass = box.sum() + 1e-9
    cy = (box.sum(1) * np.arange(nh)).sum() / mass
    cx = (box.sum(0) * np.arange(nw)).sum() / mass
    top = min(max(int(round(14 - cy)), 0), 28 - nh)
    left = min(max(int(round(14 - cx)), 0), 28 - nw)
    out = np.zeros((28, 28))
    out[top : top + nh, left : left + nw] = box
    return out.clip(0, 255).astype(np.uint8)


# ---------------------------------------------------------------------- fonts
@cache
def font_files() -> tuple[str, ...]:
    """The TrueType fonts bundled with matplotlib that have the ten digits (sorted paths)."""
    import matplotlib

    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    out = []
    for path in sorted(folder.glob("*.ttf")):
        if "Display" in path.name or path.name.startswith(
            ("cmex", "cmsy", "STIXNonUni", "STIXSiz", "LastResort")
        ):
            continue  # symbol, size-variant and fallback fonts: no plain digits
        out.append(str(path))
    return tuple(out)


def font_digit(digit: int, rng: random.Random, size: int = 28) -> np.ndarray:
    """``digit`` typeset in a random bundled font with a random slant, stretch, rotation and stroke
    weight, framed like MNIST: ``uint8 (28, 28)``."""
    big = 96
    font = ImageFont.truetype(rng.choice(font_files()), 72)
    canvas = Image.new("L", (big, big), 0)
    ImageDraw.Draw(canvas).text((big // 2, big // 2), str(digit), fill=255, font=font, anchor="mm")
    shear, stretch = rng.uniform(-0.35, 0.35), rng.uniform(0.75, 1.25)
    canvas = canvas.transform(
        (big, big), Image.AFFINE, (stretch, shear, -shear * big / 2 + (1 - stretch) * big / 2, 0, 1, 0),
        resample=Image.BILINEAR,
    )  # fmt: skip
    canvas = canvas.rotate(rng.uniform(-12, 12), resample=Image.BILINEAR)
    arr = np.asarray(canvas, dtype=np.float64)
    weight = rng.choice((-1, 0, 0, 1, 2))  # erode / keep / dilate, in 3x3 max/min filter passes
    for _ in range(abs(weight)):
        arr = _filter3(arr, np.maximum if weight > 0 else np.minimum)
    return frame_like_mnist(arr)


def _filter3(a: np.ndarray, op) -> np.ndarray:
    p = np.pad(a, 1)
    out = a.copy()
    for dy in (0, 1, 2):
        for dx in (0, 1, 2):
            out = op(out, p[dy : dy + a.shape[0], dx : dx + a.shape[1]])
    return out


# ---------------------------------------------------------------------- pen strokes
# ruff: noqa: E501 - the allograph table below keeps one allograph per line
# Allographs: each is a list of strokes, each stroke a list of cubic Bezier segments (4 points each, the
# first point of a segment is the last of the one before), in a box x 0..0.6, y 0..1 (y down).
_C = 0.5523  # circle by four cubics
_LOOP = lambda cx, cy, rx, ry: [  # noqa: E731 - a closed ellipse starting at its top, clockwise
    [(cx, cy - ry), (cx + _C * rx, cy - ry), (cx + rx, cy - _C * ry), (cx + rx, cy)],
    [(cx + rx, cy), (cx + rx, cy + _C * ry), (cx + _C * rx, cy + ry), (cx, cy + ry)],
    [(cx, cy + ry), (cx - _C * rx, cy + ry), (cx - rx, cy + _C * ry), (cx - rx, cy)],
    [(cx - rx, cy), (cx - rx, cy - _C * ry), (cx - _C * rx, cy - ry), (cx, cy - ry)],
]
_LINE = lambda a, b: [a, (a[0] + (b[0] - a[0]) / 3, a[1] + (b[1] - a[1]) / 3),  # noqa: E731
                      (a[0] + 2 * (b[0] - a[0]) / 3, a[1] + 2 * (b[1] - a[1]) / 3), b]  # fmt: skip
ALLOGRAPHS: dict[int, list[list[list[tuple[float, float]]]]] = {
    0: [[_LOOP(0.3, 0.5, 0.27, 0.48)]],
    1: [[[_LINE((0.3, 0.02), (0.3, 1.0))]],
        [[_LINE((0.12, 0.22), (0.32, 0.02)), _LINE((0.32, 0.02), (0.32, 1.0))]],
        [[_LINE((0.12, 0.22), (0.32, 0.02)), _LINE((0.32, 0.02), (0.32, 1.0))], [_LINE((0.12, 1.0), (0.52, 1.0))]]],
    2: [[[[(0.05, 0.25), (0.08, -0.05), (0.58, -0.05), (0.55, 0.3)], [(0.55, 0.3), (0.5, 0.55), (0.1, 0.8), (0.03, 1.0)],
          _LINE((0.03, 1.0), (0.6, 1.0))]],
        [[[(0.05, 0.25), (0.08, -0.05), (0.58, -0.05), (0.55, 0.3)], [(0.55, 0.3), (0.5, 0.55), (0.1, 0.8), (0.03, 1.0)],
          [(0.03, 1.0), (0.15, 0.8), (0.3, 0.85), (0.25, 0.95)], _LINE((0.25, 0.95), (0.6, 1.0))]]],
    3: [[[[(0.05, 0.12), (0.3, -0.08), (0.62, 0.05), (0.5, 0.3)], [(0.5, 0.3), (0.42, 0.45), (0.25, 0.47), (0.2, 0.47)],
          [(0.2, 0.47), (0.65, 0.45), (0.7, 0.8), (0.45, 0.95)], [(0.45, 0.95), (0.3, 1.03), (0.1, 1.0), (0.02, 0.88)]]],
        [[_LINE((0.05, 0.02), (0.55, 0.02)), _LINE((0.55, 0.02), (0.25, 0.42)),
          [(0.25, 0.42), (0.7, 0.4), (0.7, 0.95), (0.35, 0.98)], [(0.35, 0.98), (0.2, 1.0), (0.08, 0.95), (0.02, 0.85)]]]],
    4: [[[_LINE((0.4, 0.0), (0.02, 0.68)), _LINE((0.02, 0.68), (0.6, 0.68))], [_LINE((0.45, 0.3), (0.45, 1.0))]],
        [[_LINE((0.08, 0.0), (0.05, 0.6)), _LINE((0.05, 0.6), (0.58, 0.6))], [_LINE((0.45, 0.05), (0.45, 1.0))]]],
    5: [[[_LINE((0.55, 0.02), (0.12, 0.02)), _LINE((0.12, 0.02), (0.08, 0.42)),
          [(0.08, 0.42), (0.55, 0.25), (0.72, 0.7), (0.45, 0.93)], [(0.45, 0.93), (0.3, 1.03), (0.1, 1.0), (0.02, 0.88)]]],
        [[_LINE((0.12, 0.02), (0.08, 0.42)), [(0.08, 0.42), (0.55, 0.25), (0.72, 0.7), (0.45, 0.93)],
          [(0.45, 0.93), (0.3, 1.03), (0.1, 1.0), (0.02, 0.88)]], [_LINE((0.12, 0.02), (0.58, 0.0))]]],
    6: [[[[(0.5, 0.0), (0.2, 0.15), (0.02, 0.45), (0.05, 0.72)]] + _LOOP(0.3, 0.72, 0.25, 0.27)[2:] + _LOOP(0.3, 0.72, 0.25, 0.27)[:2]]],
    7: [[[_LINE((0.02, 0.02), (0.58, 0.02)), _LINE((0.58, 0.02), (0.22, 1.0))]],
        [[_LINE((0.02, 0.02), (0.58, 0.02)), _LINE((0.58, 0.02), (0.22, 1.0))], [_LINE((0.15, 0.5), (0.55, 0.5))]]],
    8: [[_LOOP(0.3, 0.25, 0.2, 0.23), _LOOP(0.3, 0.72, 0.26, 0.27)]],
    9: [[_LOOP(0.3, 0.27, 0.25, 0.26), [_LINE((0.55, 0.27), (0.55, 1.0))]],
        [_LOOP(0.3, 0.27, 0.25, 0.26), [[(0.55, 0.27), (0.58, 0.6), (0.45, 0.9), (0.2, 1.0)]]]],
}  # fmt: skip
"""Per digit, its allographs; an allograph is a list of pen strokes (pen down for each)."""


def _bezier(p: np.ndarray, n: int = 16) -> np.ndarray:
    t = np.linspace(0, 1, n)[:, None]
    return (1 - t) ** 3 * p[0] + 3 * (1 - t) ** 2 * t * p[1] + 3 * (1 - t) * t**2 * p[2] + t**3 * p[3]


def stroke_digit(digit: int, rng: random.Random) -> np.ndarray:
    """``digit`` drawn by the procedural pen (a random allograph, jittered control points, random slant,
    stretch, rotation and pen width), framed like MNIST: ``uint8 (28, 28)``."""
    strokes = rng.choice(ALLOGRAPHS[digit])
    big, margin = 112, 16
    slant, stretch, angle = rng.uniform(-0.3, 0.3), rng.uniform(0.7, 1.3), rng.uniform(-0.2, 0.2)
    jitter = rng.uniform(0.01, 0.05)
    cos, sin = np.cos(angle), np.sin(angle)
    width = rng.uniform(4.0, 11.0)
    canvas = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(canvas)
    for stroke in strokes:
        pts = []
        for seg in stroke:
            p = np.asarray(seg, dtype=np.float64) + np.array(
                [[rng.gauss(0, jitter), rng.gauss(0, jitter)] for _ in seg]
            )
            pts.append(_bezier(p))
        xy = np.concatenate(pts)
        x, y = xy[:, 0] * stretch + slant * (1 - xy[:, 1]), xy[:, 1]
        x, y = cos * x - sin * y, sin * x + cos * y
        scale = big - 2 * margin
        line = [(margin + scale * (xi + 0.2), margin + scale * yi) for xi, yi in zip(x, y)]
        draw.line(line, fill=255, width=int(round(width)), joint="curve")
        r = width / 2  # round pen tips
        for cx, cy in (line[0], line[-1]):
            draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
    return frame_like_mnist(np.asarray(canvas))


def stroke_digits(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pen-stroke digits, classes balanced in turn (``i % 10``), seeded:
    ``(uint8 (n, 28, 28), int64 (n,))``."""
    rng = random.Random(seed)
    labels = np.arange(n, dtype=np.int64) % 10
    return np.stack([stroke_digit(int(d), rng) for d in labels]) if n else np.zeros(
        (0, 28, 28), np.uint8
    ), labels


# ---------------------------------------------------------------------- data-root collections
def read_usps(root: str | Path | None) -> tuple[np.ndarray, np.ndarray]:
    """The USPS test digits (``usps/zip.test.gz``: lines of ``label v1 ... v256``, values in [-1, 1],
    ink +1), framed like MNIST: ``(uint8 (N, 28, 28), int64 (N,))``."""
    path = require_file(root, USPS_PATH, USPS_HOW_TO_GET)
    try:
        with gzip.open(path, "rt") as f:
            rows = [line.split() for line in f if line.strip()]
        values = np.asarray(rows, dtype=np.float64)
    except (OSError, EOFError, ValueError) as e:
        raise DataCorrupt(path, None, f"not a gzip table of numbers ({e})") from None
    if values.ndim != 2 or values.shape[1] != 257:
        raise DataCorrupt(path, None, f"expected 257 columns (label + 16x16), got {values.shape}")
    labels = values[:, 0].astype(np.int64)
    images = (values[:, 1:].reshape(-1, 16, 16) + 1.0) * 127.5
    return np.stack([frame_like_mnist(i) for i in images]), labels


def read_semeion(root: str | Path | None) -> tuple[np.ndarray, np.ndarray]:
    """The Semeion digits (``semeion/semeion.data``: 256 binary pixels then a one-hot label per line),
    framed like MNIST: ``(uint8 (N, 28, 28), int64 (N,))``."""
    path = require_file(root, SEMEION_PATH, SEMEION_HOW_TO_GET)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataCorrupt(path, None, f"not a text table ({e})") from None
    rows = []
    for i, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) < 266:  # UCI's file: 256 pixels + 10 one-hot label fields; mirrors may append more
            raise DataCorrupt(
                path, i, f"{len(fields)} fields, expected at least 266 (256 pixels + 10 labels)"
            )
        rows.append(fields[:266])
    try:
        values = np.asarray(rows, dtype=np.float64).reshape(len(rows), 266)
    except ValueError as e:
        raise DataCorrupt(path, None, f"not a table of numbers ({e})") from None
    if values.ndim != 2 or values.shape[1] != 266:
        raise DataCorrupt(path, None, f"expected 266 columns (256 pixels + 10 labels), got {values.shape}")
    labels = values[:, 256:].argmax(1).astype(np.int64)
    return np.stack([frame_like_mnist(i * 255.0) for i in values[:, :256].reshape(-1, 16, 16)]), labels
