"""Finding the data root and reporting missing files."""

from __future__ import annotations

from pathlib import Path

import pytest

from ernie5.data.root import DataMissing, require_file, resolve_data_dir


@pytest.mark.parametrize(
    ("explicit", "env", "expected"),
    [
        ("/data/a", "/data/b", Path("/data/a")),
        (Path("/data/a"), None, Path("/data/a")),
        (None, "/data/b", Path("/data/b")),
        (None, "", None),
        (None, None, None),
        ("", "/data/b", Path("/data/b")),
    ],
)
def test_resolve_data_dir(explicit, env, expected, monkeypatch):
    if env is None:
        monkeypatch.delenv("ERNIE5_DATA_DIR", raising=False)
    else:
        monkeypatch.setenv("ERNIE5_DATA_DIR", env)
    assert resolve_data_dir(explicit) == expected


def test_require_file(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("{}\n")
    assert require_file(tmp_path, "gsm8k/test.jsonl") == tmp_path / "gsm8k" / "test.jsonl"
    with pytest.raises(DataMissing) as info:
        require_file(tmp_path, "gsm8k/train.jsonl", "copy it from the GSM8K repo")
    message = str(info.value)
    assert "gsm8k/train.jsonl" in message and str(tmp_path) in message and "copy it from" in message
    assert "\n" not in message


def test_missing_root_names_the_environment_variable():
    with pytest.raises(DataMissing, match="ERNIE5_DATA_DIR"):
        require_file(None, "arc/ARC-Easy-test.jsonl")
