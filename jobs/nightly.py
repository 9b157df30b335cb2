"""``ernie5 nightly``: the main job.

With no arguments, on a fresh machine with no data: train (or reuse cached) the small elastic
``mini`` model on the embedded default data (the seeded procedural tasks, plus real text when a data
root is found), then sweep ``suites/nightly.yaml`` over its sub-models into a run folder and write the
report (and, with ``--baseline``, the comparison with an earlier run). ``mini`` is text-only so
that the whole job stays within 10 minutes on 2 CPU cores; the suite's vision and audio tasks are
then recorded as skipped ("the checkpoint has no vision/audio"). ``--checkpoint`` with a multimodal
model (``nano_mm``, ``nano_all``) runs them. A preset with vision or audio enabled makes this module
train (and cache) a small vision tokenizer and audio codec first.

The trained model is cached under ``$ERNIE5_CACHE_DIR`` (default ``~/.cache/ernie5``) in a folder
named by a hash of its run config, the data sources it could open and the package version; a
later nightly with the same inputs reuses it, and an interrupted training resumes there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ernie5 import __version__
from ernie5.config import dump, load
from ernie5.data.root import resolve_data_dir
from ernie5.presets import resolve_config_path

NIGHTLY_PRESET = "mini"
"""The model the main job trains when no checkpoint is given."""


def cache_root() -> Path:
    """Where trained nightly models are cached."""
    return Path(os.environ.get("ERNIE5_CACHE_DIR", Path.home() / ".cache" / "ernie5"))


def _cached_folder(kind: str, prefix: str, key_parts: list) -> Path:
    """``cache_root()/kind/prefix-KEY``, KEY hashing ``key_parts`` and the project version."""
    key = hashlib.sha256(json.dumps([*key_parts, __version__]).encode()).hexdigest()[:12]
    return cache_root() / kind / f"{prefix}-{key}"


def _train_once(out: Path, sub: str, what: str, quiet: bool, train: Callable[[Path], object]) -> Path:
    """``out/sub`` if complete (its ``meta.json`` exists); else ``train(tmp)`` and rename ``tmp`` to
    ``out``, so the folder is complete or absent and an interrupted training is redone."""
    if (out / sub / "meta.json").is_file():
        return out / sub
    if not quiet:
        print(f"nightly: training the {what} into {out}", file=sys.stderr)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    train(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out / sub


NIGHTLY_TOKENIZER_STEPS = 500
"""2D steps of the nightly vision tokenizer (~1 CPU minute; the full recipe runs 2000)."""
NIGHTLY_TOKENIZER_VIDEO_STEPS = 20


def ensure_vision_tokenizer(data_dir: Path | None, quiet: bool = False) -> Path:
    """The nightly's frozen vision tokenizer (3D), cached like the model."""
    from train.vision_tokenizer import VisionTokenizerTrainConfig, train_vision_tokenizer

    cfg = load(
        VisionTokenizerTrainConfig,
        None,
        [
            f"steps={NIGHTLY_TOKENIZER_STEPS}",
            f"video_steps={NIGHTLY_TOKENIZER_VIDEO_STEPS}",
            "eval_images=100",
            "eval_clips=16",
        ],
    )
    has_mnist = data_dir is not None and (Path(data_dir) / "mnist").is_dir()
    out = _cached_folder("tokenizers", "vision", [dump(cfg), has_mnist])
    return _train_once(
        out, "tokenizer_3d", "vision tokenizer", quiet, lambda tmp: train_vision_tokenizer(cfg, tmp, data_dir)
    )


NIGHTLY_CODEC_STEPS = 3000
"""Steps of the nightly audio codec (~4 CPU minutes; DTMF round trips need about this many)."""


