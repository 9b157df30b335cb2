"""Shipped checkpoints are found by name, before the file system, with a clear error when absent."""

from __future__ import annotations

import pytest

import ernie5.store.shipped as shipped
from ernie5.store.checkpoint import CheckpointError, resolve_checkpoint


def test_reference_names_the_package_folder():
    assert shipped.shipped_dir("reference").name == "reference"
    assert shipped.shipped_dir("reference").parent.name == "ernie5"
    assert shipped.is_shipped_name("reference") and not shipped.is_shipped_name("./reference")
    with pytest.raises(ValueError, match="unknown shipped checkpoint"):
        shipped.shipped_dir("nope")


def test_a_local_folder_called_reference_does_not_shadow_it(tmp_path, monkeypatch):
    fake = tmp_path / "pkg" / "reference"
    fake.mkdir(parents=True)
    (fake / "meta.json").write_text("{}")
    monkeypatch.setattr(shipped, "shipped_dir", lambda name: fake)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reference").mkdir()  # a run folder of the user's, named like the shipped model
    assert resolve_checkpoint("reference") == fake
    with pytest.raises(CheckpointError, match="not a checkpoint or a run folder"):
        resolve_checkpoint("./reference")  # the path form reaches the local folder


def test_a_missing_shipped_checkpoint_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setattr(shipped, "shipped_dir", lambda name: tmp_path / "absent")
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint("reference")
    msg = str(e.value)
    assert "missing from this install" in msg and "ernie5 recipe reference" in msg and "\n" not in msg
