"""Cross-source digits: ``digit_vqa``'s question about digits from collections the model never trains on.

``digit_vqa`` asks about MNIST's test split, the same writers and scanning as the MNIST train split the
pretraining mixture draws from; a model can answer it by remembering MNIST's style. These tasks ask the
same 10-way question, in the same prompt and image format (framed the MNIST way, 20 x 20 box in a 28 x 28
frame, 2 px border to 32 x 32: :func:`ernie5.data.digit_sources.frame_like_mnist`), about digits from
elsewhere, so that a score that holds here is digit recognition rather than recall:

  * ``digit_vqa_strokes`` (always available): the procedural pen of :mod:`ernie5.data.digit_sources`
    (hand-written allographs as jittered Bezier strokes, random slant, stretch, rotation and pen width);
    its own seed stream, never in any training mixture. The project's MNIST-trained digit judge reads
    97.9 % of them (1,000 items), so they are legible digits, not noise.
  * ``digit_vqa_usps`` (data root, ``usps/zip.test.gz``): the USPS test set, 2,007 scanned ZIP-code digits
    (Hull 1994). The digit judge: 95.2 %.
  * ``digit_vqa_semeion`` (data root, ``semeion/semeion.data``): the Semeion handwritten digits, 1,593
    binary 16 x 16 digits by about 80 writers (UCI). The digit judge: 80.5 %.

scikit-learn's bundled 8 x 8 digits (``load_digits``) are in no task and no training source: they are
kept for an independent check.

References:
  * J. J. Hull, "A database for handwritten text recognition research", IEEE PAMI 16(5), 1994.
  * Semeion Research Center of Sciences of Communication, "Semeion Handwritten Digit", UCI, 2008.

Deviations:
  1. USPS and Semeion are 16 x 16 originals upsampled into MNIST's frame; their strokes are thicker and
     blockier than MNIST's. That is part of what the task measures (a change of source), and the judge's
     figures above say how much it costs a specialist.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ernie5.data.digit_sources import (
    SEMEION_HOW_TO_GET,
    SEMEION_PATH,
    USPS_HOW_TO_GET,
    USPS_PATH,
    read_semeion,
    read_usps,
    stroke_digits,
)
from ernie5.data.mnist import digit_image
from ernie5.data.vision_sources import DIGIT_QUESTION
from evals.task import TASKS, Example
from evals.tasks.media import GENERATED, IMAGE_SIZE, ChoiceOverMedia, CountOptions, choice_example

CHOICES = tuple(str(d) for d in range(10))
STROKES_SEED = 20261206
"""The pen's seed for the task's items; training sources never draw pen digits."""


def digit_examples(prefix: str, images: np.ndarray, labels: np.ndarray) -> list[Example]:
    """``digit_vqa``'s items for ``(images, labels)`` (28 x 28 framed digits)."""
    return [
        choice_example(f"{prefix}-{i}", digit_image(x, IMAGE_SIZE), DIGIT_QUESTION, CHOICES, str(int(y)))
        for i, (x, y) in enumerate(zip(images, labels))
    ]


@TASKS.register("digit_vqa_strokes")
class DigitVQAStrokes(ChoiceOverMedia):
    """Which digit is this? Procedural pen digits (classes in turn), never trained on, 10-way choice."""

    name = "digit_vqa_strokes"
    version = 1
    modality = "image"
    splits = ("generated",)
    how_to_get = GENERATED
    Options = CountOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        return digit_examples("strokes", *stroke_digits(self.options.n_examples, seed=STROKES_SEED))


@TASKS.register("digit_vqa_usps")
class DigitVQAUSPS(ChoiceOverMedia):
    """Which digit is this? The USPS test set (2,007 digits), framed like MNIST, 10-way choice."""

    name = "digit_vqa_usps"
    version = 1
    modality = "image"
    splits = ("test",)
    data_files = (USPS_PATH,)
    how_to_get = USPS_HOW_TO_GET

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        return digit_examples("usps-test", *read_usps(data_dir))


@TASKS.register("digit_vqa_semeion")
class DigitVQASemeion(ChoiceOverMedia):
    """Which digit is this? The Semeion handwritten digits (1,593), framed like MNIST, 10-way choice."""

    name = "digit_vqa_semeion"
    version = 1
    modality = "image"
    splits = ("all",)
    data_files = (SEMEION_PATH,)
    how_to_get = SEMEION_HOW_TO_GET

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        return digit_examples("semeion", *read_semeion(data_dir))
