"""The vision side models' quality: the tokenizer's reconstruction (``recon_shapes``, ``recon_mnist``: PSNR,
SSIM) and the cascaded refiner's gain over nearest-neighbour upsampling (``refiner_gain``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from ernie5.data import shapes
from ernie5.data.mnist import HOW_TO_GET as MNIST_HOW
from ernie5.data.mnist import digit_image, mnist_split
from ernie5.metrics import psnr, ssim
from evals.api import (
    MediaPart,
    ReconstructionRequest,
    RefineRequest,
    Request,
    Response,
)
from evals.task import TASKS, Example, Score, Task
from evals.tasks.media import (
    GENERATED,
    IMAGE_SIZE,
    CountOptions,
    MediaExample,
    describe_media,
    media_result,
    mnist_files,
)


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
        rec = media_result(self.name, example, responses)[0]
        return {"psnr": psnr(rec, example.media), "ssim": ssim(rec, example.media)}

    def describe_sample(self, example, responses, scores) -> dict:
        return describe_media(example, {"scores": {k: round(float(v), 3) for k, v in scores.items()}})


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
    data_files = mnist_files()
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

        refined = media_result(self.name, example, responses)[0]
        high = example.info["high"]
        bicubic = np.asarray(Image.fromarray(example.media).resize(high.shape[:2][::-1], Image.BICUBIC))
        return {
            "psnr_gain": psnr(refined, high) - psnr(bicubic, high),
            "ssim_gain": ssim(refined, high) - ssim(bicubic, high),
            "psnr": psnr(refined, high),
        }
