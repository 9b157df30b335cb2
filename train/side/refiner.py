"""Training of the cascaded diffusion refiner on (degraded low-res, high-res) pairs.

Pairs: the same content rendered at ``low_size`` (the backbone's side) and at ``scale * low_size``, from
fresh procedural shapes-world scenes (:mod:`ernie5.data.shapes`, always available; the layout is the same
at every size) and, when the data root has them, MNIST digits of the project's train split
(:func:`ernie5.data.mnist.digit_image` at both sizes). The low-res image is then degraded (ERNIE's
"controlled degradation"), each step independently per image:

1. with probability ``p_tokenizer`` a round trip through the vision tokenizer (when ``tokenizer_path`` is
   given): exactly what the backbone's decoded output looks like;
2. with probability ``p_blur`` a Gaussian blur, radius U[``blur_radius``];
3. with probability ``p_noise`` additive Gaussian noise, std U[0, ``noise_std_max``] (uint8 units);
4. with probability ``p_jpeg`` a JPEG round trip (4:4:4), quality U[``jpeg_quality``].

The refiner adds its own noise-conditioning augmentation on top (:mod:`ernie5.tokenizers.refiner`).
AdamW with linear warmup and a cosine decay whose progress is the larger of the step and the
time-budget fractions, so a budget-capped run still anneals; an EMA of the weights
(``ema_decay``, with the usual warm-up ``min(decay, (1 + step) / (10 + step))``) is what gets
evaluated and saved.

Output folder::

    out_dir/config.yaml     the RefinerTrainConfig
    out_dir/meta.json       provenance (git hash, versions, machine, seed, tokenizer path)
    out_dir/metrics.jsonl   one record per log_every steps: loss (mean since the last record), lr, grad norm
    out_dir/refiner/        the EMA refiner (Refiner.save)
    out_dir/summary.json    held-out PSNR / SSIM: bicubic vs high-res, refined vs high-res, gains

Held-out sets (``eval_images`` each): ``shapes`` (scenes from another seed, degraded by the training
pipeline with a fixed seed), ``shapes_tokenizer`` (the same scenes after a tokenizer round trip only; when a
tokenizer is given) and ``mnist`` (the MNIST test split, pipeline-degraded; when present). Each is scored
for every ``eval_steps`` count and for the SDEdit shortcut (``sdedit_start_t``, ``sdedit_steps``). The
top-level ``psnr_gain`` / ``ssim_gain`` are ``shapes`` at the refiner's default ``sample_steps``.

Deviations:
  1. MNIST's 64 px "high-res" is its 28 px digit resized bilinearly (:func:`ernie5.data.mnist.digit_image`),
     so for digits the refiner mostly learns to undo the degradation; shapes scenes carry real detail.
  2. Held-out shapes scenes are fresh draws from another seed; the scene space is finite, so a held-out
     scene can coincide with a training one (one-shape scenes certainly do).
  3. The tokenizer round trip always uses the tokenizer's full bit depth.
"""

from __future__ import annotations

import copy
import io
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageFilter

from ernie5.config import check, dump
from ernie5.data.root import resolve_data_dir
from ernie5.metrics import psnr, ssim
from ernie5.store.runs import append_jsonl, provenance, write_json
from ernie5.tokenizers.refiner import Refiner, RefinerConfig, to_pixels, upsample_uint8
from ernie5.tokenizers.vision import VisionTokenizer, reconstruct
from train.common.optim import OptimConfig, make_adamw, param_groups
from train.common.schedule import ScheduleConfig, lr_at
from train.side.resume import ResumeConfig, side_run
from train.side.vision_tokenizer import mnist_digits


def _is_range(pair: tuple[float, float], lo: float, hi: float) -> bool:
    return lo <= pair[0] <= pair[1] <= hi


