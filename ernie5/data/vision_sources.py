"""Image and video documents for the pretraining mixture (understanding and generation).

Every source draws one :class:`MediaDoc` per call from a seeded generator: the media (uint8) and the
text around it. The stream turns a micro-batch's MediaDocs into segments with one frozen-tokenizer
call per (kind, frame count) (``ernie5.sequence.vision``). Prompt and answer formats are the ones the
harness's vision tasks use (``evals/tasks/vision_*.py`` import them from here), so training and
evaluation agree:

  * generation: ``Draw: <caption>.`` / ``Draw the digit 7.`` / ``Animate: a red circle moving left.``
    then BOI (BOV) and the NFSP blocks; with probability ``cfg_dropout`` the prompt is dropped
    (classifier-free guidance learns the unconditional branch);
  * understanding: BOI <merged embeddings> EOI then ``Question: ...\\nAnswer: ...`` or
    ``Caption: ...``.

Sources: ``shapes`` (the procedural shapes world: always available, what a fresh machine trains
on), ``mnist`` (the train split of the 10k MNIST test images), ``moving_shapes`` and
``moving_digits`` (clips). Their ``_varied`` twins draw the same generation documents but vary the
pixels of the understanding ones, so that what is learned is the digit or the shape rather than one
collection's style: ``mnist_varied`` augments the digit (:mod:`ernie5.data.digit_augment`) and, one
time in ``FONT_SHARE``, asks about a typeset digit instead (:func:`ernie5.data.digit_sources.font_digit`);
``shapes_varied`` draws the scene's shapes at a random radius (0.7-1.2 x the default) and offset
inside their cells. The harness's evaluated items are never varied.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CLIP_FRAMES = 4
"""Frames of a training clip (4 x 85 = 340 generation positions at the default schedule)."""


@dataclass
class MediaDoc:
    """One image/clip document before tokenization."""

    kind: str
    """``und`` (media then text) or ``gen`` (prompt then media)."""
    media: np.ndarray
    """uint8 ``(H, W, 3)`` or ``(T, H, W, 3)``."""
    clip: bool
    prompt: str = ""
    """Text before the media (generation prompts)."""
    text: str = ""
    """Text after the media (answers, captions)."""


def digit_prompt(digit: int) -> str:
    """The text-to-image prompt of a digit."""
    return f"Draw the digit {digit}."


def shapes_prompt(caption: str) -> str:
    """The text-to-image prompt of a shapes scene."""
    return f"Draw: {caption}."


def motion_prompt(subject: str, direction: str) -> str:
    """The text-to-video prompt: ``subject`` is "the digit 3" or "a red circle"."""
    return f"Animate: {subject} moving {direction}."


def qa_text(question: str, answer: str) -> str:
    """Question and answer after an image (the answer with a leading space, like the text tasks)."""
    return f"Question: {question}\nAnswer: {answer}\n"


DIGIT_QUESTION = "Which digit is this?"
MOTION_QUESTION = "Which way is it moving?"
DIGIT_MOTION_QUESTION = "Which digit is moving?"
SHAPE_MOTION_QUESTION = "Which shape is moving?"


def _generates(rng: random.Random, und_p: float) -> bool:
    """Draw a document's kind: generation with probability ``1 - und_p`` (one draw from ``rng``)."""
    return rng.random() < 1.0 - und_p


def _shapes(rng: random.Random, size: int, _data, und_p: float) -> MediaDoc:
    from ernie5.data import shapes

    scene = shapes.random_scene(rng)
    img = shapes.render(scene, size)
    if _generates(rng, und_p):
        return MediaDoc("gen", img, False, prompt=shapes_prompt(shapes.caption(scene)))
    pick = rng.random()
    if pick < 0.4:
        qas = shapes.attribute_questions(scene, rng)
    elif pick < 0.8:
        qas = shapes.relational_questions(scene, rng)
    else:
        return MediaDoc("und", img, False, text=f"Caption: {shapes.caption(scene)}.\n")
    qa = qas[0] if qas else None
    if qa is None:
        return MediaDoc("und", img, False, text=f"Caption: {shapes.caption(scene)}.\n")
    return MediaDoc("und", img, False, text=qa_text(qa.question, qa.answer))


def _mnist(rng: random.Random, size: int, data, und_p: float) -> MediaDoc:
    from ernie5.data.mnist import digit_image

    images, labels = data
    i = rng.randrange(len(images))
    img, label = digit_image(images[i], size), int(labels[i])
    if _generates(rng, und_p):
        return MediaDoc("gen", img, False, prompt=digit_prompt(label))
    return MediaDoc("und", img, False, text=qa_text(DIGIT_QUESTION, str(label)))


FONT_SHARE = 0.25
"""Share of ``mnist_varied``'s understanding documents about a typeset digit."""


