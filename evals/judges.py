"""Judges for generated images and clips: a reference digit classifier and motion checks.

The digit classifier plays the role Whisper plays in Seed-TTS-eval or a detector in GenEval: it
tells whether a generated image shows the digit the prompt asked for. The project trains it
itself (a small CNN on the MNIST *train* split of the 10k test images, seeded and deterministic)
the first time a task needs it and caches the weights under
``$ERNIE5_CACHE_DIR/judges/digit-v<VERSION>-<data hash>.safetensors``; its version and its
accuracy on the MNIST test split are recorded with every result that uses it. Bump
``DIGIT_JUDGE_VERSION`` whenever its architecture or training recipe changes.

Motion consistency of a clip is judged analytically: the intensity centroid of every frame is
tracked and the clip's direction is the sign of the dominant displacement axis.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

DIGIT_JUDGE_VERSION = 1
DIRECTIONS = ("left", "right", "up", "down")


class _DigitNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x_B1HW: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.c1(x_B1HW)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _to_input(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, 3) or (N, H, W) -> float (N, 1, 32, 32) in [0, 1]."""
    x = torch.as_tensor(np.asarray(images), dtype=torch.float32)
    if x.dim() == 4:
        x = x.mean(dim=-1)
    x = x[:, None] / 255.0
    if x.shape[-1] != 32:
        x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    return x


@dataclass
class DigitJudge:
    """A trained reference digit classifier."""

    net: _DigitNet
    test_accuracy: float
    path: Path

    @property
    def version(self) -> str:
        """What results record about the judge."""
        return f"digit-v{DIGIT_JUDGE_VERSION}"

    @torch.no_grad()
    def probabilities(self, images: np.ndarray) -> np.ndarray:
        """``P(digit | image)``, ``float32 (N, 10)``, for uint8 images ``(N, H, W[, 3])``."""
        return self.net(_to_input(images)).softmax(-1).numpy()

    def predict(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Predicted digit and its probability for uint8 images ``(N, H, W[, 3])``."""
        probs = self.probabilities(images)
        return probs.argmax(-1), probs.max(-1)


def _cache_dir() -> Path:
    return Path(os.environ.get("ERNIE5_CACHE_DIR", Path.home() / ".cache" / "ernie5")) / "judges"


def _train(images: np.ndarray, labels: np.ndarray, seed: int = 0, epochs: int = 8) -> _DigitNet:
    torch.manual_seed(seed)
    net = _DigitNet()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    x, y = _to_input(images), torch.as_tensor(labels)
    gen = torch.Generator().manual_seed(seed)
    steps = epochs * ((len(x) + 127) // 128)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), 128):
            idx = order[i : i + 128]
            # light augmentation: random shifts of up to 2 px, so generated digits need not be centred
            xb = torch.roll(
                x[idx], shifts=tuple(torch.randint(-2, 3, (2,), generator=gen).tolist()), dims=(2, 3)
            )
            loss = F.cross_entropy(net(xb), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return net.eval()


def load_digit_judge(data_dir: str | Path | None) -> DigitJudge:
    """The cached digit judge for this data root's MNIST, training it first if needed (~30 s)."""
    from ernie5.data.mnist import IMAGES_PATH, mnist_split
    from ernie5.data.root import require_file

    digest = hashlib.sha256(require_file(data_dir, IMAGES_PATH).read_bytes()).hexdigest()[:12]
    path = _cache_dir() / f"digit-v{DIGIT_JUDGE_VERSION}-{digest}.safetensors"
    test_x, test_y = mnist_split(data_dir, "test")
    net = _DigitNet()
    if path.is_file():
        net.load_state_dict(load_file(path))
        net.eval()
    else:
        train_x, train_y = mnist_split(data_dir, "train")
        net = _train(train_x, train_y)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file(net.state_dict(), str(tmp))
        tmp.replace(path)
    judge = DigitJudge(net, 0.0, path)
    pred, _ = judge.predict(test_x)
    judge.test_accuracy = float((pred == test_y).mean())
    return judge


def centroids(clip: np.ndarray) -> np.ndarray:
    """Intensity centroid ``(row, col)`` of every frame of a uint8 clip ``(T, H, W[, 3])``."""
    x = np.asarray(clip, dtype=np.float64)
    if x.ndim == 4:
        x = x.mean(axis=-1)
    x = np.clip(x - np.median(x, axis=(1, 2), keepdims=True), 0, None)
    t, h, w = x.shape
    mass = x.sum(axis=(1, 2)) + 1e-9
    rows = (x.sum(axis=2) * np.arange(h)).sum(axis=1) / mass
    cols = (x.sum(axis=1) * np.arange(w)).sum(axis=1) / mass
    return np.stack([rows, cols], axis=1)


def motion_direction(clip: np.ndarray, min_shift: float = 1.0) -> str | None:
    """Dominant motion of a clip: left | right | up | down, or None if it moves less than ``min_shift`` px."""
    c = centroids(clip)
    d_row, d_col = c[-1] - c[0]
    if max(abs(d_row), abs(d_col)) < min_shift:
        return None
    if abs(d_col) >= abs(d_row):
        return "right" if d_col > 0 else "left"
    return "down" if d_row > 0 else "up"


def motion_consistency(clip: np.ndarray) -> float:
    """Share of consecutive frame pairs whose centroid step agrees with the clip's overall direction."""
    c = centroids(clip)
    steps = np.diff(c, axis=0)
    total = c[-1] - c[0]
    if len(steps) == 0 or not np.any(total):
        return 0.0
    return float(np.mean(steps @ total > 0))
