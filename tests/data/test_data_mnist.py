"""MNIST reader and split (counts from SOURCE.md, clear errors) and scikit-learn's bundled digits."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from ernie5.data.mnist import (
    IMAGES_PATH,
    LABELS_PATH,
    SPLIT_SIZES,
    digit_image,
    load_sklearn_digits,
    mnist_split,
    read_mnist,
    split_indices,
)
from ernie5.data.root import DataMissing
from ernie5.data.text import DataCorrupt

TEST_LABEL_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
"""Per-digit counts of the 10k MNIST test labels (shared/data/mnist/SOURCE.md)."""


def _idx(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    return header + payload


def _write_root(root: Path, images: bytes, labels: bytes, *, gzip_images: bool = True) -> Path:
    (root / "mnist").mkdir(parents=True, exist_ok=True)
    (root / IMAGES_PATH).write_bytes(gzip.compress(images) if gzip_images else images)
    (root / LABELS_PATH).write_bytes(gzip.compress(labels))
    return root


def _valid(n: int = 3) -> tuple[bytes, bytes]:
    pixels = np.arange(n * 28 * 28, dtype=np.int64).astype(np.uint8).tobytes()
    return _idx(2051, (n, 28, 28), pixels), _idx(2049, (n,), bytes(range(n)))


def test_read_mnist_counts(data_root):
    images, labels = read_mnist(data_root)
    assert images.shape == (10_000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (10_000,) and labels.dtype == np.int64
    assert np.bincount(labels).tolist() == TEST_LABEL_COUNTS
    assert images.max() == 255 and images[:, 0, :].max() == 0  # ink on black, empty top row


def test_split_sizes_disjoint_deterministic_and_balanced(data_root):
    _, labels = read_mnist(data_root)
    train, test = split_indices(labels, "train"), split_indices(labels, "test")
    assert (len(train), len(test)) == (SPLIT_SIZES["train"], SPLIT_SIZES["test"])
    assert not set(train) & set(test) and len(set(train) | set(test)) == 10_000
    overall = np.bincount(labels) / len(labels)
    for split, indices in (("train", train), ("test", test)):
        images, split_labels = mnist_split(data_root, split)
        again, _ = mnist_split(data_root, split)
        assert len(images) == len(split_labels) == SPLIT_SIZES[split] and np.array_equal(images, again)
        assert np.array_equal(split_labels, labels[indices])
        assert np.abs(np.bincount(split_labels) / len(split_labels) - overall).max() < 0.002


@pytest.mark.parametrize(
    ("labels", "test"),
    [
        ([0] * 10, [4, 9]),
        ([0, 1] * 4, []),
        ([0, 1] * 10, [8, 9, 18, 19]),
        ([3, 3, 3, 3, 7, 3, 7, 7, 7, 7], [5, 9]),
    ],
)
def test_split_indices_every_fifth_of_each_class(labels, test):
    assert split_indices(np.array(labels), "test").tolist() == test
    assert split_indices(np.array(labels), "train").tolist() == sorted(set(range(len(labels))) - set(test))


def test_split_rejects_unknown_split():
    with pytest.raises(ValueError, match="train|test"):
        split_indices(np.zeros(5), "validation")


def test_synthetic_files_round_trip(tmp_path):
    root = _write_root(tmp_path, *_valid(3))
    images, labels = read_mnist(root)
    assert images.shape == (3, 28, 28) and labels.tolist() == [0, 1, 2]
    assert images[0, 0, :3].tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("images", "labels", "bad_file", "match"),
    [
        (
            _idx(2049, (3, 28, 28), bytes(3 * 784)),
            _valid()[1],
            IMAGES_PATH,
            "magic number 2049, expected 2051",
        ),
        (_valid()[0][:-5], _valid()[1], IMAGES_PATH, "file has 2363"),
        (_valid()[0][:10], _valid()[1], IMAGES_PATH, "header needs 16 bytes"),
        (_valid()[0], _idx(2051, (3,), bytes(3)), LABELS_PATH, "magic number 2051, expected 2049"),
        (_valid()[0], _idx(2049, (2,), bytes(2)), LABELS_PATH, "2 labels for 3 images"),
        (_valid()[0], _idx(2049, (3,), bytes([1, 12, 3])), LABELS_PATH, "byte 9: label 12 is not a digit"),
    ],
)
def test_corrupt_files(tmp_path, images, labels, bad_file, match):
    root = _write_root(tmp_path, images, labels)
    with pytest.raises(DataCorrupt, match=match) as err:
        read_mnist(root)
    assert str(root / bad_file) in str(err.value) and "\n" not in str(err.value)


def test_not_gzip_is_corrupt(tmp_path):
    root = _write_root(tmp_path, *_valid(), gzip_images=False)
    with pytest.raises(DataCorrupt, match="not a readable gzip file"):
        read_mnist(root)


@pytest.mark.parametrize("present", [(), (LABELS_PATH,), (IMAGES_PATH,)])
def test_missing_files(tmp_path, present):
    root = _write_root(tmp_path, *_valid())
    for relpath in (IMAGES_PATH, LABELS_PATH):
        if relpath not in present:
            (root / relpath).unlink()
    with pytest.raises(
        DataMissing, match=r"missing mnist/t10k-.*-idx\d-ubyte\.gz under data root .*to get it"
    ):
        mnist_split(root, "train")


def test_missing_root():
    with pytest.raises(DataMissing, match="no data root"):
        read_mnist(None)


@pytest.mark.parametrize(("size", "inner"), [(32, 28), (64, 56), (16, 14), (28, 24)])
def test_digit_image_pads_centred(size, inner):
    img = np.full((28, 28), 200, dtype=np.uint8)
    out = digit_image(img, size)
    assert out.shape == (size, size, 3) and out.dtype == np.uint8
    assert (out[..., 0] == out[..., 1]).all() and (out[..., 0] == out[..., 2]).all()
    rows = np.flatnonzero(out[..., 0].any(axis=1))
    cols = np.flatnonzero(out[..., 0].any(axis=0))
    top = (size - inner) // 2
    assert (rows[0], rows[-1], cols[0], cols[-1]) == (top, top + inner - 1, top, top + inner - 1)


def test_digit_image_at_32_copies_the_digit(data_root):
    images, _ = read_mnist(data_root)
    out = digit_image(images[0])
    assert np.array_equal(out[2:30, 2:30, 0], images[0]) and out[:2].max() == 0


def test_sklearn_digits():
    pytest.importorskip("sklearn")
    images, labels = load_sklearn_digits()
    assert images.shape == (1797, 32, 32, 3) and images.dtype == np.uint8
    assert labels.dtype == np.int64 and set(labels.tolist()) == set(range(10))
    assert images.max() == 255 and (images[..., 0] == images[..., 2]).all()
    small, _ = load_sklearn_digits(size=16)
    assert small.shape == (1797, 16, 16, 3)
