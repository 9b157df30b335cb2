"""What the image and clip tasks share: the example with its media, the count options, the multiple-choice
scoring by log-likelihood after an image or clip (``BOI <image> EOI Question: ...\\nAnswer:``, the layout of
the pretraining mixture, ``ernie5.data.vision_sources``), and the generated media of a response.

Data: the shapes world and moving shapes are generated with a seed (always available); MNIST tasks use the
**test** split of the project's split of the 10k MNIST test images (the train split is for training and
for the digit judge).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ernie5.data.mnist import IMAGES_PATH, LABELS_PATH
from evals.api import (
    LoglikelihoodRequest,
    LoglikelihoodResult,
    MediaPart,
    MediaResult,
    Request,
    Response,
)
from evals.metrics import choice_accuracy
from evals.task import Example, Score, Task

IMAGE_SIZE = 32


GENERATED = "nothing to get: scenes and clips are generated from the seed"


@dataclass(frozen=True)
class MediaExample(Example):
    """An example with its image or clip (uint8) and any judge targets."""

    media: Any = field(default=None, hash=False, compare=False)
    info: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class CountOptions:
    """Options of the generated tasks (vision and audio): how many examples to make."""

    n_examples: int = 200
    """Examples generated when no ``limit`` is given."""

    def __post_init__(self) -> None:
        if not 1 <= self.n_examples <= 100_000:
            raise ValueError(f"n_examples={self.n_examples} must be in [1, 100000]")


def mnist_files() -> tuple[str, ...]:
    return (IMAGES_PATH, LABELS_PATH)


class ChoiceOverMedia(Task):
    """Multiple choice by log-likelihood after an image or clip."""

    requires = ("vision",)
    capability = "understanding"
    metrics: ClassVar[dict[str, bool]] = {"acc": True}

    def requests(self, example: MediaExample) -> list[Request]:
        part = MediaPart("video" if example.media.ndim == 4 else "image", example.media)
        return [LoglikelihoodRequest((part, example.prompt), " " + c) for c in example.choices]

    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        if len(responses) != len(example.choices) or not all(
            isinstance(r, LoglikelihoodResult) for r in responses
        ):
            raise ValueError(
                f"{self.name}/{example.id}: expected {len(example.choices)} loglikelihood results"
            )
        return {"acc": choice_accuracy([r.logprob for r in responses], example.gold)}  # type: ignore[union-attr]


def question_prompt(q: str) -> str:
    return f"Question: {q}\nAnswer:"


def choice_example(example_id: str, media: Any, question: str, choices, answer: str) -> MediaExample:
    """A multiple-choice question about ``media`` in the tasks' prompt format (the evaluated items and
    the RL verifiers' training queries are built alike)."""
    choices = tuple(choices)
    return MediaExample(
        id=example_id,
        prompt=question_prompt(question),
        target=answer,
        choices=choices,
        gold=choices.index(answer),
        media=media,
    )


@dataclass(frozen=True, kw_only=True)
class GenOptions(CountOptions):
    """Options of the generation tasks."""

    cfg_scale: float = 3.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cfg_scale < 0 or self.temperature < 0:
            raise ValueError("cfg_scale and temperature must be >= 0")


def media_result(self_name: str, example: Example, responses: list[Response]) -> np.ndarray:
    if len(responses) != 1 or not isinstance(responses[0], MediaResult):
        raise ValueError(f"{self_name}/{example.id}: expected one media result")
    return np.asarray(responses[0].media)


def describe_media(example: MediaExample, extra: dict) -> dict:
    return {"id": example.id, "prompt": example.prompt, "target": example.target, **extra}
