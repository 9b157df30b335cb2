"""Image and clip understanding: multiple choice over an image or clip (``digit_vqa``, ``shapes_vqa_attr``,
``shapes_vqa_rel``, ``video_shapes``, ``video_digits``); ``acc`` is the gold choice having the highest
log-likelihood (:class:`evals.tasks.media.ChoiceOverMedia`). The cross-source digits are
:mod:`evals.tasks.digit_transfer`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import ClassVar

import numpy as np

from ernie5.data import shapes
from ernie5.data.mnist import HOW_TO_GET as MNIST_HOW
from ernie5.data.mnist import digit_image, mnist_split
from ernie5.data.moving import DIRECTIONS, moving_digits_clip, moving_shape_clip
from ernie5.data.vision_sources import (
    CLIP_FRAMES,
    DIGIT_MOTION_QUESTION,
    DIGIT_QUESTION,
    MOTION_QUESTION,
    SHAPE_MOTION_QUESTION,
)
from evals.task import TASKS, Example
from evals.tasks.media import (
    GENERATED,
    IMAGE_SIZE,
    ChoiceOverMedia,
    CountOptions,
    choice_example,
    mnist_files,
)


@TASKS.register("digit_vqa")
class DigitVQA(ChoiceOverMedia):
    """Which digit is this? MNIST test split (1,996 images), 10-way choice."""

    name = "digit_vqa"
    version = 1
    modality = "image"
    splits = ("test",)
    data_files = mnist_files()
    how_to_get = MNIST_HOW

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        images, labels = mnist_split(data_dir, "test")
        choices = tuple(str(d) for d in range(10))
        return [
            choice_example(
                f"mnist-test-{i}", digit_image(x, IMAGE_SIZE), DIGIT_QUESTION, choices, str(int(y))
            )
            for i, (x, y) in enumerate(zip(images, labels))
        ]


class ShapesVQA(ChoiceOverMedia):
    modality = "image"
    splits = ("generated",)
    how_to_get = GENERATED
    Options = CountOptions
    relational: ClassVar[bool] = False

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        out = []
        for i in range(self.options.n_examples):
            rng = random.Random(f"{self.name}/{i}")
            scene = shapes.random_scene(rng)
            qas = (shapes.relational_questions if self.relational else shapes.attribute_questions)(scene, rng)
            if not qas:
                continue
            qa = qas[0]
            media = shapes.render(scene, IMAGE_SIZE)
            out.append(choice_example(f"{self.name}-{i}", media, qa.question, qa.choices, qa.answer))
        return out


@TASKS.register("shapes_vqa_attr")
class ShapesVQAAttribute(ShapesVQA):
    """Attribute questions about procedural shapes scenes (colour, shape, position)."""

    name = "shapes_vqa_attr"
    version = 1


@TASKS.register("shapes_vqa_rel")
class ShapesVQARelational(ShapesVQA):
    """Relational questions about procedural shapes scenes (left of, above, how many)."""

    name = "shapes_vqa_rel"
    version = 1
    relational = True


@TASKS.register("video_shapes")
class VideoShapes(ChoiceOverMedia):
    """Clips of one moving shape: which way does it move, or which shape moves (alternating)."""

    name = "video_shapes"
    version = 1
    modality = "video"
    splits = ("generated",)
    how_to_get = GENERATED
    Options = CountOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        out = []
        for i in range(self.options.n_examples):
            rng = random.Random(f"{self.name}/{i}")
            shape = shapes.random_scene(rng, n_shapes=1).shapes[0]
            direction = rng.choice(DIRECTIONS)
            clip, _ = moving_shape_clip(
                shape, direction, np.random.default_rng(i), n_frames=CLIP_FRAMES, size=IMAGE_SIZE
            )
            if i % 2 == 0:
                q, choices, answer = MOTION_QUESTION, DIRECTIONS, direction
            else:
                q, choices, answer = SHAPE_MOTION_QUESTION, shapes.KINDS, shape.kind
            out.append(choice_example(f"{self.name}-{i}", clip, q, choices, answer))
        return out


@TASKS.register("video_digits")
class VideoDigits(ChoiceOverMedia):
    """Clips of one moving MNIST test digit: which way does it move, or which digit (alternating)."""

    name = "video_digits"
    version = 1
    modality = "video"
    splits = ("test",)
    data_files = mnist_files()
    how_to_get = MNIST_HOW
    Options = CountOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        images, labels = mnist_split(data_dir, "test")
        out = []
        for i in range(min(self.options.n_examples, len(images))):
            rng = random.Random(f"{self.name}/{i}")
            direction = rng.choice(DIRECTIONS)
            clip, _ = moving_digits_clip(
                [images[i]], [direction], np.random.default_rng(i), n_frames=CLIP_FRAMES, size=IMAGE_SIZE
            )
            if i % 2 == 0:
                q, choices, answer = MOTION_QUESTION, DIRECTIONS, direction
            else:
                q, choices, answer = (
                    DIGIT_MOTION_QUESTION,
                    tuple(str(d) for d in range(10)),
                    str(int(labels[i])),
                )
            out.append(choice_example(f"{self.name}-{i}", clip, q, choices, answer))
        return out
