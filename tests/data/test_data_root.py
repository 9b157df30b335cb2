"""Finding the data root and reporting missing files."""

from __future__ import annotations

from pathlib import Path

import pytest

from ernie5.data.root import DataDirError, DataMissing, require_file, resolve_data_dir


@pytest.mark.parametrize(
    ("explicit", "env", "expected"),
    [
        ("a", "b", "a"),
        (Path("a"), None, "a"),
        (None, "b", "b"),
        (None, "", None),
        (None, None, None),
        ("", "b", "b"),
    ],
)
def test_resolve_data_dir(explicit, env, expected, monkeypatch, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    if env is None:
        monkeypatch.delenv("ERNIE5_DATA_DIR", raising=False)
    else:
        monkeypatch.setenv("ERNIE5_DATA_DIR", str(tmp_path / env) if env else "")
    explicit = tmp_path / explicit if explicit else explicit
    assert resolve_data_dir(explicit) == (tmp_path / expected if expected else None)


@pytest.mark.parametrize(("given", "what"), [("missing", "does not exist"), ("file", "is not a folder")])
@pytest.mark.parametrize("via", ["argument", "environment"])
def test_a_data_root_that_is_not_a_folder_is_an_error(given, what, via, monkeypatch, tmp_path):
    """Never taken for "no data": every data task would be skipped and the run would look fine."""
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "good").mkdir()
    root = tmp_path / given
    if via == "argument":
        monkeypatch.setenv("ERNIE5_DATA_DIR", str(tmp_path / "good"))  # the argument wins, and is checked
        with pytest.raises(DataDirError) as info:
            resolve_data_dir(root)
        source = "--data-dir"
    else:
        monkeypatch.setenv("ERNIE5_DATA_DIR", str(root))
        with pytest.raises(DataDirError) as info:
            resolve_data_dir(None)
        source = "$ERNIE5_DATA_DIR"
    message = str(info.value)
    assert message.startswith(f"{source} {str(root)!r} {what}") and "expected the data root folder" in message
    assert "\n" not in message


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
