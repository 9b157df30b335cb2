"""Image and video tasks: understanding (multiple choice over an image or clip), generation (judged),
and the vision tokenizer's reconstruction quality and the refiner's gain.

Understanding tasks score every answer choice by log-likelihood after ``BOI <image> EOI
Question: ...\\nAnswer:`` (clips: BOV/EOV), exactly the layout the pretraining mixture uses
(``ernie5.data.vision_sources``): ``acc`` is the gold choice having the highest log-likelihood.

Generation tasks send a text prompt (``Draw: ...`` / ``Draw the digit 7.`` / ``Animate: ...``) and judge
the image or clip that comes back:
  * shapes: the analytic judge of ``ernie5.data.shapes`` recovers shapes, colours and cells
    (``all_correct`` = the whole scene right; ``shape_acc``, ``colour_acc``, ``position_acc``);
  * digits: the project's reference digit classifier (``evals.judges``, trained on the MNIST train
    split, 98 % on the test split; its version and accuracy are in every sample record);
  * clips: per-frame judgement plus the motion direction of the frame centroids and their
    consistency.

Data: the shapes world and moving shapes are generated with a seed (always available); MNIST tasks
use the **test** split of the project's split of the 10k MNIST test images (the train split is for
training and for the digit judge).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ernie5.data import shapes
from ernie5.data.mnist import HOW_TO_GET as MNIST_HOW
from ernie5.data.mnist import IMAGES_PATH, LABELS_PATH, digit_image, mnist_split
from ernie5.data.moving import DIRECTIONS, moving_digits_clip, moving_shape_clip
from ernie5.data.vision_sources import (
    CLIP_FRAMES,
    DIGIT_MOTION_QUESTION,
    DIGIT_QUESTION,
    MOTION_QUESTION,
    SHAPE_MOTION_QUESTION,
    digit_prompt,
    motion_prompt,
    shapes_prompt,
)
from ernie5.metrics import psnr, ssim
from evals import judges
from evals.api import (
    LoglikelihoodRequest,
    LoglikelihoodResult,
    MediaGenerationRequest,
    MediaPart,
    MediaResult,
    ReconstructionRequest,
    RefineRequest,
    Request,
    Response,
)
from evals.metrics import choice_accuracy
from evals.task import TASKS, Example, Score, Task

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


def _mnist_files() -> tuple[str, ...]:
    return (IMAGES_PATH, LABELS_PATH)


class _ChoiceOverMedia(Task):
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


def _question(q: str) -> str:
    return f"Question: {q}\nAnswer:"


def choice_example(example_id: str, media: Any, question: str, choices, answer: str) -> MediaExample:
    """A multiple-choice question about ``media`` in the tasks' prompt format (the evaluated items and
    the RL verifiers' training queries are built alike)."""
    choices = tuple(choices)
    return MediaExample(
        id=example_id,
        prompt=_question(question),
        target=answer,
        choices=choices,
        gold=choices.index(answer),
        media=media,
    )


@TASKS.register("digit_vqa")
class DigitVQA(_ChoiceOverMedia):
    """Which digit is this? MNIST test split (1,996 images), 10-way choice."""

    name = "digit_vqa"
    version = 1
    modality = "image"
    splits = ("test",)
    data_files = _mnist_files()
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


class _ShapesVQA(_ChoiceOverMedia):
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
class ShapesVQAAttribute(_ShapesVQA):
    """Attribute questions about procedural shapes scenes (colour, shape, position)."""

    name = "shapes_vqa_attr"
    version = 1


@TASKS.register("shapes_vqa_rel")
class ShapesVQARelational(_ShapesVQA):
    """Relational questions about procedural shapes scenes (left of, above, how many)."""

    name = "shapes_vqa_rel"
    version = 1
    relational = True


@TASKS.register("video_shapes")
class VideoShapes(_ChoiceOverMedia):
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
class VideoDigits(_ChoiceOverMedia):
    """Clips of one moving MNIST test digit: which way does it move, or which digit (alternating)."""

    name = "video_digits"
    version = 1
    modality = "video"
    splits = ("test",)
    data_files = _mnist_files()
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


