"""What every ``ernie5`` command shares: exit codes, the one-line user error, and argument helpers."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2
EXIT_EVAL_FAILED = 3
EXIT_DIVERGED = 4
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 143
EXIT_BROKEN_PIPE = 141
EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_REGRESSION: "`compare --fail-on-regression` found a significant regression",
    EXIT_BAD_INPUT: "bad input: an argument, config, suite, checkpoint, data root or --out that cannot be "
    "used, or a file that cannot be read or written (one line on stderr, nothing already written lost)",
    EXIT_EVAL_FAILED: "evaluation failed: `sweep` or `nightly` recorded at least one unit as an error "
    "(tables and report are still written; units.csv and units/ hold the messages)",
    EXIT_DIVERGED: "training diverged: `train`, `sft`, `recipe` or `rl` met a non-finite loss or gradient "
    "more often than `nonfinite` / `nonfinite_patience` allow (one line: the step, the quantity, the last "
    "good checkpoint; no checkpoint of non-finite weights is written)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_PREEMPTED: "preempted: `SIGTERM` (or a first Ctrl-C) stopped `train`, `sft`, `recipe`, `rl` or a "
    "`train-*` side trainer at a step boundary with a checkpoint (one line names it; `--resume`, or for "
    "`recipe` and `train-*` the same command, continues exactly), or `sweep` / `nightly` between units",
    EXIT_BROKEN_PIPE: "stdout was closed by its reader (e.g. `| head`)",
}
"""Every exit code of ``ernie5`` and what it means (the ``--help`` epilog and the README list them)."""


class CLIError(Exception):
    """A user error reported as one line with exit code 2."""


def check_out(out: str | Path, flag: str = "--out") -> Path:
    """``out`` as a Path if it can be a folder this process writes, else a :class:`CLIError` naming it:
    checked before any work, so that hours of training or evaluation do not end in a traceback."""
    p = Path(out)
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "exists and is not a folder" if probe == p else f"cannot be created: {probe} is not a folder"
        raise CLIError(f"{flag} {out}: {where}")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == p else f"cannot be created: {probe} is not writable"
        raise CLIError(f"{flag} {out}: {what}")
    return p


def load_run_config(config: str, overrides: list[str]):
    from ernie5.config import load
    from ernie5.presets import resolve_config_path
    from train.pretrain.config import RunConfig

    return load(RunConfig, resolve_config_path(config), overrides)


def load_model_config(args):
    """ModelConfig from --config (preset/file, `model:` section) or --checkpoint (config.yaml)."""
    from ernie5.config import ConfigError, apply_overrides, from_dict, read_yaml
    from ernie5.model.config import ModelConfig
    from ernie5.presets import resolve_config_path

    if args.checkpoint:
        from ernie5.store.checkpoint import resolve_checkpoint

        path = resolve_checkpoint(args.checkpoint)
        data = read_yaml(path / "config.yaml")
        return from_dict(ModelConfig, apply_overrides(data, args.set or [])), path
    data = read_yaml(resolve_config_path(args.config))
    model_data = data.get("model", {})
    if not isinstance(model_data, dict):
        raise ConfigError("model: expected a mapping")
    overrides = [s[len("model.") :] for s in (args.set or []) if s.startswith("model.")]
    bad = [s for s in (args.set or []) if not s.startswith("model.")]
    if bad:
        raise CLIError(f"--set {bad[0]!r}: only model.* keys apply to `params`")
    try:
        return from_dict(ModelConfig, apply_overrides(model_data, overrides)), None
    except ConfigError as e:
        raise ConfigError(f"model.{e}") from None


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


def with_device(args, key: str) -> list[str]:
    """The ``--set`` overrides, then ``--device`` as ``key=...`` (it wins over a ``--set`` of it)."""
    return [*(args.set or []), *([f"{key}={args.device}"] if args.device else [])]


def log_with_argument(parser: argparse.ArgumentParser) -> None:
    """``--log-with``: experiment trackers that mirror the run's records (ernie5.store.trackers)."""
    parser.add_argument(
        "--log-with",
        action="append",
        metavar="NAMES",
        help="also log to tensorboard, wandb or mlflow (comma-separated or repeated; written in the run "
        "folder, offline: no network call unless WANDB_MODE / MLFLOW_TRACKING_URI ask for one)",
    )


def eval_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device`` of the jobs that evaluate (``sweep``, ``nightly``): where the model runs."""
    from ernie5.runtime.distributed import DEVICES, parse_device

    def device(text: str) -> str:
        try:
            parse_device(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    parser.add_argument(
        "--device",
        type=device,
        default="auto",
        help=f"where the model runs: {DEVICES} (default auto: a GPU when there is one, else the CPU; "
        "under torchrun / accelerate launch, cuda is each process's own GPU)",
    )


def device_argument(parser: argparse.ArgumentParser, key: str) -> None:
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        help=f"where to train: auto (a GPU when there is one, else the CPU; the config's default), cpu or "
        f"cuda; the same as --set {key}=...",
    )