@dataclass(frozen=True, kw_only=True, slots=True)
class RefinerTrainConfig:
    """Everything :func:`train_refiner` needs."""

    refiner: RefinerConfig = field(default_factory=RefinerConfig)
    """The refiner to train."""
    steps: int = 4000
    """Optimizer steps (a ``time_budget_s`` may stop earlier)."""
    batch_size: int = 16
    """Pairs per step."""
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=2e-3, betas=(0.9, 0.99), weight_decay=0.0, fused=False)
    )
    """AdamW (torch's own step, ``fused`` off); weight decay on conv and linear weights only."""
    schedule: ScheduleConfig = field(
        default_factory=lambda: ScheduleConfig(kind="cosine", warmup_steps=50, min_lr_ratio=0.05)
    )
    """Linear warmup, then a half cosine to ``min_lr_ratio * lr`` (``kind`` must be ``cosine``; progress:
    see the module docstring)."""
    ema_decay: float = 0.999
    """EMA decay of the evaluated / saved weights."""
    mnist_fraction: float = 0.25
    """Share of MNIST digits in each batch (when the data root has them; else all shapes)."""
    p_tokenizer: float = 0.5
    """Probability of a vision-tokenizer round trip of the low-res input (needs ``tokenizer_path``)."""
    p_blur: float = 0.3
    """Probability of a Gaussian blur."""
    blur_radius: tuple[float, float] = (0.3, 0.8)
    """Range of the blur's standard deviation, low-res pixels."""
    p_noise: float = 0.3
    """Probability of additive Gaussian noise."""
    noise_std_max: float = 6.0
    """Largest noise standard deviation, uint8 units."""
    p_jpeg: float = 0.2
    """Probability of a JPEG round trip."""
    jpeg_quality: tuple[int, int] = (70, 95)
    """Range of the JPEG quality."""
    eval_images: int = 64
    """Held-out pairs per evaluation set."""
    eval_steps: tuple[int, ...] = (1, 4, 10, 20)
    """Euler step counts scored on the held-out sets (the refiner's ``sample_steps`` is added)."""
    sdedit_start_t: float = 0.5
    """Start time of the scored SDEdit shortcut (0 = not scored)."""
    sdedit_steps: int = 10
    """Euler steps of the scored SDEdit shortcut."""
    log_every: int = 25
    """Steps between metrics.jsonl records."""
    seed: int = 0
    """Seeds the weights, the data, the degradations, the loss noise and the held-out sets."""
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    """Resume states and preemption (:mod:`train.side.resume`)."""

    def __post_init__(self) -> None:
        check(self.steps >= 1 and self.batch_size >= 1, "steps and batch_size must be >= 1")
        check(self.schedule.kind == "cosine", f"schedule.kind={self.schedule.kind!r}: expected 'cosine'")
        check(0 <= self.ema_decay < 1, f"ema_decay={self.ema_decay} must be in [0, 1)")
        probs = (self.mnist_fraction, self.p_tokenizer, self.p_blur, self.p_noise, self.p_jpeg)
        check(all(0 <= p <= 1 for p in probs), "mnist_fraction and p_* must be in [0, 1]")
        check(
            _is_range(self.blur_radius, 0, 10), f"blur_radius={self.blur_radius} must be 0 <= lo <= hi <= 10"
        )
        check(0 <= self.noise_std_max <= 64, f"noise_std_max={self.noise_std_max} must be in [0, 64]")
        check(_is_range(self.jpeg_quality, 1, 100), f"jpeg_quality={self.jpeg_quality} must be in [1, 100]")
        check(self.eval_images >= 1, f"eval_images={self.eval_images} must be >= 1")
        check(bool(self.eval_steps) and min(self.eval_steps) >= 1, "eval_steps must be non-empty and >= 1")
        check(0 <= self.sdedit_start_t <= 1, f"sdedit_start_t={self.sdedit_start_t} must be in [0, 1]")
        check(self.sdedit_steps >= 1 and self.log_every >= 1, "sdedit_steps and log_every must be >= 1")


# ---------------------------------------------------------------------- EMA
@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """``ema <- decay * ema + (1 - decay) * model``, parameters and buffers."""
    for e, p in zip(ema.state_dict().values(), model.state_dict().values()):
        if e.dtype.is_floating_point:
            e.lerp_(p, 1.0 - decay)
        else:
            e.copy_(p)