@dataclass(frozen=True, kw_only=True)
class GenOptions(CountOptions):
    """Options of the generation tasks."""

    cfg_scale: float = 3.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cfg_scale < 0 or self.temperature < 0:
            raise ValueError("cfg_scale and temperature must be >= 0")


def _media_result(self_name: str, example: Example, responses: list[Response]) -> np.ndarray:
    if len(responses) != 1 or not isinstance(responses[0], MediaResult):
        raise ValueError(f"{self_name}/{example.id}: expected one media result")
    return np.asarray(responses[0].media)


def _describe(example: MediaExample, extra: dict) -> dict:
    return {"id": example.id, "prompt": example.prompt, "target": example.target, **extra}


@TASKS.register("t2i_shapes")
class TextToImageShapes(Task):
    """Draw a described shapes scene; the analytic judge checks shapes, colours and positions."""

    requires = ("vision",)

    name = "t2i_shapes"
    version = 1
    modality = "image"
    capability = "generation"
    metrics: ClassVar[dict[str, bool]] = {
        "all_correct": True,
        "shape_acc": True,
        "colour_acc": True,
        "position_acc": True,
    }
    splits = ("generated",)
    how_to_get = GENERATED
    Options = GenOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        out = []
        for i in range(self.options.n_examples):
            scene = shapes.random_scene(random.Random(f"{self.name}/{i}"))
            out.append(
                MediaExample(
                    id=f"{self.name}-{i}",
                    prompt=shapes_prompt(shapes.caption(scene)),
                    target=shapes.caption(scene),
                    info={"scene": scene},
                )
            )
        return out

    def requests(self, example: MediaExample) -> list[Request]:
        i = int(example.id.rsplit("-", 1)[1])
        return [
            MediaGenerationRequest(
                example.prompt, 1, self.options.cfg_scale, self.options.temperature, seed=i
            )
        ]

    def score(self, example: MediaExample, responses: list[Response]) -> dict[str, Score]:
        img = _media_result(self.name, example, responses)[0]
        verdict = shapes.judge(img, example.info["scene"])
        return {k: float(verdict[k]) for k in self.metrics}

    def describe_sample(self, example, responses, scores) -> dict:
        img = _media_result(self.name, example, responses)[0]
        parsed = shapes.caption(shapes.parse_image(img)) if img.size else ""
        return _describe(
            example,
            {"prediction": parsed, "judge": f"shapes-v{shapes.JUDGE_VERSION}", "scores": dict(scores)},
        )


class _DigitJudged(Task):
    """Shared loading of the digit judge (it needs the data root)."""

    requires = ("vision",)

    data_files = _mnist_files()
    how_to_get = MNIST_HOW
    splits = ("generated",)
    Options = GenOptions

    def _judge(self, data_dir) -> judges.DigitJudge:
        if getattr(self, "_judge_cache", None) is None:
            self._judge_cache = judges.load_digit_judge(data_dir)
        return self._judge_cache


@TASKS.register("t2i_digits")
class TextToImageDigits(_DigitJudged):
    """Draw the digit d; the reference digit classifier judges semantic alignment."""

    name = "t2i_digits"
    version = 1
    modality = "image"
    capability = "generation"
    metrics: ClassVar[dict[str, bool]] = {"judge_acc": True}

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        self._judge(data_dir)
        return [
            MediaExample(id=f"{self.name}-{i}", prompt=digit_prompt(i % 10), target=str(i % 10))
            for i in range(self.options.n_examples)
        ]

    def requests(self, example: MediaExample) -> list[Request]:
        i = int(example.id.rsplit("-", 1)[1])
        return [
            MediaGenerationRequest(
                example.prompt, 1, self.options.cfg_scale, self.options.temperature, seed=i
            )
        ]

    def score(self, example: MediaExample, responses: list[Response]) -> dict[str, Score]:
        img = _media_result(self.name, example, responses)
        pred, _ = self._judge_cache.predict(img[:1])
        return {"judge_acc": float(int(pred[0]) == int(example.target))}

    def describe_sample(self, example, responses, scores) -> dict:
        pred, conf = self._judge_cache.predict(_media_result(self.name, example, responses)[:1])
        return _describe(
            example,
            {
                "prediction": str(int(pred[0])),
                "confidence": round(float(conf[0]), 3),
                "judge": self._judge_cache.version,
                "judge_test_accuracy": round(self._judge_cache.test_accuracy, 4),
                "scores": dict(scores),
            },
        )


