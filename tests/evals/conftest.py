"""Fixtures shared by the harness tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def micro_ckpt(tmp_path_factory) -> Path:
    """A micro checkpoint trained for 30 steps (text only), shared by the sweep tests."""
    from ernie5.config import load
    from ernie5.presets import resolve_config_path
    from ernie5.store.checkpoint import checkpoint_dirs
    from train.pretrain.config import RunConfig
    from train.pretrain.loop import pretrain

    run = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = load(RunConfig, resolve_config_path("micro"), ["train.steps=30", "data.tokenizer_chars=30000"])
    pretrain(cfg, run, quiet=True)
    return checkpoint_dirs(run)[-1]


def write_stand_in_digits(root: Path, n: int = 40) -> None:
    """Small files in the USPS (``usps/zip.test.gz``) and Semeion (``semeion/semeion.data``) layouts,
    for tests of the tasks that read them (the real ones are not in the shared data root)."""
    import gzip

    import numpy as np

    rng = np.random.default_rng(0)
    (root / "usps").mkdir(parents=True, exist_ok=True)
    (root / "semeion").mkdir(parents=True, exist_ok=True)
    usps, semeion = [], []
    for i in range(n):
        pix = (rng.random((16, 16)) < 0.3).astype(int)
        pix[2:14, 7] = 1
        usps.append(" ".join([str(i % 10), *(f"{2 * v - 1:.1f}" for v in pix.ravel())]))
        semeion.append(" ".join([*map(str, pix.ravel()), *("1" if d == i % 10 else "0" for d in range(10))]))
    with gzip.open(root / "usps" / "zip.test.gz", "wt") as f:
        f.write("\n".join(usps) + "\n")
    (root / "semeion" / "semeion.data").write_text("\n".join(semeion) + "\n")


@pytest.fixture(scope="session")
def task_data_root(data_root, tmp_path_factory) -> Path:
    """The real data root, with stand-ins for the optional digit collections it does not have."""
    root = tmp_path_factory.mktemp("task_root")
    for entry in data_root.iterdir():
        (root / entry.name).symlink_to(entry)
    if not (data_root / "usps").exists() or not (data_root / "semeion").exists():
        for name in ("usps", "semeion"):
            if (root / name).is_symlink():
                (root / name).unlink()
        write_stand_in_digits(root)
    return root