def ensure_audio_codec(data_dir: Path | None, quiet: bool = False) -> Path:
    """The nightly's frozen audio codec, cached like the model (DTMF always; FSDD when present)."""
    from train.audio_codec import AudioCodecTrainConfig, train_audio_codec

    cfg = load(AudioCodecTrainConfig, None, [f"steps={NIGHTLY_CODEC_STEPS}"])
    has_fsdd = data_dir is not None and (Path(data_dir) / "fsdd").is_dir()
    out = _cached_folder("codecs", "audio", [dump(cfg), has_fsdd])
    return _train_once(out, "codec", "audio codec", quiet, lambda tmp: train_audio_codec(cfg, tmp, data_dir))


def ensure_model(data_dir: Path | None, quiet: bool = False) -> Path:
    """A trained nightly model: the cached one for these inputs, or a freshly trained one."""
    from train.config import RunConfig
    from train.data import open_sources
    from train.loop import checkpoint_dirs, pretrain

    overrides = []
    base = load(RunConfig, resolve_config_path(NIGHTLY_PRESET))
    if base.model.vision.enabled:
        overrides.append(f"data.vision_tokenizer={ensure_vision_tokenizer(data_dir, quiet)}")
    if base.model.audio.enabled:
        overrides.append(f"data.audio_codec={ensure_audio_codec(data_dir, quiet)}")
    cfg = load(RunConfig, resolve_config_path(NIGHTLY_PRESET), overrides)
    sources = open_sources(cfg.data, data_dir, cfg.model.vision.image_size)
    run = _cached_folder("models", NIGHTLY_PRESET, [dump(cfg), sources.names])
    done = [c for c in checkpoint_dirs(run) if c.name == f"step_{cfg.train.steps:08d}"]
    if done:
        if not quiet:
            print(f"nightly: reusing the cached model {done[0]}", file=sys.stderr)
        return done[0]
    if not quiet:
        print(
            f"nightly: training the {NIGHTLY_PRESET} model into {run} (sources: {', '.join(sources.names)})",
            file=sys.stderr,
        )
    pretrain(
        cfg,
        run,
        resume=(run / "config.yaml").exists(),
        data_dir=str(data_dir) if data_dir else None,
        quiet=quiet,
    )
    return checkpoint_dirs(run)[-1]


def run_nightly(
    checkpoint: str | Path | None = None,
    suite: str = "nightly",
    data_dir: str | Path | None = None,
    out: str | Path | None = None,
    baseline: str | Path | None = None,
    quiet: bool = False,
    confirm_run_unsafe_code: bool = False,
) -> dict:
    """Run the main job; returns its summary (also written to ``RUN_DIR/nightly.json``).

    ``failed_units`` lists the sweep's units recorded as errors (``subnet/task: reason``); the report
    is written either way. ``confirm_run_unsafe_code`` is passed to :func:`evals.sweep.run_sweep`.
    """
    from evals.sweep import run_sweep

    t0 = time.perf_counter()
    data_dir = resolve_data_dir(data_dir)
    out = Path(out or Path("runs") / f"nightly-{time.strftime('%Y%m%d-%H%M%S')}")
    if checkpoint is None:
        checkpoint = ensure_model(data_dir, quiet)
    t_model = time.perf_counter() - t0
    summary = run_sweep(
        checkpoint,
        suite,
        out,
        data_dir=data_dir,
        quiet=quiet,
        argv=sys.argv,
        confirm_run_unsafe_code=confirm_run_unsafe_code,
    )
    result = {
        "run_dir": str(out),
        "checkpoint": str(checkpoint),
        "data_dir": str(data_dir) if data_dir else None,
        "model_s": round(t_model, 1),
        "sweep_s": round(time.perf_counter() - t0 - t_model, 1),
        "units": summary.n_units,
        "computed": summary.computed,
        "reused": summary.reused,
        "skipped": summary.skipped,
        "errors": summary.errors,
        "failed_units": summary.failed,
        "harness_overhead_share": round(summary.overhead_share, 4),
    }
    from reports import build_report, compare_runs

    result["report"] = str(build_report(out))
    if baseline is not None:
        cmp = compare_runs(baseline, out)
        result["comparison"] = str(cmp.out_dir)
        result["regression"] = cmp.has_regression
    result["total_s"] = round(time.perf_counter() - t0, 1)
    (out / "nightly.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result
