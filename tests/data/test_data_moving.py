"""Moving digits and moving shapes: format, direction labels true in every frame, determinism."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ernie5.data.mnist import read_mnist
from ernie5.data.moving import DIRECTIONS, STEP, moving_digits_clip, moving_shape_clip
from ernie5.data.shapes import COLOR_NAMES, KINDS, Shape


def _blob(seed: int) -> np.ndarray:
    """A digit-like 28x28 stroke: an off-centre bar of random thickness (no data needed)."""
    rng = np.random.default_rng(seed)
    img = np.zeros((28, 28), dtype=np.uint8)
    top, left = rng.integers(4, 10, size=2)
    img[top : top + 14, left : left + rng.integers(3, 8)] = 255
    img[top : top + 3, left : left + 12] = 180
    return img


def _centroids(clip: np.ndarray) -> np.ndarray:
    """Intensity centroid ``(row, col)`` per frame, continuous pixel coordinates."""
    w = clip.astype(np.float64).sum(axis=-1)
    rows, cols = np.mgrid[: clip.shape[1], : clip.shape[2]] + 0.5
    mass = w.sum(axis=(1, 2))
    return np.stack([(w * rows).sum(axis=(1, 2)) / mass, (w * cols).sum(axis=(1, 2)) / mass], axis=1)


def _assert_moves(positions: np.ndarray, direction: str, min_step: float) -> None:
    d_row, d_col = STEP[direction]
    axis, sign = (0, d_row) if d_row else (1, d_col)
    steps = np.diff(positions, axis=0)
    assert (sign * steps[:, axis] >= min_step).all(), (direction, positions)
    assert np.allclose(steps[:, 1 - axis], 0, atol=1e-6), (direction, positions)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_digit_moves_in_its_direction_for_every_seed(direction):
    for seed in range(40):
        clip, (track,) = moving_digits_clip([_blob(seed)], [direction], random.Random(seed))
        assert clip.shape == (8, 32, 32, 3) and clip.dtype == np.uint8
        assert track.direction == direction and len(track.centres) == 8 and track.box == 16
        _assert_moves(_centroids(clip), direction, min_step=0.99)
        _assert_moves(np.array(track.centres), direction, min_step=1.0)
        assert all(8 <= c <= 24 for centre in track.centres for c in centre)


@pytest.mark.parametrize(
    ("n_frames", "size", "digit_size"), [(8, 32, 16), (20, 64, 28), (4, 32, 24), (2, 16, 8)]
)
def test_digit_clip_sizes(n_frames, size, digit_size):
    clip, (track,) = moving_digits_clip([_blob(0)], ["down"], random.Random(0), n_frames, size, digit_size)
    assert clip.shape == (n_frames, size, size, 3)
    _assert_moves(np.array(track.centres), "down", min_step=1.0)


def test_two_digits_each_keep_their_direction():
    for seed in range(20):
        rng = random.Random(seed)
        directions = rng.sample(DIRECTIONS, 2)
        clip, tracks = moving_digits_clip([_blob(seed), _blob(seed + 1)], directions, rng)
        assert [t.direction for t in tracks] == directions
        for track in tracks:
            _assert_moves(np.array(track.centres), track.direction, min_step=1.0)
            for frame, (row, col) in zip(clip, track.centres):
                top, left = int(row - 8), int(col - 8)
                assert frame[top : top + 16, left : left + 16].max() > 128  # the digit is drawn there


def test_real_mnist_digits(data_root):
    images, _ = read_mnist(data_root)
    for seed, direction in enumerate(DIRECTIONS):
        clip, _ = moving_digits_clip([images[seed]], [direction], random.Random(seed))
        _assert_moves(_centroids(clip), direction, min_step=0.99)


def test_digit_clip_is_deterministic_and_seeded():
    def make(seed: int, size: int = 32, digit_size: int = 16):
        return moving_digits_clip(
            [_blob(1), _blob(2)], ["left", "up"], random.Random(seed), 8, size, digit_size
        )

    (a, ta), (b, tb), (c, _) = make(3), make(3), make(4)
    assert np.array_equal(a, b) and ta == tb and not np.array_equal(a, c)
    _, big = make(3, size=64, digit_size=32)  # the same clip at twice the resolution
    for small_track, big_track in zip(ta, big):
        assert np.abs(np.array(big_track.centres) / 2 - np.array(small_track.centres)).max() <= 0.5


@pytest.mark.parametrize(
    ("digits", "directions", "kwargs", "match"),
    [
        ([np.zeros((28, 28))], ["north"], {}, "direction='north'"),
        ([np.zeros((28, 28))], ["up", "down"], {}, "one direction per digit"),
        ([], [], {}, "one direction per digit"),
        ([np.zeros((28, 28))], ["up"], {"n_frames": 20}, "too little"),
    ],
)
def test_digit_clip_rejects(digits, directions, kwargs, match):
    with pytest.raises(ValueError, match=match):
        moving_digits_clip(digits, directions, random.Random(0), **kwargs)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_shape_moves_in_its_direction_for_every_seed(direction):
    for seed in range(40):
        rng = random.Random(seed)
        shape = Shape(rng.choice(KINDS), rng.choice(COLOR_NAMES), (rng.randrange(3), rng.randrange(3)))
        clip, track = moving_shape_clip(shape, direction, rng)
        assert clip.shape == (8, 32, 32, 3) and clip.dtype == np.uint8
        centroids = _centroids(clip)
        _assert_moves(np.array(track.centres), direction, min_step=1.0)
        d_row, _ = STEP[direction]
        axis = 0 if d_row else 1
        assert (np.sign(np.diff(centroids[:, axis])) == sum(STEP[direction])).all()
        # The shape stays in its cell's lane: row for left/right, column for up/down.
        lane = shape.cell[1 - axis]
        assert all(lane * 32 / 3 < centre[1 - axis] < (lane + 1) * 32 / 3 for centre in track.centres)


def test_shape_clip_is_deterministic_and_resolution_independent():
    shape = Shape("square", "cyan", (2, 0))
    a, ta = moving_shape_clip(shape, "right", random.Random(5))
    b, tb = moving_shape_clip(shape, "right", random.Random(5))
    big, tbig = moving_shape_clip(shape, "right", random.Random(5), size=64)
    assert np.array_equal(a, b) and ta == tb and big.shape == (8, 64, 64, 3)
    assert np.allclose(np.array(tbig.centres) / 2, ta.centres) and tbig.box == 2 * ta.box
    assert np.abs(_centroids(big) / 2 - _centroids(a)).max() < 0.2
