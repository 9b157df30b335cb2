"""MNIST digits from the data root, and scikit-learn's bundled 8x8 digits, in the project's image format.

The project's image format: ``numpy.uint8`` arrays, an image is ``(H, W, 3)`` RGB and grayscale digits are
replicated to three channels. :func:`digit_image` turns a raw 28x28 MNIST digit into that format at any
size; the layout is the same at every size (the 28x28 digit fills ``28/32`` of the side, centred), so a
64x64 rendering is the 32x32 one at twice the resolution.

Layout (relative to the root): ``mnist/t10k-images-idx3-ubyte.gz`` and ``mnist/t10k-labels-idx1-ubyte.gz``
(the LeCun files, gzip-compressed IDX).

Deviations:
  1. Only the 10,000 MNIST *test* images are available, so :func:`mnist_split` splits them itself, not
     into the standard 60k/10k. The split is a stratified stride, no RNG: counting the images of each
     digit class in file order (0, 1, 2, ...), every fifth one (count ``% 5 == 4``) is ``test``, the rest
     ``train``: 8,004 train and 1,996 test images, each class within 0.1 point of its overall share in
     both splits. Striding through the file also takes test images from both writer populations (the
     first 5,000 MNIST test images are the easier SD-3 writers, the last 5,000 the SD-1 students).
  2. :func:`load_sklearn_digits` upsamples the 8x8 digits (values 0..16, rescaled to 0..255) to the full
     ``size`` with bilinear interpolation; they are not padded like MNIST digits.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from ernie5.data.root import require_file
from ernie5.data.text import DataCorrupt

HOW_TO_GET = (
    "the LeCun MNIST test files (e.g. github.com/kelas/mnist) t10k-images-idx3-ubyte.gz and "
    "t10k-labels-idx1-ubyte.gz -> <root>/mnist/"
)
"""One-line instruction shown when an MNIST file is missing."""
IMAGES_PATH = "mnist/t10k-images-idx3-ubyte.gz"
LABELS_PATH = "mnist/t10k-labels-idx1-ubyte.gz"
N_IMAGES = 10_000
"""Images in the MNIST test files (all that exist under the data root)."""
TEST_EVERY = 5
"""Every ``TEST_EVERY``-th image of each digit class is ``test`` (see Deviations)."""
SPLIT_SIZES = {"train": 8004, "test": 1996}
"""Sizes of :func:`mnist_split` on the 10,000 test images."""
DIGIT_FRACTION = 28 / 32
"""Share of the output side covered by a 28x28 MNIST digit (28 px of 32: 2 px of black border)."""

_IMAGES_MAGIC = 2051
_LABELS_MAGIC = 2049


def _read_gz(path: Path) -> bytes:
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise DataCorrupt(path, None, f"not a readable gzip file ({e})") from None


def _header(path: Path, data: bytes, magic: int, n_dims: int) -> tuple[int, ...]:
    size = 4 + 4 * n_dims
    if len(data) < size:
        raise DataCorrupt(path, None, f"byte 0: IDX header needs {size} bytes, file has {len(data)}")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise DataCorrupt(path, None, f"byte 0: IDX magic number {found}, expected {magic}")
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(n_dims))
    expected = size + int(np.prod(dims))
    if len(data) != expected:
        what = f"header says shape {dims}, so {expected} bytes, but the file has {len(data)}"
        raise DataCorrupt(path, None, what)
    return dims


def read_mnist(root: str | Path | None) -> tuple[np.ndarray, np.ndarray]:
    """All 10,000 MNIST test digits in file order.

    Returns:
        ``(images, labels)``: images ``uint8 (N, 28, 28)`` (0 background, 255 ink), labels ``int64 (N,)``
        in 0..9.

    Raises:
        DataMissing: a file is not under ``root``.
        DataCorrupt: a file is not gzip, has a wrong IDX magic number or size, a label is out of range, or
            the two files disagree on the count.
    """
    images_path = require_file(root, IMAGES_PATH, HOW_TO_GET)
    labels_path = require_file(root, LABELS_PATH, HOW_TO_GET)
    raw = _read_gz(images_path)
    n, rows, cols = _header(images_path, raw, _IMAGES_MAGIC, 3)
    images = np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(n, rows, cols).copy()
    raw = _read_gz(labels_path)
    (n_labels,) = _header(labels_path, raw, _LABELS_MAGIC, 1)
    labels = np.frombuffer(raw, dtype=np.uint8, offset=8).astype(np.int64)
    if n_labels != n:
        raise DataCorrupt(labels_path, None, f"{n_labels} labels for {n} images in {images_path.name}")
    if labels.size and labels.max() > 9:
        bad = int(np.argmax(labels > 9))
        raise DataCorrupt(labels_path, None, f"byte {8 + bad}: label {labels[bad]} is not a digit")
    return images, labels


def split_indices(labels: np.ndarray, split: Literal["train", "test"]) -> np.ndarray:
    """Indices (``int64``, ascending) of ``split``: per class, every fifth image in file order is ``test``.

    Args:
        labels: ``int (N,)`` class labels in file order.
        split: ``"train"`` or ``"test"``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"MNIST split={split!r}: expected train|test")
    labels = np.asarray(labels)
    rank = np.empty(len(labels), dtype=np.int64)  # position of each image among its class, in file order
    for cls in np.unique(labels):
        where = np.flatnonzero(labels == cls)
        rank[where] = np.arange(len(where))
    is_test = rank % TEST_EVERY == TEST_EVERY - 1
    return np.flatnonzero(is_test if split == "test" else ~is_test).astype(np.int64)


