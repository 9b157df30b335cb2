"""Training of the vision tokenizer: 2D on images, then inflated to causal 3D and fine-tuned on clips.

Data (all uint8, 32x32 RGB by default): a mixture of fresh procedural shapes-world scenes
(:mod:`ernie5.data.shapes`, always available) and MNIST digits of the project's train split
(:func:`ernie5.data.mnist.mnist_split`, when the data root has them). Each step of the 3D stage sees
clips of moving digits and moving shapes (:mod:`ernie5.data.moving`) plus a batch of single images
(one-frame videos), so the inflated tokenizer keeps its image quality. Held-out evaluation: scenes from
a different seed and the MNIST test split (1,996 digits, never trained on).

Stages, one output folder::

    out_dir/config.yaml        the VisionTokenizerTrainConfig
    out_dir/meta.json          provenance (git hash, versions, machine, seed)
    out_dir/metrics.jsonl      one record per log_every steps: loss terms, n_bits, train PSNR, bit usage
    out_dir/tokenizer_2d/      the image tokenizer (VisionTokenizer.save)
    out_dir/tokenizer_3d/      the inflated, clip-fine-tuned causal 3D tokenizer (when video_steps > 0)
    out_dir/summary.json       held-out PSNR / SSIM per bit depth, timings, parameter count

Progressive bit depth: ``bits_schedule`` lists ``(fraction of steps, n_bits)`` stages (default 6 bits for
the first half, then 10). After the first stage, each step trains at an earlier, lower depth with
probability ``low_bits_prob`` (the quantiser nests depths, see :mod:`ernie5.tokenizers.vision_quant`), so
the final tokenizer still decodes the low-depth codes a backbone starts on.

Loss: ``rec_weight * (L1 + L2) + ssim_weight * (1 - SSIM) + gradient_weight * Sobel-L1
+ commit_weight * commitment [+ adv_weight * hinge GAN]`` (:mod:`ernie5.tokenizers.vision_losses`).

Deviations:
  1. MNIST has only its 10k test images here; the project's train split of them is used for training and
     its disjoint test split for evaluation (see :mod:`ernie5.data.mnist`).
  2. One short run on a laptop-class CPU instead of large-scale image pretraining; the GAN is off by
     default (it needs far more steps than the budget to help).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ernie5.config import check, dump
from ernie5.data.root import DataMissing, resolve_data_dir
from ernie5.metrics import psnr, ssim
from ernie5.store.runs import append_jsonl, provenance, write_json
from ernie5.tokenizers.vision import (
    VisionTokenizer,
    clips_to_pixels,
    images_to_pixels,
    inflate,
    reconstruct,
)
from ernie5.tokenizers.vision_config import VisionTokenizerConfig
from ernie5.tokenizers.vision_losses import (
    PatchDiscriminator,
    hinge_d_loss,
    hinge_g_loss,
    perceptual_loss,
    reconstruction_loss,
)
from train.common.optim import OptimConfig, make_adamw, param_groups
from train.common.schedule import ScheduleConfig, lr_at
from train.side.resume import ResumeConfig, SideRun, side_run


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionTokenizerTrainConfig:
    """Everything :func:`train_vision_tokenizer` needs."""

    tokenizer: VisionTokenizerConfig = field(default_factory=VisionTokenizerConfig)
    """The 2D tokenizer to train (``mode`` must be ``"2d"``)."""
    steps: int = 2000
    """Optimizer steps of the 2D (image) stage."""
    batch_size: int = 64
    """Images per step."""
    optim: OptimConfig = field(
        default_factory=lambda: OptimConfig(lr=2e-3, betas=(0.9, 0.99), weight_decay=0.0, fused=False)
    )
    """AdamW of the 2D stage (torch's own step, ``fused`` off; the 3D stage's runs at ``video_lr``);
    weight decay on conv weights only (norms, biases and code radii are never decayed)."""
    schedule: ScheduleConfig = field(
        default_factory=lambda: ScheduleConfig(kind="cosine", warmup_steps=50, min_lr_ratio=0.05)
    )
    """The 2D stage's: linear warmup, then a half cosine to ``min_lr_ratio * lr`` at the last step
    (``kind`` must be ``cosine``)."""
    rec_weight: float = 1.0
    """Weight of the L1 + L2 pixel loss."""
    ssim_weight: float = 0.2
    """Weight of ``1 - SSIM``."""
    gradient_weight: float = 0.5
    """Weight of the Sobel-gradient L1."""
    commit_weight: float = 1.0
    """Weight of the quantiser's commitment loss (``beta`` is in the tokenizer config)."""
    adv_weight: float = 0.0
    """Weight of the hinge GAN generator loss (0 = no discriminator)."""
    adv_start_frac: float = 0.5
    """Fraction of the 2D steps after which the GAN loss starts."""
    bits_schedule: tuple[tuple[float, int], ...] = ((0.0, 6), (0.5, 10))
    """Progressive bit depth: ``(start fraction of steps, n_bits)`` stages, fractions increasing from 0."""
    low_bits_prob: float = 0.25
    """After the first stage, the probability that a step trains at an earlier (lower) depth instead."""
    mnist_fraction: float = 0.5
    """Share of MNIST digits in each image batch (when the data root has them; else all shapes)."""
    video_steps: int = 80
    """Steps of the inflated 3D tokenizer on clips (0 = no 3D stage)."""
    video_batch_size: int = 16
    """Clips per 3D step."""
    video_frames: int = 4
    """Frames per clip."""
    video_image_batch_size: int = 32
    """Single images (one-frame videos) mixed into every 3D step, so image quality is kept."""
    video_lr: float = 1e-4
    """Constant AdamW learning rate of the 3D stage (low: Adam moves the zero-initialised temporal slices
    by about ``lr`` per step whatever their gradient's scale)."""
    eval_images: int = 500
    """Held-out images per evaluation set (shapes scenes, MNIST test digits)."""
    eval_clips: int = 64
    """Held-out clips for the 3D evaluation."""
    log_every: int = 25
    """Steps between metrics.jsonl records."""
    seed: int = 0
    """Seeds the weights, the data and the held-out sets."""
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    """Resume states and preemption (:mod:`train.side.resume`; the 2D and 3D stages each resume)."""

    def __post_init__(self) -> None:
        check(self.tokenizer.mode == "2d", f"tokenizer.mode={self.tokenizer.mode!r} must be '2d'")
        check(self.steps >= 1, f"steps={self.steps} must be >= 1")
        check(self.batch_size >= 1, f"batch_size={self.batch_size} must be >= 1")
        check(self.video_lr > 0, f"video_lr={self.video_lr} must be > 0")
        check(self.schedule.kind == "cosine", f"schedule.kind={self.schedule.kind!r}: expected 'cosine'")
        weights = (
            self.rec_weight,
            self.ssim_weight,
            self.gradient_weight,
            self.commit_weight,
            self.adv_weight,
        )
        check(all(w >= 0 for w in weights), "loss weights must be >= 0")
        check(0 <= self.adv_start_frac <= 1, f"adv_start_frac={self.adv_start_frac} must be in [0, 1]")
        fracs = [f for f, _ in self.bits_schedule]
        depths = [b for _, b in self.bits_schedule]
        check(
            bool(fracs) and fracs[0] == 0 and all(a < b for a, b in zip(fracs, fracs[1:])) and fracs[-1] < 1,
            f"bits_schedule fractions {fracs} must start at 0, increase and stay < 1",
        )
        check(
            all(1 <= b <= self.tokenizer.latent_bits for b in depths) and depths == sorted(depths),
            f"bits_schedule depths {depths} must be non-decreasing in [1, tokenizer.latent_bits]",
        )
        check(0 <= self.low_bits_prob <= 1, f"low_bits_prob={self.low_bits_prob} must be in [0, 1]")
        check(0 <= self.mnist_fraction <= 1, f"mnist_fraction={self.mnist_fraction} must be in [0, 1]")
        check(self.video_steps >= 0, f"video_steps={self.video_steps} must be >= 0")
        check(self.video_batch_size >= 1 and self.video_frames >= 1, "video batch and frames must be >= 1")
        check(self.video_image_batch_size >= 0, "video_image_batch_size must be >= 0")
        check(self.eval_images >= 1 and self.eval_clips >= 1, "eval_images and eval_clips must be >= 1")
        check(self.log_every >= 1, f"log_every={self.log_every} must be >= 1")