# ---------------------------------------------------------------------- data
def render_pairs(n: int, rng: random.Random, low_size: int, scale: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` fresh shapes scenes as ``(low uint8 (n, s, s, 3), high uint8 (n, scale s, scale s, 3))``."""
    from ernie5.data.shapes import random_scene, render

    scenes = [random_scene(rng) for _ in range(n)]
    return (
        np.stack([render(s, low_size) for s in scenes]),
        np.stack([render(s, low_size * scale) for s in scenes]),
    )


def digit_pairs(digits: np.ndarray, low_size: int, scale: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw digits ``(n, h, w)`` as ``(low, high)`` RGB images at ``low_size`` and ``scale * low_size``."""
    from ernie5.data.mnist import digit_image

    return (
        np.stack([digit_image(d, low_size) for d in digits]),
        np.stack([digit_image(d, low_size * scale) for d in digits]),
    )


def degrade(
    low: np.ndarray, rng: random.Random, cfg: RefinerTrainConfig, tok: VisionTokenizer | None
) -> np.ndarray:
    """The degraded copy of uint8 ``low`` ``(n, s, s, 3)``: tokenizer round trip, blur, noise, JPEG, each
    with its own probability per image (see the module docstring). Deterministic given ``rng``'s state."""
    out = low.copy()
    if tok is not None and cfg.p_tokenizer > 0:
        picked = [i for i in range(len(out)) if rng.random() < cfg.p_tokenizer]
        if picked:
            out[picked] = reconstruct(tok, out[picked])
    noise_rng = np.random.default_rng(rng.getrandbits(63))
    for i in range(len(out)):
        img = out[i]
        if rng.random() < cfg.p_blur:
            radius = rng.uniform(*cfg.blur_radius)
            img = np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(radius)))
        if rng.random() < cfg.p_noise:
            std = rng.uniform(0.0, cfg.noise_std_max)
            img = np.clip(img + noise_rng.normal(0.0, std, img.shape), 0, 255).round().astype(np.uint8)
        if rng.random() < cfg.p_jpeg:
            buf = io.BytesIO()
            Image.fromarray(img).save(
                buf, format="JPEG", quality=rng.randint(*cfg.jpeg_quality), subsampling=0
            )
            img = np.asarray(Image.open(buf).convert("RGB"))
        out[i] = img
    return out


@dataclass(frozen=True, slots=True)
class _PairSource:
    """Training pairs: fresh shapes scenes plus (when present) MNIST train digits."""

    low_size: int
    scale: int
    mnist_fraction: float
    digits: np.ndarray | None

    def sample(self, n: int, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
        """``(low, high)`` uint8 pairs, ``round(n * mnist_fraction)`` of them digits (if any)."""
        n_mnist = round(n * self.mnist_fraction) if self.digits is not None else 0
        low, high = render_pairs(n - n_mnist, rng, self.low_size, self.scale)
        if n_mnist:
            picks = self.digits[[rng.randrange(len(self.digits)) for _ in range(n_mnist)]]
            d_low, d_high = digit_pairs(picks, self.low_size, self.scale)
            low, high = np.concatenate([low, d_low]), np.concatenate([high, d_high])
        return low, high


# ---------------------------------------------------------------------- evaluation
def _eval_sets(
    cfg: RefinerTrainConfig, tok: VisionTokenizer | None, test_digits: np.ndarray | None
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Held-out ``name -> (degraded low, high)``; fixed seeds, disjoint from the training stream's seed."""
    rc = cfg.refiner
    low, high = render_pairs(cfg.eval_images, random.Random(cfg.seed + 1_000_003), rc.low_size, rc.scale)
    sets = {"shapes": (degrade(low, random.Random(cfg.seed + 2_000_003), cfg, tok), high)}
    if tok is not None:
        sets["shapes_tokenizer"] = (reconstruct(tok, low), high)
    if test_digits is not None:
        d_low, d_high = digit_pairs(test_digits[: cfg.eval_images], rc.low_size, rc.scale)
        sets["mnist"] = (degrade(d_low, random.Random(cfg.seed + 3_000_003), cfg, tok), d_high)
    return sets


def _score(pred: np.ndarray, high: np.ndarray, base: dict[str, float]) -> dict[str, float]:
    p, s = psnr(high, pred), ssim(high, pred)
    return {
        "psnr": round(p, 3),
        "ssim": round(s, 4),
        "psnr_gain": round(p - base["psnr"], 3),
        "ssim_gain": round(s - base["ssim"], 4),
    }


def evaluate_refiner(
    refiner: Refiner, sets: dict[str, tuple[np.ndarray, np.ndarray]], cfg: RefinerTrainConfig, seed: int = 0
) -> dict[str, Any]:
    """Per set: bicubic PSNR / SSIM vs high-res, and for each step count (and the SDEdit shortcut) the
    refined PSNR / SSIM with their gains over bicubic."""
    step_counts = sorted({*cfg.eval_steps, refiner.cfg.sample_steps})
    out: dict[str, Any] = {}
    for name, (low, high) in sets.items():
        bicubic = upsample_uint8(low, refiner.cfg.scale)
        base = {"psnr": round(psnr(high, bicubic), 3), "ssim": round(ssim(high, bicubic), 4)}
        row: dict[str, Any] = {"bicubic": base}
        for steps in step_counts:
            row[f"steps_{steps}"] = _score(refiner.refine(low, steps=steps, seed=seed), high, base)
        if cfg.sdedit_start_t > 0:
            pred = refiner.refine(low, steps=cfg.sdedit_steps, seed=seed, start_t=cfg.sdedit_start_t)
            row[f"sdedit_t{cfg.sdedit_start_t:g}_steps_{cfg.sdedit_steps}"] = _score(pred, high, base)
        out[name] = row
    return out


# ---------------------------------------------------------------------- entry
def train_refiner(
    cfg: RefinerTrainConfig,
    out_dir: str | Path,
    data_dir: str | Path | None = None,
    tokenizer_path: str | Path | None = None,
    time_budget_s: float | None = None,
) -> dict[str, Any]:
    """Train the refiner, evaluate its EMA weights against bicubic upsampling, save it.

    Args:
        cfg: the run configuration.
        out_dir: the output folder (created; layout in the module docstring).
        data_dir: the data root (MNIST); None = ``$ERNIE5_DATA_DIR``; without MNIST, shapes only.
        tokenizer_path: a saved 2D :class:`VisionTokenizer` (its ``image_size`` must be the refiner's
            ``low_size``) whose round trip is one of the degradations; None = no tokenizer degradation.
        time_budget_s: optional wall-clock cap on the training loop (the run then stops early, says so in
            the summary, and the cosine schedule follows the time fraction).

    Returns:
        The summary written to ``summary.json``: ``eval`` (per held-out set: ``bicubic`` and per step count
        ``psnr``, ``ssim``, ``psnr_gain``, ``ssim_gain``), the headline ``psnr_gain`` / ``ssim_gain``
        (``shapes``, default steps), steps run, timings, parameter count.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with side_run(out, dump(cfg), cfg.resume) as run:
        meta = provenance(seed=cfg.seed)
        meta["tokenizer_path"] = str(tokenizer_path) if tokenizer_path is not None else None
        write_json(out / "meta.json", meta)
        rc = cfg.refiner
        tok = None
        if tokenizer_path is not None:
            tok = VisionTokenizer.load(tokenizer_path)
            check(
                tok.cfg.image_size == rc.low_size and tok.cfg.mode == "2d",
                f"tokenizer {tokenizer_path}: need a 2d tokenizer with image_size={rc.low_size}, got "
                f"{tok.cfg.mode} at {tok.cfg.image_size}",
            )
        root = resolve_data_dir(data_dir)
        train_digits, test_digits = mnist_digits(root, "train"), mnist_digits(root, "test")
        source = _PairSource(rc.low_size, rc.scale, cfg.mnist_fraction, train_digits)
        sets = _eval_sets(cfg, tok, test_digits)

        torch.manual_seed(cfg.seed)
        rng = random.Random(cfg.seed)
        generator = torch.Generator().manual_seed(cfg.seed)
        refiner = Refiner(rc)
        ema = copy.deepcopy(refiner).requires_grad_(False)
        opt = make_adamw(param_groups(refiner, cfg.optim.weight_decay, min_ndim=2), cfg.optim)
        summary: dict[str, Any] = {
            "n_params": sum(p.numel() for p in refiner.parameters()),
            "mnist": train_digits is not None,
            "tokenizer": tok is not None,
            "default_steps": rc.sample_steps,
        }
        t0 = time.perf_counter()
        state = {"refiner": refiner, "ema": ema, "opt": opt, "rng": rng, "generator": generator}
        steps_run, extras = run.restore("refiner", state)
        window = extras.get("window", [])
        for step in range(steps_run, cfg.steps):
            elapsed = time.perf_counter() - t0
            if time_budget_s is not None and elapsed > time_budget_s:
                summary["stopped_early_at_step"] = step
                break
            progress = max(step / cfg.steps, elapsed / time_budget_s if time_budget_s else 0.0)
            lr = lr_at(step, cfg.steps, cfg.optim.lr, cfg.schedule, progress)
            for group in opt.param_groups:
                group["lr"] = lr
            low, high = source.sample(cfg.batch_size, rng)
            low = degrade(low, rng, cfg, tok)
            loss = refiner.loss(to_pixels(low), to_pixels(high), generator=generator)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                refiner.parameters(), cfg.optim.grad_clip or float("inf")
            )
            opt.step()
            update_ema(ema, refiner, min(cfg.ema_decay, (1 + step) / (10 + step)))
            window.append(loss.item())
            steps_run = step + 1
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                record = {
                    "step": step,
                    "lr": lr,
                    "loss": float(np.mean(window)),
                    "grad_norm": float(grad_norm),
                }
                record["elapsed_s"] = round(time.perf_counter() - t0, 2)
                append_jsonl(out / "metrics.jsonl", record)
                window = []
            if steps_run < cfg.steps:
                run.step_done("refiner", steps_run, state, {"window": window})
        summary["steps"] = steps_run
        summary["train_s"] = round(time.perf_counter() - t0, 1)
        ema.save(out / "refiner", meta={"steps": steps_run, "seed": cfg.seed, "ema_decay": cfg.ema_decay})

        t1 = time.perf_counter()
        summary["eval"] = evaluate_refiner(ema, sets, cfg, seed=cfg.seed)
        summary["eval_s"] = round(time.perf_counter() - t1, 1)
        headline = summary["eval"]["shapes"][f"steps_{rc.sample_steps}"]
        summary["psnr_gain"], summary["ssim_gain"] = headline["psnr_gain"], headline["ssim_gain"]
        write_json(out / "summary.json", summary)
        run.finish()
    return summary