def _mnist_varied(rng: random.Random, size: int, data, und_p: float) -> MediaDoc:
    from ernie5.data.digit_augment import augment_digit
    from ernie5.data.digit_sources import font_digit
    from ernie5.data.mnist import digit_image

    images, labels = data
    i = rng.randrange(len(images))
    label = int(labels[i])
    if _generates(rng, und_p):
        return MediaDoc("gen", digit_image(images[i], size), False, prompt=digit_prompt(label))
    if rng.random() < FONT_SHARE:
        label = rng.randrange(10)
        digit = font_digit(label, rng)
    else:
        digit = images[i]
    img = digit_image(augment_digit(digit, rng), size)
    return MediaDoc("und", img, False, text=qa_text(DIGIT_QUESTION, str(label)))


def _shapes_varied(rng: random.Random, size: int, _data, und_p: float) -> MediaDoc:
    from ernie5.data import shapes

    if _generates(rng, und_p):
        return _shapes(random.Random(rng.randrange(2**63)), size, None, 0.0)
    scene = shapes.random_scene(rng)
    radius = shapes.RADIUS * rng.uniform(0.7, 1.2)
    slack = max(0.0, 1.0 / (2 * shapes.GRID) - radius)  # how far a shape can move and stay in its cell
    objects = []
    for s in scene.shapes:
        cy, cx = shapes.cell_centre(s.cell)
        objects.append((s.kind, s.color, cy + rng.uniform(-slack, slack), cx + rng.uniform(-slack, slack)))
    img = shapes.draw_objects(objects, size, radius)
    qas = (
        shapes.attribute_questions(scene, rng)
        if rng.random() < 0.5
        else shapes.relational_questions(scene, rng)
    )
    text = qa_text(qas[0].question, qas[0].answer) if qas else f"Caption: {shapes.caption(scene)}.\n"
    return MediaDoc("und", img, False, text=text)


def _moving_shapes(rng: random.Random, size: int, _data, und_p: float) -> MediaDoc:
    from ernie5.data import shapes
    from ernie5.data.moving import DIRECTIONS, moving_shape_clip

    shape = shapes.random_scene(rng, n_shapes=1).shapes[0]
    direction = rng.choice(DIRECTIONS)
    clip, _ = moving_shape_clip(
        shape, direction, np.random.default_rng(rng.randrange(2**31)), n_frames=CLIP_FRAMES, size=size
    )
    subject = f"a {shape.color} {shape.kind}"
    if _generates(rng, und_p):
        return MediaDoc("gen", clip, True, prompt=motion_prompt(subject, direction))
    q, a = (MOTION_QUESTION, direction) if rng.random() < 0.5 else (SHAPE_MOTION_QUESTION, shape.kind)
    return MediaDoc("und", clip, True, text=qa_text(q, a))


def _moving_digits(rng: random.Random, size: int, data, und_p: float) -> MediaDoc:
    from ernie5.data.moving import DIRECTIONS, moving_digits_clip

    images, labels = data
    i = rng.randrange(len(images))
    direction = rng.choice(DIRECTIONS)
    clip, _ = moving_digits_clip(
        [images[i]], [direction], np.random.default_rng(rng.randrange(2**31)), n_frames=CLIP_FRAMES, size=size
    )
    label = int(labels[i])
    if _generates(rng, und_p):
        return MediaDoc("gen", clip, True, prompt=motion_prompt(f"the digit {label}", direction))
    q, a = (MOTION_QUESTION, direction) if rng.random() < 0.5 else (DIGIT_MOTION_QUESTION, str(label))
    return MediaDoc("und", clip, True, text=qa_text(q, a))


def _mnist_train(data_dir: Path | None):
    from ernie5.data.mnist import mnist_split

    return mnist_split(data_dir, "train")  # the harness scores the test split only


MEDIA_SOURCES: dict[str, tuple[Callable, Callable | None]] = {
    "shapes": (_shapes, None),
    "mnist": (_mnist, _mnist_train),
    "mnist_varied": (_mnist_varied, _mnist_train),
    "shapes_varied": (_shapes_varied, None),
    "moving_shapes": (_moving_shapes, None),
    "moving_digits": (_moving_digits, _mnist_train),
}
"""Source name -> (document function, loader of the data it needs or None)."""


def open_media_source(
    name: str, data_dir: Path | None, size: int, understanding: float = 0.5
) -> Callable[[random.Random], MediaDoc]:
    """A document function for ``name`` (raises ``DataMissing`` when its data is absent);
    ``understanding`` is the probability of an understanding document."""
    fn, loader = MEDIA_SOURCES[name]
    data = loader(data_dir) if loader is not None else None
    return lambda rng: fn(rng, size, data, understanding)