# ---------------------------------------------------------------------- schedules
def bits_at(step: int, cfg: VisionTokenizerTrainConfig, rng: random.Random) -> int:
    """Bit depth of a 2D step: the current ``bits_schedule`` stage, or w.p. ``low_bits_prob`` an earlier
    stage's (lower) depth, uniformly."""
    stage = max(i for i, (frac, _) in enumerate(cfg.bits_schedule) if step >= frac * cfg.steps)
    lower = sorted({b for _, b in cfg.bits_schedule[:stage]} - {cfg.bits_schedule[stage][1]})
    if lower and rng.random() < cfg.low_bits_prob:
        return rng.choice(lower)
    return cfg.bits_schedule[stage][1]


# ---------------------------------------------------------------------- data
def shapes_images(n: int, seed: int, size: int = 32) -> np.ndarray:
    """``n`` fresh shapes-world scenes ``uint8 (n, size, size, 3)`` from ``random.Random(seed)``."""
    from ernie5.data.shapes import random_scene, render

    rng = random.Random(seed)
    return np.stack([render(random_scene(rng), size) for _ in range(n)])


def mnist_digits(data_dir: str | Path | None, split: str) -> np.ndarray | None:
    """Raw MNIST digits ``uint8 (N, 28, 28)`` of the project's ``split``, or None when the root lacks them."""
    from ernie5.data.mnist import mnist_split

    try:
        return mnist_split(data_dir, split)[0]
    except DataMissing:
        return None


