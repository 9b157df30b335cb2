"""Digit sources other than MNIST: MNIST's framing, the fonts, the procedural pen, and the USPS and
Semeion readers (on small files written here; the real ones are not in the shared data root)."""

from __future__ import annotations

import gzip
import random

import numpy as np
import pytest

from ernie5.data.digit_sources import (
    font_digit,
    font_files,
    frame_like_mnist,
    read_semeion,
    read_usps,
    stroke_digit,
    stroke_digits,
)
from ernie5.data.root import DataMissing
from ernie5.data.text import DataCorrupt


def _centre_of_mass(img: np.ndarray) -> tuple[float, float]:
    w = img.astype(np.float64)
    ys, xs = np.indices(w.shape)
    return (ys * w).sum() / w.sum(), (xs * w).sum() / w.sum()


def _box(img: np.ndarray) -> tuple[int, int]:
    ys, xs = np.nonzero(img > 0)
    return ys.max() - ys.min() + 1, xs.max() - xs.min() + 1


def test_frame_like_mnist_scales_the_box_to_20_and_centres_the_mass() -> None:
    gray = np.zeros((60, 90))
    gray[5:45, 60:80] = 3.0  # a 40 x 20 bar in a corner, values not 0..255
    out = frame_like_mnist(gray)
    assert out.shape == (28, 28) and out.dtype == np.uint8 and out.max() == 255
    h, w = _box(out)
    assert 20 <= h <= 21 and 10 <= w <= 12  # longer side 20 px, aspect kept (Lanczos may ring one px)
    cy, cx = _centre_of_mass(out)
    assert abs(cy - 14) <= 1 and abs(cx - 14) <= 1


def test_frame_like_mnist_blank_and_bad_shape() -> None:
    assert not frame_like_mnist(np.full((16, 16), 7.0)).any()
    with pytest.raises(ValueError, match=r"must be 2-D .* got shape \(2, 16, 16\)"):
        frame_like_mnist(np.zeros((2, 16, 16)))


def test_stroke_digits_are_seeded_balanced_and_distinct() -> None:
    a, la = stroke_digits(40, seed=3)
    b, lb = stroke_digits(40, seed=3)
    c, _ = stroke_digits(40, seed=4)
    assert a.shape == (40, 28, 28) and a.dtype == np.uint8
    assert np.array_equal(a, b) and np.array_equal(la, lb) and not np.array_equal(a, c)
    assert np.array_equal(la, np.arange(40) % 10)
    assert all(img.max() == 255 and _box(img)[0] >= 19 for img in a)  # inked and framed
    means = np.stack([a[la == d].mean(0) for d in range(10)])
    gaps = [np.abs(means[i] - means[j]).mean() for i in range(10) for j in range(i + 1, 10)]
    assert min(gaps) > 5  # the ten classes draw different shapes
    assert stroke_digits(0)[0].shape == (0, 28, 28)


def test_stroke_digit_varies_within_a_class() -> None:
    rng = random.Random(0)
    sevens = [stroke_digit(7, rng) for _ in range(8)]
    assert len({s.tobytes() for s in sevens}) == 8


def test_font_digits() -> None:
    fonts = font_files()
    assert len(fonts) >= 10 and not any("LastResort" in f for f in fonts)
    rng = random.Random(0)
    imgs = [font_digit(d, rng) for d in range(10)]
    assert all(i.shape == (28, 28) and i.dtype == np.uint8 and i.max() == 255 for i in imgs)
    assert len({i.tobytes() for i in imgs}) == 10


def test_read_usps(tmp_path) -> None:
    (tmp_path / "usps").mkdir()
    rows = []
    for label in (3, 7):
        pix = -np.ones((16, 16))
        pix[2:14, 6:10] = 1.0
        rows.append(" ".join([f"{label:.4f}", *(f"{v:.4f}" for v in pix.ravel())]))
    with gzip.open(tmp_path / "usps" / "zip.test.gz", "wt") as f:
        f.write("\n".join(rows) + "\n")
    images, labels = read_usps(tmp_path)
    assert images.shape == (2, 28, 28) and list(labels) == [3, 7] and _box(images[0])[0] == 20


def test_read_usps_errors(tmp_path) -> None:
    with pytest.raises(DataMissing, match="usps/zip.test.gz"):
        read_usps(tmp_path)
    (tmp_path / "usps").mkdir()
    with gzip.open(tmp_path / "usps" / "zip.test.gz", "wt") as f:
        f.write("1 2 3\n")
    with pytest.raises(DataCorrupt, match="expected 257 columns"):
        read_usps(tmp_path)


def _semeion_line(label: int, extra: str = "") -> str:
    pix = np.zeros((16, 16), int)
    pix[1:15, 7:9] = 1
    onehot = ["1" if d == label else "0" for d in range(10)]
    return " ".join([*map(str, pix.ravel()), *onehot]) + extra


def test_read_semeion(tmp_path) -> None:
    (tmp_path / "semeion").mkdir()
    # UCI's layout, and a mirror's that appends a packed label column: both read the same
    text = "\n".join([_semeion_line(1), _semeion_line(4, " 0000100000")]) + "\n\n"
    (tmp_path / "semeion" / "semeion.data").write_text(text)
    images, labels = read_semeion(tmp_path)
    assert images.shape == (2, 28, 28) and list(labels) == [1, 4]


def test_read_semeion_names_the_bad_line(tmp_path) -> None:
    (tmp_path / "semeion").mkdir()
    (tmp_path / "semeion" / "semeion.data").write_text(_semeion_line(1) + "\n0 1 0\n")
    with pytest.raises(DataCorrupt, match=r"semeion.data:2: 3 fields, expected at least 266"):
        read_semeion(tmp_path)
