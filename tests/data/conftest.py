"""Fixtures for the data tests: offline Hugging Face settings and the real data root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

DEFAULT_DATA_ROOT = Path("/work/shared/data")


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The real data root (``$ERNIE5_DATA_DIR`` or the shared copy); skips the test when absent."""
    root = Path(os.environ.get("ERNIE5_DATA_DIR") or DEFAULT_DATA_ROOT)
    if not root.is_dir():
        pytest.skip(f"no real data root at {root}")
    return root