def digit_images(digits: np.ndarray, size: int = 32) -> np.ndarray:
    """Raw digits ``(N, h, w)`` as the project's RGB images ``uint8 (N, size, size, 3)``."""
    from ernie5.data.mnist import digit_image

    return np.stack([digit_image(d, size) for d in digits])


def sample_clips(
    n: int, rng: random.Random, n_frames: int, size: int, digits: np.ndarray | None
) -> np.ndarray:
    """``n`` clips ``uint8 (n, T, size, size, 3)``: half moving pairs of ``digits`` (raw ``(N, h, w)``; if
    given) and half moving shapes."""
    from ernie5.data.moving import DIRECTIONS, moving_digits_clip, moving_shape_clip
    from ernie5.data.shapes import random_scene

    clips = []
    for _ in range(n):
        if digits is not None and rng.random() < 0.5:
            pair = [digits[rng.randrange(len(digits))] for _ in range(2)]
            dirs = [rng.choice(DIRECTIONS) for _ in range(2)]
            clip, _ = moving_digits_clip(pair, dirs, rng, n_frames=n_frames, size=size, digit_size=size // 2)
        else:
            shape = random_scene(rng, 1).shapes[0]
            clip, _ = moving_shape_clip(shape, rng.choice(DIRECTIONS), rng, n_frames=n_frames, size=size)
        clips.append(clip)
    return np.stack(clips)


@dataclass(frozen=True, slots=True)
class _TrainData:
    """The training pools: MNIST train digits (raw and as images) when the data root has them."""

    size: int
    mnist_fraction: float
    digits: np.ndarray | None
    digit_images: np.ndarray | None

    def images(self, n: int, rng: random.Random) -> np.ndarray:
        """``n`` images: ``round(n * mnist_fraction)`` MNIST digits (if any), the rest fresh scenes."""
        n_mnist = round(n * self.mnist_fraction) if self.digit_images is not None else 0
        batch = shapes_images(n - n_mnist, seed=rng.getrandbits(63), size=self.size)
        if n_mnist:
            picks = [rng.randrange(len(self.digit_images)) for _ in range(n_mnist)]
            batch = np.concatenate([batch, self.digit_images[picks]])
        return batch


# ---------------------------------------------------------------------- steps
def _losses(
    tok: VisionTokenizer, x: torch.Tensor, n_bits: int, cfg: VisionTokenizerTrainConfig
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor, Any]:
    x_rec, codes = tok(x, n_bits=n_bits)
    rec_NCHW, x_NCHW = x_rec.transpose(1, 2).flatten(0, 1), x.transpose(1, 2).flatten(0, 1)
    rec = reconstruction_loss(rec_NCHW, x_NCHW)
    ssim_loss, grad_loss = perceptual_loss(rec_NCHW, x_NCHW)
    loss = (
        cfg.rec_weight * rec
        + cfg.ssim_weight * ssim_loss
        + cfg.gradient_weight * grad_loss
        + cfg.commit_weight * codes.commit_loss
    )
    mse = (rec_NCHW.detach() - x_NCHW).square().mean().clamp_min(1e-10)
    terms = {
        "rec": rec.item(),
        "ssim_loss": ssim_loss.item(),
        "grad_loss": grad_loss.item(),
        "commit": codes.commit_loss.item(),
        "train_psnr": 10 * math.log10(4.0 / mse.item()),
        "bit_balance": float(torch.cat([b.flatten() for b in codes.bits]).mean()),
    }
    return loss, terms, rec_NCHW, codes


def _evaluate(tok: VisionTokenizer, sets: dict[str, np.ndarray], depths: list[int]) -> dict[str, float]:
    out = {}
    for name, frames in sets.items():
        for n_bits in depths:
            rec = reconstruct(tok, frames, n_bits=n_bits)
            out[f"{name}/bits{n_bits}/psnr"] = round(psnr(frames, rec), 3)
            out[f"{name}/bits{n_bits}/ssim"] = round(ssim(frames, rec), 4)
    return out


@torch.no_grad()
def encode_decode_ms(tok: VisionTokenizer, batch_size: int = 64, reps: int = 5) -> float:
    """Median wall time (ms) of encode + quantise + decode of ``batch_size`` random images, eval mode."""
    size = tok.cfg.image_size
    x = torch.rand(batch_size, tok.cfg.channels, 1, size, size) * 2 - 1
    was_training = tok.training
    tok.eval()
    tok(x)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        tok(x)
        times.append((time.perf_counter() - t0) * 1000)
    tok.train(was_training)
    return float(np.median(times))


# ---------------------------------------------------------------------- entry
def train_vision_tokenizer(
    cfg: VisionTokenizerTrainConfig,
    out_dir: str | Path,
    data_dir: str | Path | None = None,
    *,
    time_budget_s: float | None = None,
) -> dict[str, Any]:
    """Train the 2D tokenizer on images, then (``video_steps > 0``) inflate it and fine-tune on clips.

    Args:
        cfg: the run configuration.
        out_dir: the output folder (created; see the module docstring for its layout).
        data_dir: the data root (MNIST); None = ``$ERNIE5_DATA_DIR``; without MNIST, shapes only.
        time_budget_s: optional wall-clock cap on the 2D stage (it then stops early and says so).

    Returns:
        The summary written to ``summary.json``: held-out PSNR/SSIM per set and bit depth (for the 2D
        tokenizer before and after training, and for the 3D one), steps run, timings, parameter count.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with side_run(out, dump(cfg), cfg.resume) as run:
        return _train(cfg, out, data_dir, run, time_budget_s)


def _train(
    cfg: VisionTokenizerTrainConfig,
    out: Path,
    data_dir: str | Path | None,
    run: SideRun,
    time_budget_s: float | None,
) -> dict[str, Any]:
    write_json(out / "meta.json", provenance(seed=cfg.seed))
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    size = cfg.tokenizer.image_size
    root = resolve_data_dir(data_dir)
    train_digits, test_digits = mnist_digits(root, "train"), mnist_digits(root, "test")
    data = _TrainData(
        size,
        cfg.mnist_fraction,
        train_digits,
        digit_images(train_digits, size) if train_digits is not None else None,
    )
    eval_sets = {"shapes": shapes_images(cfg.eval_images, seed=cfg.seed + 1_000_003, size=size)}
    if test_digits is not None:
        eval_sets["mnist"] = digit_images(test_digits[: cfg.eval_images], size)
    depths = sorted({b for _, b in cfg.bits_schedule})

    tok = VisionTokenizer(cfg.tokenizer)
    summary: dict[str, Any] = {
        "n_params": sum(p.numel() for p in tok.parameters()),
        "mnist": train_digits is not None,
        "untrained": _evaluate(tok, eval_sets, depths[-1:]),
    }
    opt = make_adamw(param_groups(tok, cfg.optim.weight_decay, min_ndim=4), cfg.optim)
    state: dict[str, Any] = {"tok": tok, "opt": opt, "rng": rng}
    disc = disc_opt = None
    if cfg.adv_weight > 0:
        disc = PatchDiscriminator(cfg.tokenizer.channels)
        disc_opt = torch.optim.AdamW(disc.parameters(), lr=cfg.optim.lr, betas=(0.5, 0.9))
        state |= {"disc": disc, "disc_opt": disc_opt}

    t0 = time.perf_counter()
    if run.phase == "3d":  # the 2D stage had finished: its weights are in the 3D state
        steps_run = start = run.restore("3d", {"tok2d": tok})[1]["steps_2d"]
    else:
        steps_run = start = run.restore("2d", state)[0]
    for step in range(start, cfg.steps):
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            summary["stopped_early_at_step"] = step
            break
        x = images_to_pixels(data.images(cfg.batch_size, rng))
        n_bits = bits_at(step, cfg, rng)
        lr = lr_at(step, cfg.steps, cfg.optim.lr, cfg.schedule)
        for group in opt.param_groups:
            group["lr"] = lr
        loss, terms, rec_NCHW, _ = _losses(tok, x, n_bits, cfg)
        use_adv = disc is not None and step >= cfg.adv_start_frac * cfg.steps
        if use_adv:
            g_loss = hinge_g_loss(disc(rec_NCHW))
            loss = loss + cfg.adv_weight * g_loss
            terms["g_loss"] = g_loss.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(tok.parameters(), cfg.optim.grad_clip or float("inf"))
        opt.step()
        if use_adv:
            d_loss = hinge_d_loss(disc(x.transpose(1, 2).flatten(0, 1)), disc(rec_NCHW.detach()))
            disc_opt.zero_grad(set_to_none=True)
            d_loss.backward()
            disc_opt.step()
            terms["d_loss"] = d_loss.item()
        steps_run = step + 1
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            record = {"stage": "2d", "step": step, "lr": lr, "n_bits": n_bits, "loss": loss.item(), **terms}
            record["grad_norm"] = float(grad_norm)
            record["elapsed_s"] = round(time.perf_counter() - t0, 2)
            append_jsonl(out / "metrics.jsonl", record)
        if steps_run < cfg.steps or cfg.video_steps > 0:
            run.step_done("2d", steps_run, state)
    summary["steps_2d"] = steps_run
    summary["train_2d_s"] = round(time.perf_counter() - t0, 1)
    summary["radii"] = [round(r, 4) for r in tok.quantizer.log_radius.detach().exp().tolist()]
    summary["tokenizer_2d"] = _evaluate(tok, eval_sets, depths)
    summary["encode_decode_ms_b64"] = round(encode_decode_ms(tok), 1)
    tok.save(out / "tokenizer_2d", meta={"stage": "2d", "steps": steps_run, "seed": cfg.seed})

    if cfg.video_steps > 0:
        summary.update(_train_video(tok, cfg, out, data, test_digits, eval_sets, rng, run, steps_run))
    summary["total_s"] = round(time.perf_counter() - t0, 1)
    write_json(out / "summary.json", summary)
    run.finish()
    return summary


def _train_video(
    tok2d: VisionTokenizer,
    cfg: VisionTokenizerTrainConfig,
    out: Path,
    data: _TrainData,
    test_digits: np.ndarray | None,
    eval_sets: dict[str, np.ndarray],
    rng: random.Random,
    run: SideRun,
    steps_2d: int,
) -> dict[str, Any]:
    """Inflate, fine-tune on clips (plus single images) at full depth, save ``tokenizer_3d``; returns the
    summary entries."""
    size, n_bits = cfg.tokenizer.image_size, cfg.bits_schedule[-1][1]
    eval_clips = sample_clips(
        cfg.eval_clips, random.Random(cfg.seed + 2_000_003), cfg.video_frames, size, test_digits
    )
    tok3d = inflate(tok2d)
    result: dict[str, Any] = {"clips_2d": _evaluate(tok2d, {"clips": eval_clips}, [n_bits])}
    opt = make_adamw(
        param_groups(tok3d, cfg.optim.weight_decay, min_ndim=4), replace(cfg.optim, lr=cfg.video_lr)
    )
    state = {"tok2d": tok2d, "tok3d": tok3d, "opt": opt, "rng": rng}
    start = run.restore("3d", state)[0]
    t0 = time.perf_counter()
    for step in range(start, cfg.video_steps):
        x = clips_to_pixels(sample_clips(cfg.video_batch_size, rng, cfg.video_frames, size, data.digits))
        loss, terms, _, _ = _losses(tok3d, x, n_bits, cfg)
        if cfg.video_image_batch_size:
            image_loss, image_terms, _, _ = _losses(
                tok3d, images_to_pixels(data.images(cfg.video_image_batch_size, rng)), n_bits, cfg
            )
            loss = loss + image_loss
            terms["image_psnr"] = image_terms["train_psnr"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(tok3d.parameters(), cfg.optim.grad_clip or float("inf"))
        opt.step()
        if step % cfg.log_every == 0 or step == cfg.video_steps - 1:
            record = {"stage": "3d", "step": step, "lr": cfg.video_lr, "n_bits": n_bits, "loss": loss.item()}
            record.update(terms, grad_norm=float(grad_norm), elapsed_s=round(time.perf_counter() - t0, 2))
            append_jsonl(out / "metrics.jsonl", record)
        if step + 1 < cfg.video_steps:
            run.step_done("3d", step + 1, state, {"steps_2d": steps_2d})
    result["train_3d_s"] = round(time.perf_counter() - t0, 1)
    result["clips_3d"] = _evaluate(tok3d, {"clips": eval_clips}, [n_bits])
    result["tokenizer_3d_images"] = _evaluate(tok3d, eval_sets, [n_bits])
    tok3d.save(out / "tokenizer_3d", meta={"stage": "3d", "steps": cfg.video_steps, "seed": cfg.seed})
    return result