def mnist_split(root: str | Path | None, split: Literal["train", "test"]) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 (N, 28, 28), labels int64 (N,))`` of one split of the 10k test images, in file order:
    8,004 train and 1,996 test, disjoint, stratified by class (see the module docstring)."""
    images, labels = read_mnist(root)
    indices = split_indices(labels, split)
    return images[indices], labels[indices]


def digit_image(img: np.ndarray, size: int = 32) -> np.ndarray:
    """A grayscale digit as a ``uint8 (size, size, 3)`` RGB image, centred with the MNIST border.

    Args:
        img: ``uint8 (h, w)`` grayscale digit (28x28 for MNIST).
        size: output side; the digit is resized (Pillow, bilinear) to ``round(size * 28 / 32)`` and padded
            with black on every side, so at 32 a 28x28 digit is copied unchanged with a 2 px border.
    """
    if img.ndim != 2:
        raise ValueError(f"digit image must be 2-D (h, w), got shape {img.shape}")
    inner = max(1, round(size * DIGIT_FRACTION))
    if img.shape != (inner, inner):
        img = np.asarray(Image.fromarray(img.astype(np.uint8)).resize((inner, inner), Image.BILINEAR))
    out = np.zeros((size, size), dtype=np.uint8)
    top = (size - inner) // 2
    out[top : top + inner, top : top + inner] = img
    return np.repeat(out[:, :, None], 3, axis=2)


def load_sklearn_digits(size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled UCI digits (1,797 images; shipped with the package, no download).

    Returns:
        ``(images uint8 (1797, size, size, 3), labels int64 (1797,))``; the 8x8 values 0..16 are rescaled
        to 0..255 and upsampled bilinearly to the whole ``size`` x ``size`` frame.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("load_sklearn_digits needs scikit-learn: pip install ernie5[digits]") from None
    bunch = load_digits()
    small = np.rint(np.asarray(bunch.images, dtype=np.float64) * (255 / 16)).clip(0, 255).astype(np.uint8)
    images = np.empty((len(small), size, size, 3), dtype=np.uint8)
    for i, img in enumerate(small):
        big = np.asarray(Image.fromarray(img).resize((size, size), Image.BILINEAR))
        images[i] = big[:, :, None]
    return images, np.asarray(bunch.target, dtype=np.int64)
