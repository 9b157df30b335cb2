"""Seeded short clips of moving MNIST digits and moving shapes, each object with a known direction.

A clip is ``uint8 (T, size, size, 3)`` RGB on black. Each object moves in a straight line in one of
:data:`DIRECTIONS` for the whole clip, so "which way does the 7 move?" has one true answer; every clip
comes with a :class:`Track` per object (direction and per-frame centre) for the QA tasks and tests.

Motion, drawn from the ``random.Random`` passed in: an object travels a fraction ``u ~ U(0.6, 1.0)`` of
the free range along its axis (the canvas side minus the object's box), from a start ``s ~ U(0, 1 - u)``
of that range, at constant speed; its other coordinate ``p ~ U(0, 1)`` of the free range stays fixed
(shapes: the centre of their grid row or column instead). Leftward and upward paths are mirrored. The
draws are fractions, so the same seed gives the same clip at any ``size`` (with the object scaled too).

References:
  Srivastava et al. 2015, "Unsupervised Learning of Video Representations using LSTMs" (Moving MNIST),
  https://arxiv.org/abs/1502.04681

Deviations:
  1. No bouncing (Moving MNIST bounces off the edges): start points are chosen so that every object
     stays inside the canvas and moves strictly monotonically, so a direction label is true for the
     whole clip. Directions are the four axis directions; there are no diagonals.
  2. Overlapping digits are combined with a per-pixel maximum (as Moving MNIST does); overlapping
     shapes are painted in order, later on top.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ernie5.data.shapes import RADIUS, Shape, cell_centre, draw_objects

DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
STEP: dict[str, tuple[int, int]] = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
"""Unit step ``(d_row, d_col)`` of each direction (rows grow downwards)."""
MIN_TRAVEL = 0.6
"""Smallest share of the free range an object crosses during a clip."""


@dataclass(frozen=True)
class Track:
    """Where one object is in every frame of a clip."""

    direction: str
    centres: tuple[tuple[float, float], ...]
    """Per frame, the object's box centre ``(row, col)`` in pixels of the clip, continuous coordinates (pixel
    ``i`` spans ``[i, i + 1)``)."""
    box: float
    """Side of the object's square box in pixels."""

    @property
    def start(self) -> tuple[float, float]:
        """Centre in the first frame."""
        return self.centres[0]


def _path(
    direction: str, rng: random.Random, n_frames: int, fixed: float | None = None
) -> list[tuple[float, float]]:
    """Per-frame ``(row, col)`` as fractions of the free range; ``fixed`` pins the other coordinate."""
    if direction not in STEP:
        raise ValueError(f"direction={direction!r} must be one of {DIRECTIONS}")
    travel = rng.uniform(MIN_TRAVEL, 1.0)
    start = rng.uniform(0.0, 1.0 - travel)
    other = rng.random() if fixed is None else fixed
    d_row, d_col = STEP[direction]
    out = []
    for t in range(n_frames):
        along = start + travel * t / max(n_frames - 1, 1)
        if d_row + d_col < 0:  # left, up: mirror the path
            along = 1.0 - along
        out.append((along, other) if d_row else (other, along))
    return out


def moving_digits_clip(
    digits: Sequence[np.ndarray],
    directions: Sequence[str],
    rng: random.Random,
    n_frames: int = 8,
    size: int = 32,
    digit_size: int = 16,
) -> tuple[np.ndarray, tuple[Track, ...]]:
    """Digits moving in straight lines on a black canvas (Moving-MNIST-style, without bouncing).

    Args:
        digits: grayscale digits, each ``uint8 (h, w)`` (28x28 MNIST or 8x8 scikit-learn), one per object.
        directions: one of :data:`DIRECTIONS` per digit.
        rng: source of start points and speeds (see the module docstring).
        n_frames: clip length ``T``.
        size: canvas side in pixels.
        digit_size: side each digit is resized to (Pillow, bilinear), in pixels.

    Returns:
        ``(clip uint8 (T, size, size, 3), tracks)``: one :class:`Track` per digit, in input order; a digit's
        top-left corner moves by at least one whole pixel per frame.
    """
    if len(digits) != len(directions) or not digits:
        raise ValueError(f"need one direction per digit: {len(digits)} digits, {len(directions)} directions")
    free = size - digit_size
    if free * MIN_TRAVEL < n_frames - 1:
        raise ValueError(
            f"size={size}, digit_size={digit_size}: {free} px of travel is too little for {n_frames} frames"
        )
    canvas = np.zeros((n_frames, size, size), dtype=np.uint8)
    tracks = []
    for digit, direction in zip(digits, directions):
        small = Image.fromarray(np.asarray(digit, dtype=np.uint8)).resize((digit_size,) * 2, Image.BILINEAR)
        img = np.asarray(small)
        centres = []
        for t, (row_f, col_f) in enumerate(_path(direction, rng, n_frames)):
            top, left = round(row_f * free), round(col_f * free)
            window = canvas[t, top : top + digit_size, left : left + digit_size]
            np.maximum(window, img, out=window)
            centres.append((top + digit_size / 2, left + digit_size / 2))
        tracks.append(Track(direction, tuple(centres), float(digit_size)))
    return np.repeat(canvas[..., None], 3, axis=-1), tuple(tracks)


def moving_shape_clip(
    shape: Shape, direction: str, rng: random.Random, n_frames: int = 8, size: int = 32
) -> tuple[np.ndarray, Track]:
    """A shapes-world object (drawn as by :func:`ernie5.data.shapes.render`) moving in a straight line.

    The shape keeps the row (for left/right) or the column (for up/down) of its ``shape.cell`` and moves
    along the other axis at constant speed, by sub-pixel amounts (anti-aliased).

    Returns:
        ``(clip uint8 (T, size, size, 3), track)``.
    """
    free_frac = 1.0 - 2 * RADIUS  # the centre's range [RADIUS, 1 - RADIUS], as a share of the side
    if free_frac * size * MIN_TRAVEL < n_frames - 1:
        raise ValueError(f"size={size} is too small for {n_frames} frames of strictly monotone motion")
    # The pinned coordinate: the cell centre, as a fraction of the free range [RADIUS, 1 - RADIUS].
    cell_y, cell_x = cell_centre(shape.cell)
    pinned = ((cell_y if direction in ("left", "right") else cell_x) - RADIUS) / free_frac
    frames, centres = [], []
    for row_f, col_f in _path(direction, rng, n_frames, fixed=pinned):
        y, x = RADIUS + row_f * free_frac, RADIUS + col_f * free_frac
        frames.append(draw_objects([(shape.kind, shape.color, y, x)], size))
        centres.append((y * size, x * size))
    return np.stack(frames), Track(direction, tuple(centres), 2 * RADIUS * size)
