"""Supervised fine-tuning (``ernie5 sft``): the pretraining loop on instruction turns from a checkpoint.

The run config is built in layers: the ``sft`` preset (``ernie5/presets/sft.yaml``), then an optional
YAML file of overrides (each key of a section replaces the preset's value; a ``data.sources``
mapping replaces the whole mixture), then ``--set`` overrides; its ``model`` is the checkpoint's
model config and ``train.init_from`` the resolved checkpoint, whose weights, text tokenizer and frozen
media models start the run (:meth:`train.pretrain.loop.Trainer._init_from`). The run itself is
:func:`train.pretrain.loop.pretrain` with ``data.format: chat`` (:mod:`ernie5.sequence.chat`): same run
folder, checkpoints, ``metrics.jsonl`` and exact ``--resume`` contract as ``ernie5 train``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ernie5.config import ConfigError, apply_overrides, from_dict, read_yaml, to_dict
from ernie5.model.config import ModelConfig
from ernie5.presets import resolve_config_path
from ernie5.store.checkpoint import resolve_checkpoint
from train.pretrain.config import RunConfig
from train.pretrain.loop import pretrain

PRESET = "sft"


def _merge_sections(base: dict[str, Any], over: dict[str, Any], where: str) -> dict[str, Any]:
    """``base`` with each ``section.key`` of ``over`` replacing the preset's value."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in over.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: {section}: expected a mapping")
        out[section] = {**out.get(section, {}), **values}
    return out


def _reject_model_keys(config_data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> None:
    """The model is the checkpoint's: a ``model`` section or a ``model.*`` override is a ConfigError."""
    bad = ["model (in --config)"] if "model" in config_data else []
    bad += [s for s in overrides if s.split("=", 1)[0].strip().split(".")[0] == "model"]
    if bad:
        raise ConfigError(f"{bad[0]}: the model comes from the checkpoint and cannot be overridden")


def sft_config(
    checkpoint: str | Path, config: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """The run config of fine-tuning ``checkpoint`` (a checkpoint, a run folder or ``reference``).

    Raises:
        CheckpointError: ``checkpoint`` cannot be resolved or loaded.
        ConfigError: a bad ``config`` file or override (``model.*`` included).
    """
    path = resolve_checkpoint(checkpoint).resolve()
    model = from_dict(ModelConfig, read_yaml(path / "config.yaml"))  # the run loads the weights
    user = read_yaml(config) if config is not None else {}
    _reject_model_keys(user, overrides)
    data = _merge_sections(read_yaml(resolve_config_path(PRESET)), user, str(config))
    data["model"] = to_dict(model)
    data = apply_overrides(data, overrides)
    data.setdefault("train", {})["init_from"] = str(path)
    return from_dict(RunConfig, data)


def sft(
    checkpoint: str | Path,
    out: str | Path,
    *,
    config: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    resume: bool = False,
    data_dir: str | None = None,
    quiet: bool = False,
    log_with: Sequence[str] = (),
) -> dict:
    """Fine-tune ``checkpoint`` into the run folder ``out``; returns the last logged record
    (``log_with``: experiment trackers, as for :func:`train.pretrain.loop.pretrain`)."""
    cfg = sft_config(checkpoint, config, overrides)
    return pretrain(cfg, out, resume=resume, data_dir=data_dir, quiet=quiet, log_with=log_with)