def _clip_scores(clip: np.ndarray, direction: str, frame_ok: list[bool]) -> dict[str, float]:
    return {
        "frame_acc": float(np.mean(frame_ok)) if frame_ok else 0.0,
        "direction_acc": float(judges.motion_direction(clip) == direction),
        "motion_consistency": judges.motion_consistency(clip),
    }


@TASKS.register("t2v_shapes")
class TextToVideoShapes(Task):
    """Animate a shape moving in a direction; per-frame shape/colour judge plus centroid motion."""

    requires = ("vision",)

    name = "t2v_shapes"
    version = 1
    modality = "video"
    capability = "generation"
    metrics: ClassVar[dict[str, bool]] = {
        "frame_acc": True,
        "direction_acc": True,
        "motion_consistency": True,
    }
    splits = ("generated",)
    how_to_get = GENERATED
    Options = GenOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        out = []
        for i in range(self.options.n_examples):
            rng = random.Random(f"{self.name}/{i}")
            shape = shapes.random_scene(rng, n_shapes=1).shapes[0]
            direction = rng.choice(DIRECTIONS)
            out.append(
                MediaExample(
                    id=f"{self.name}-{i}",
                    target=direction,
                    prompt=motion_prompt(f"a {shape.color} {shape.kind}", direction),
                    info={"kind": shape.kind, "color": shape.color},
                )
            )
        return out

    def requests(self, example: MediaExample) -> list[Request]:
        i = int(example.id.rsplit("-", 1)[1])
        return [
            MediaGenerationRequest(
                example.prompt, CLIP_FRAMES, self.options.cfg_scale, self.options.temperature, seed=i
            )
        ]

    def score(self, example: MediaExample, responses: list[Response]) -> dict[str, Score]:
        clip = _media_result(self.name, example, responses)
        ok = []
        for frame in clip:
            found = shapes.parse_image(frame).shapes
            ok.append(
                len(found) == 1
                and found[0].kind == example.info["kind"]
                and found[0].color == example.info["color"]
            )
        return _clip_scores(clip, example.target, ok)


@TASKS.register("t2v_digits")
class TextToVideoDigits(_DigitJudged):
    """Animate a digit moving in a direction; per-frame digit judge plus centroid motion."""

    name = "t2v_digits"
    version = 1
    modality = "video"
    capability = "generation"
    metrics: ClassVar[dict[str, bool]] = {
        "frame_acc": True,
        "direction_acc": True,
        "motion_consistency": True,
    }

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        self._judge(data_dir)
        out = []
        for i in range(self.options.n_examples):
            direction = random.Random(f"{self.name}/{i}").choice(DIRECTIONS)
            out.append(
                MediaExample(
                    id=f"{self.name}-{i}",
                    target=direction,
                    info={"digit": i % 10},
                    prompt=motion_prompt(f"the digit {i % 10}", direction),
                )
            )
        return out

    def requests(self, example: MediaExample) -> list[Request]:
        i = int(example.id.rsplit("-", 1)[1])
        return [
            MediaGenerationRequest(
                example.prompt, CLIP_FRAMES, self.options.cfg_scale, self.options.temperature, seed=i
            )
        ]

    def score(self, example: MediaExample, responses: list[Response]) -> dict[str, Score]:
        clip = _media_result(self.name, example, responses)
        pred, _ = self._judge_cache.predict(clip)
        return _clip_scores(clip, example.target, [int(p) == example.info["digit"] for p in pred])


