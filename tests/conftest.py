"""Shared fixtures: offline environment, tiny configs, deterministic torch state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(autouse=True)
def _torch_state():
    """Restore dtype, seed and thread count around every test."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)


@pytest.fixture
def data_dir() -> Path:
    """The shared real-data root (``$ERNIE5_DATA_DIR`` or ``../shared/data``); skips when absent."""
    root = Path(os.environ.get("ERNIE5_DATA_DIR", SHARED_DATA))
    if not root.is_dir():
        pytest.skip(f"data root {root} not present")
    return root


def tiny_config(**overrides):
    """A few-thousand-parameter model config for unit tests."""
    from ernie5.model.config import ModelConfig, MoEConfig

    moe = overrides.pop("moe", {})
    base = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=128)
    base.update(overrides)
    moe_kw = dict(n_experts=8, d_expert=16, top_k=2, n_shared_experts=1)
    moe_kw.update(moe)
    return ModelConfig(**base, moe=MoEConfig(**moe_kw))


@pytest.fixture
def tiny_cfg():
    """The default tiny config."""
    return tiny_config()
