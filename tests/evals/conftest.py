"""Fixtures shared by the harness tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def micro_ckpt(tmp_path_factory) -> Path:
    """A micro checkpoint trained for 30 steps (text only), shared by the sweep tests."""
    from ernie5.config import load
    from ernie5.presets import resolve_config_path
    from train.common.run_folder import checkpoint_dirs
    from train.pretrain.config import RunConfig
    from train.pretrain.loop import pretrain

    run = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = load(RunConfig, resolve_config_path("micro"), ["train.steps=30", "data.tokenizer_chars=30000"])
    pretrain(cfg, run, quiet=True)
    return checkpoint_dirs(run)[-1]
