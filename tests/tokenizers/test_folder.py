"""Side-model folders: sha256 manifest checked on load, fsync, atomic publish that never deletes the old
folder before the new one is in place, cleanup of an interrupted save's leftovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from ernie5.tokenizers import folder
from ernie5.tokenizers.audio_teacher import MFCCKMeansTeacher, load_teacher
from ernie5.tokenizers.folder import CONFIG_FILE, META_FILE, load_module, save_module

VERSION = "tiny-side-model/1"
WEIGHTS = "tiny.safetensors"


@dataclass(frozen=True)
class TinyCfg:
    width: int = 3


class Tiny(nn.Module):
    def __init__(self, cfg: TinyCfg) -> None:
        super().__init__()
        self.lin = nn.Linear(cfg.width, cfg.width)


class TinyError(ValueError):
    """The caller's error type."""


def _save(path: Path, seed: int = 0, meta: dict | None = None) -> Tiny:
    torch.manual_seed(seed)
    module = Tiny(TinyCfg())
    save_module(path, module, TinyCfg(), VERSION, WEIGHTS, meta)
    return module


def _load(path: Path) -> Tiny:
    return load_module(path, Tiny, TinyCfg, VERSION, WEIGHTS, TinyError, "tiny model")


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].equal(sb[k]) for k in sa)


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(proc.stdout)


def test_the_manifest_lists_every_file(tmp_path):
    path = tmp_path / "m"
    module = _save(path)
    meta = json.loads((path / META_FILE).read_text())
    assert set(meta["files"]) == {WEIGHTS, CONFIG_FILE}
    assert meta["files"][WEIGHTS]["bytes"] == (path / WEIGHTS).stat().st_size
    assert _same(_load(path), module)


def test_flipped_or_changed_bytes_are_an_error_naming_the_file(tmp_path):
    path = tmp_path / "m"
    _save(path)
    data = bytearray((path / WEIGHTS).read_bytes())
    data[-1] ^= 0x01  # a flipped bit in the last weight: still a valid safetensors file
    (path / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(TinyError, match=rf"{WEIGHTS}: sha256 differs from meta.json") as err:
        _load(path)
    assert "\n" not in str(err.value)

    _save(path)
    with (path / CONFIG_FILE).open("a") as f:
        f.write("# edited\n")
    with pytest.raises(TinyError, match=rf"{CONFIG_FILE}: \d+ bytes, meta.json says \d+"):
        _load(path)


def test_a_folder_saved_before_manifests_still_loads(tmp_path):
    path = tmp_path / "m"
    module = _save(path, meta={"note": "old"})
    meta = json.loads((path / META_FILE).read_text())
    del meta["files"]
    (path / META_FILE).write_text(json.dumps(meta))
    assert _same(_load(path), module)


def test_a_file_missing_from_the_manifest_is_an_error(tmp_path):
    path = tmp_path / "m"
    _save(path)
    meta = json.loads((path / META_FILE).read_text())
    del meta["files"][CONFIG_FILE]
    (path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(TinyError, match=f"{CONFIG_FILE} is not in the file manifest"):
        _load(path)


def test_files_is_a_reserved_metadata_key(tmp_path):
    with pytest.raises(ValueError, match="'files' is reserved"):
        _save(tmp_path / "m", meta={"files": []})
    assert not (tmp_path / "m").exists()


def test_the_old_folder_is_never_deleted_before_the_new_one_is_in_place(tmp_path, monkeypatch):
    path = tmp_path / "m"
    old_module = _save(path, seed=0)
    real_replace, seen = os.replace, []

    def failing_publish(src, dst):
        if ".tmp-" in Path(src).name:  # the new folder's rename into place fails (disk full, crash...)
            seen.append([p.name for p in tmp_path.iterdir()])
            raise OSError("simulated failure while publishing")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_publish)
    with pytest.raises(OSError, match="simulated"):
        _save(path, seed=1)
    monkeypatch.undo()
    assert seen and any(name.startswith(".m.old-") for name in seen[0])  # moved aside, not deleted
    assert _same(_load(path), old_module)  # put back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]

    new_module = _save(path, seed=1)
    assert _same(_load(path), new_module) and not _same(new_module, old_module)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_the_next_save_cleans_up_an_interrupted_save(tmp_path):
    pid = _dead_pid()
    _save(tmp_path / "m")
    for kind in ("old", "tmp"):  # a save killed between its two renames leaves both
        (tmp_path / f".m.{kind}-{pid}").mkdir()
        (tmp_path / f".m.{kind}-{pid}" / WEIGHTS).write_bytes(b"leftover")
    live = tmp_path / f".m.tmp-{os.getppid()}"  # a save still running in a live process is left alone
    live.mkdir()
    _save(tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "m"]


def test_loading_after_a_crash_between_the_renames_names_the_leftover(tmp_path):
    pid = _dead_pid()
    module = _save(tmp_path / "staging")
    os.replace(tmp_path / "staging", tmp_path / f".m.old-{pid}")
    with pytest.raises(TinyError, match=rf"m: missing meta.json .*interrupted save left .*\.m\.old-{pid}"):
        _load(tmp_path / "m")
    assert _same(_load(tmp_path / f".m.old-{pid}"), module)  # the complete folder is still there


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name fsynced descriptors")
def test_save_fsyncs_every_file_the_folder_and_its_parent(tmp_path, monkeypatch):
    real_fsync, synced = os.fsync, []

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    _save(tmp_path / "m")
    names = {Path(p).name for p in synced}
    assert {WEIGHTS, CONFIG_FILE, META_FILE} <= names
    assert any(Path(p).name.startswith(".m.tmp-") for p in synced)  # the folder before publishing
    assert str(tmp_path.resolve()) in synced  # the parent after the rename


def test_teacher_state_is_checked_against_its_manifest(tmp_path):
    torch.manual_seed(0)
    teacher = MFCCKMeansTeacher(n_clusters=4, n_mfcc=2, n_mels=8).fit(torch.randn(32, 6))
    path = teacher.save(tmp_path / "teacher")
    body = json.loads((path / "teacher.json").read_text())
    assert set(body["files"]) == {"teacher.safetensors"}
    assert load_teacher(path).centroids_KD.equal(teacher.centroids_KD)

    legacy = {k: v for k, v in body.items() if k != "files"}  # written before manifests: still loads
    (path / "teacher.json").write_text(json.dumps(legacy))
    assert load_teacher(path).centroids_KD.equal(teacher.centroids_KD)

    (path / "teacher.json").write_text(json.dumps(body))
    data = bytearray((path / "teacher.safetensors").read_bytes())
    data[-1] ^= 0x01
    (path / "teacher.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"teacher\.safetensors: sha256 differs from teacher\.json"):
        load_teacher(path)


def test_the_manifest_covers_files_in_subfolders(tmp_path):
    def write(tmp: Path) -> None:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.bin").write_bytes(b"abc")

    path = folder.write_folder_atomic(tmp_path / "f", write, {"version": "x/1"}, index_file="index.json")
    index = json.loads((path / "index.json").read_text())
    assert index["version"] == "x/1" and set(index["files"]) == {"sub/a.bin"}
    folder.verify_files(path, index, "index.json", ["sub/a.bin"], TinyError)
    (path / "sub" / "a.bin").write_bytes(b"abd")
    with pytest.raises(TinyError, match=r"a\.bin: sha256 differs from index\.json"):
        folder.verify_files(path, index, "index.json", ["sub/a.bin"], TinyError)