class _Reconstruction(Task):
    """PSNR / SSIM of the vision tokenizer's round trip (the bits the backbone predicts, decoded)."""

    requires = ("vision",)

    version = 1
    modality = "image"
    capability = "generation"
    metrics: ClassVar[dict[str, bool]] = {"psnr": True, "ssim": True}

    def requests(self, example: MediaExample) -> list[Request]:
        return [ReconstructionRequest(MediaPart("image", example.media))]

    def score(self, example: MediaExample, responses: list[Response]) -> dict[str, Score]:
        rec = _media_result(self.name, example, responses)[0]
        return {"psnr": psnr(rec, example.media), "ssim": ssim(rec, example.media)}

    def describe_sample(self, example, responses, scores) -> dict:
        return _describe(example, {"scores": {k: round(float(v), 3) for k, v in scores.items()}})


@TASKS.register("recon_shapes")
class ReconstructionShapes(_Reconstruction):
    """Tokenizer round trip of held-out shapes scenes."""

    name = "recon_shapes"
    splits = ("generated",)
    how_to_get = GENERATED
    Options = CountOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        return [
            MediaExample(
                id=f"{self.name}-{i}",
                prompt="",
                media=shapes.render(shapes.random_scene(random.Random(f"{self.name}/{i}")), IMAGE_SIZE),
            )
            for i in range(self.options.n_examples)
        ]


@TASKS.register("recon_mnist")
class ReconstructionMnist(_Reconstruction):
    """Tokenizer round trip of MNIST test digits."""

    name = "recon_mnist"
    splits = ("test",)
    data_files = _mnist_files()
    how_to_get = MNIST_HOW

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        images, _ = mnist_split(data_dir, "test")
        return [
            MediaExample(id=f"mnist-test-{i}", prompt="", media=digit_image(x, IMAGE_SIZE))
            for i, x in enumerate(images)
        ]


@dataclass(frozen=True, kw_only=True)
class RefinerOptions(CountOptions):
    """Options of the refiner task."""

    steps: int = 0
    """Refiner sampling steps (0 = its default)."""
    degrade_noise: float = 8.0
    """Std of the Gaussian pixel noise added to the low-resolution input (uint8 units)."""


@TASKS.register("refiner_gain")
class RefinerGain(Task):
    """Cascaded refiner: PSNR / SSIM gain of refine(low) over bicubic(low) against the 2x render.

    The low-resolution input is the shapes scene rendered at 32 px with a mild blur and noise (a
    stand-in for the backbone's decoded output); the reference is the same scene rendered at 64 px.
    """

    requires = ("refiner",)

    name = "refiner_gain"
    version = 1
    modality = "image"
    capability = "generation"
    metrics: ClassVar[dict[str, bool]] = {"psnr_gain": True, "ssim_gain": True, "psnr": True}
    splits = ("generated",)
    how_to_get = GENERATED
    Options = RefinerOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        from PIL import Image, ImageFilter

        out = []
        for i in range(self.options.n_examples):
            scene = shapes.random_scene(random.Random(f"{self.name}/{i}"))
            low = Image.fromarray(shapes.render(scene, IMAGE_SIZE)).filter(ImageFilter.GaussianBlur(0.6))
            noise = np.random.default_rng(i).normal(
                0, self.options.degrade_noise, (IMAGE_SIZE, IMAGE_SIZE, 3)
            )
            low = np.clip(np.asarray(low, dtype=np.float64) + noise, 0, 255).astype(np.uint8)
            out.append(
                MediaExample(
                    id=f"{self.name}-{i}",
                    prompt="",
                    media=low,
                    info={"high": shapes.render(scene, 2 * IMAGE_SIZE)},
                )
            )
        return out

    def requests(self, example: MediaExample) -> list[Request]:
        i = int(example.id.rsplit("-", 1)[1])
        return [RefineRequest(MediaPart("image", example.media), steps=self.options.steps, seed=i)]

    def score(self, example: MediaExample, responses: list[Response]) -> dict[str, Score]:
        from PIL import Image

        refined = _media_result(self.name, example, responses)[0]
        high = example.info["high"]
        bicubic = np.asarray(Image.fromarray(example.media).resize(high.shape[:2][::-1], Image.BICUBIC))
        return {
            "psnr_gain": psnr(refined, high) - psnr(bicubic, high),
            "ssim_gain": ssim(refined, high) - ssim(bicubic, high),
            "psnr": psnr(refined, high),
        }
