"""Digit augmentation and the varied understanding sources of the pretraining mixture."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ernie5.data import shapes
from ernie5.data.digit_augment import DigitAugment, augment_digit
from ernie5.data.digit_sources import stroke_digit
from ernie5.data.vision_sources import DIGIT_QUESTION, open_media_source

NONE = DigitAugment(
    rotation_deg=0, scale=(1, 1), aspect=0, shear=0, shift=0, stroke_p=0, blur_p=0, contrast_p=0, noise_p=0
)


def _digit() -> np.ndarray:
    return stroke_digit(4, random.Random(0))


def test_identity_settings_keep_the_digit() -> None:
    d = _digit()
    out = augment_digit(d, random.Random(0), NONE)
    assert out.dtype == np.uint8 and out.shape == d.shape
    assert np.abs(out.astype(int) - d).max() <= 1  # bilinear at the identity: rounding only


def test_augmentation_is_seeded_and_varies() -> None:
    d = _digit()
    a, b = augment_digit(d, random.Random(5)), augment_digit(d, random.Random(5))
    outs = {augment_digit(d, random.Random(s)).tobytes() for s in range(20)}
    assert np.array_equal(a, b) and len(outs) == 20


def test_each_change_does_what_it_says() -> None:
    d = _digit()
    rng = random.Random(0)
    shifted = augment_digit(d, rng, DigitAugment(**{**NONE.__dict__, "shift": 0.2, "scale": (1, 1)}))
    assert not np.array_equal(shifted, d)
    thick = augment_digit(d, random.Random(1), DigitAugment(**{**NONE.__dict__, "stroke_p": 1.0}))
    assert (thick > 127).sum() != (d > 127).sum()
    dim = augment_digit(d, random.Random(0), DigitAugment(**{**NONE.__dict__, "contrast_p": 1.0}))
    assert dim.max() < d.max() or not np.array_equal(dim, d)
    small = augment_digit(d, random.Random(0), DigitAugment(**{**NONE.__dict__, "scale": (0.6, 0.6)}))
    assert (small > 64).sum() < 0.6 * (d > 64).sum()


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"blur_p=1.5 must be a probability"):
        DigitAugment(blur_p=1.5)
    with pytest.raises(ValueError, match=r"scale=\(1.2, 0.8\)"):
        DigitAugment(scale=(1.2, 0.8))


def test_mnist_varied_source(data_root) -> None:
    draw = open_media_source("mnist_varied", data_root, 32, understanding=1.0)
    rng = random.Random(0)
    docs = [draw(rng) for _ in range(40)]
    assert all(d.kind == "und" and d.media.shape == (32, 32, 3) and DIGIT_QUESTION in d.text for d in docs)
    answers = {d.text.rsplit("Answer:", 1)[1].strip() for d in docs}
    assert answers <= set("0123456789") and len(answers) >= 8
    plain = open_media_source("mnist", data_root, 32, understanding=0.0)
    varied = open_media_source("mnist_varied", data_root, 32, understanding=0.0)
    a, b = plain(random.Random(3)), varied(random.Random(3))  # generation documents are not varied
    assert a.kind == b.kind == "gen" and np.array_equal(a.media, b.media) and a.prompt == b.prompt


def test_shapes_varied_source_keeps_the_answers_true() -> None:
    draw = open_media_source("shapes_varied", None, 32, understanding=1.0)
    rng = random.Random(0)
    radii = set()
    for _ in range(30):
        doc = draw(rng)
        assert doc.kind == "und" and doc.media.shape == (32, 32, 3)
        parsed = shapes.parse_image(doc.media)  # the analytic judge still reads every shape in its cell
        assert parsed.shapes
        radii.add(int((doc.media.max(-1) > 0).sum()))
    assert len(radii) > 10  # shapes are drawn at varied sizes
    gen = open_media_source("shapes_varied", None, 32, understanding=0.0)(random.Random(1))
    assert gen.kind == "gen" and gen.prompt.startswith("Draw:")
