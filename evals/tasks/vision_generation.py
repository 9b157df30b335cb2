"""Image and clip generation, judged: a text prompt (``Draw: ...`` / ``Draw the digit 7.`` / ``Animate: ...``)
and the image or clip that comes back:
  * shapes: the analytic judge of ``ernie5.data.shapes`` recovers shapes, colours and cells
    (``all_correct`` = the whole scene right; ``shape_acc``, ``colour_acc``, ``position_acc``);
  * digits: the project's reference digit classifier (``evals.judges``, trained on the MNIST train
    split, 98 % on the test split; its version and accuracy are in every sample record);
  * clips: per-frame judgement plus the motion direction of the frame centroids and their consistency.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import ClassVar

import numpy as np

from ernie5.data import shapes
from ernie5.data.mnist import HOW_TO_GET as MNIST_HOW
from ernie5.data.moving import DIRECTIONS
from ernie5.data.vision_sources import (
    CLIP_FRAMES,
    digit_prompt,
    motion_prompt,
    shapes_prompt,
)
from evals import judges
from evals.api import (
    MediaGenerationRequest,
    Request,
    Response,
)
from evals.task import TASKS, Example, Score, Task
from evals.tasks.media import GENERATED, GenOptions, MediaExample, describe_media, media_result, mnist_files


class MediaGeneration(Task):
    """What the image and clip generation tasks share: one generation request per example, of
    ``n_frames`` frames, seeded by the example's index."""

    requires = ("vision",)
    capability = "generation"
    splits = ("generated",)
    how_to_get = GENERATED
    Options = GenOptions
    n_frames: ClassVar[int] = 1

    def requests(self, example: MediaExample) -> list[Request]:
        i = int(example.id.rsplit("-", 1)[1])
        opts = self.options
        return [
            MediaGenerationRequest(example.prompt, self.n_frames, opts.cfg_scale, opts.temperature, seed=i)
        ]


class ClipGeneration(MediaGeneration):
    """A clip of ``CLIP_FRAMES`` frames, judged per frame (:meth:`frames_ok`) and by the motion of the
    frame centroids."""

    modality = "video"
    n_frames = CLIP_FRAMES
    metrics: ClassVar[dict[str, bool]] = {
        "frame_acc": True,
        "direction_acc": True,
        "motion_consistency": True,
    }

    def frames_ok(self, example: MediaExample, clip: np.ndarray) -> list[bool]:
        """Whether each frame shows what the prompt asked for."""
        raise NotImplementedError

    def score(self, example: MediaExample, responses: list[Response]) -> dict[str, Score]:
        clip = media_result(self.name, example, responses)
        return {
            "frame_acc": float(np.mean(ok)) if (ok := self.frames_ok(example, clip)) else 0.0,
            "direction_acc": float(judges.motion_direction(clip) == example.target),
            "motion_consistency": judges.motion_consistency(clip),
        }


@TASKS.register("t2i_shapes")
class TextToImageShapes(MediaGeneration):
    """Draw a described shapes scene; the analytic judge checks shapes, colours and positions."""

    name = "t2i_shapes"
    version = 1
    modality = "image"
    metrics: ClassVar[dict[str, bool]] = {
        "all_correct": True,
        "shape_acc": True,
        "colour_acc": True,
        "position_acc": True,
    }

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

    def score(self, example: MediaExample, responses: list[Response]) -> dict[str, Score]:
        img = media_result(self.name, example, responses)[0]
        verdict = shapes.judge(img, example.info["scene"])
        return {k: float(verdict[k]) for k in self.metrics}

    def describe_sample(self, example, responses, scores) -> dict:
        img = media_result(self.name, example, responses)[0]
        parsed = shapes.caption(shapes.parse_image(img)) if img.size else ""
        return describe_media(
            example,
            {"prediction": parsed, "judge": f"shapes-v{shapes.JUDGE_VERSION}", "scores": dict(scores)},
        )


class DigitJudged(MediaGeneration):
    """Generation judged by the digit classifier (it needs the data root)."""

    data_files = mnist_files()
    how_to_get = MNIST_HOW

    def _judge(self, data_dir) -> judges.DigitJudge:
        if getattr(self, "_judge_cache", None) is None:
            self._judge_cache = judges.load_digit_judge(data_dir)
        return self._judge_cache


@TASKS.register("t2i_digits")
class TextToImageDigits(DigitJudged):
    """Draw the digit d; the reference digit classifier judges semantic alignment."""

    name = "t2i_digits"
    version = 1
    modality = "image"
    metrics: ClassVar[dict[str, bool]] = {"judge_acc": True}

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        self._judge(data_dir)
        return [
            MediaExample(id=f"{self.name}-{i}", prompt=digit_prompt(i % 10), target=str(i % 10))
            for i in range(self.options.n_examples)
        ]

    def score(self, example: MediaExample, responses: list[Response]) -> dict[str, Score]:
        img = media_result(self.name, example, responses)
        pred, _ = self._judge_cache.predict(img[:1])
        return {"judge_acc": float(int(pred[0]) == int(example.target))}

    def describe_sample(self, example, responses, scores) -> dict:
        pred, conf = self._judge_cache.predict(media_result(self.name, example, responses)[:1])
        return describe_media(
            example,
            {
                "prediction": str(int(pred[0])),
                "confidence": round(float(conf[0]), 3),
                "judge": self._judge_cache.version,
                "judge_test_accuracy": round(self._judge_cache.test_accuracy, 4),
                "scores": dict(scores),
            },
        )


@TASKS.register("t2v_shapes")
class TextToVideoShapes(ClipGeneration):
    """Animate a shape moving in a direction; per-frame shape/colour judge plus centroid motion."""

    name = "t2v_shapes"
    version = 1

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

    def frames_ok(self, example: MediaExample, clip: np.ndarray) -> list[bool]:  # noqa: D102
        info = example.info
        return [
            len(found) == 1 and found[0].kind == info["kind"] and found[0].color == info["color"]
            for found in (shapes.parse_image(frame).shapes for frame in clip)
        ]


@TASKS.register("t2v_digits")
class TextToVideoDigits(DigitJudged, ClipGeneration):
    """Animate a digit moving in a direction; per-frame digit judge plus centroid motion."""

    name = "t2v_digits"
    version = 1

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

    def frames_ok(self, example: MediaExample, clip: np.ndarray) -> list[bool]:  # noqa: D102
        pred, _ = self._judge_cache.predict(clip)
        return [int(p) == example.info["digit"] for p in pred]
