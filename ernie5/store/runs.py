"""Run-folder provenance shared by training and evaluation runs.

Helpers here write ``meta.json`` (git hash and dirty flag, package versions, machine, argv, seed),
append JSON lines atomically enough for crash safety (one ``write`` per record, a torn last line is
ignored by :func:`read_jsonl`), and write small files atomically (temp file + ``os.replace``).
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from ernie5.files import write_failure

PACKAGES = ("torch", "numpy", "safetensors", "tokenizers", "lm_eval", "datasets", "accelerate", "pandas")


def git_info(cwd: str | Path | None = None) -> dict[str, Any]:
    """``{"git_hash": ..., "git_dirty": ...}`` of the source tree this package runs from."""
    where = Path(cwd) if cwd else Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        return {"git_hash": out, "git_dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"git_hash": "unknown", "git_dirty": None}


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that change results."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def machine_info() -> dict[str, Any]:
    """CPU, core count and torch thread count."""
    import torch

    from ernie5.kernels import attention_status
    from ernie5.kernels import status as kernels_status

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "kernels": kernels_status(),
        "attention": attention_status(),
    }


def provenance(seed: int | None = None, argv: list[str] | None = None) -> dict[str, Any]:
    """Everything ``meta.json`` records about how a run was made."""
    return {
        **git_info(),
        "versions": package_versions(),
        "machine": machine_info(),
        "seed": seed,
        "argv": list(sys.argv if argv is None else argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``path`` via a temp file and ``os.replace``: readers see the old or the new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    mode = "wb" if isinstance(data, bytes) else "w"
    try:
        with open(tmp, mode, **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # no partial file left, and the space back
        failed = write_failure(e, path, path.name)
        if failed is not None:
            raise failed from None
        raise


def write_json(path: str | Path, obj: Any) -> None:
    """Atomic JSON write (sorted keys, indented)."""
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON record as a single write; the file is flushed to the OS."""
    line = json.dumps(record, sort_keys=True, default=float) + "\n"
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
    except OSError as e:
        failed = write_failure(e, path, Path(path).name)
        if failed is None:
            raise
        raise failed from None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a JSON-lines file (a torn or malformed line is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def rewrite_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
    """Atomically replace a JSON-lines file with ``records``."""
    text = "".join(json.dumps(r, sort_keys=True, default=float) + "\n" for r in records)
    write_atomic(path, text)


# ---------------------------------------------------------------------------- one writer at a time
LOCK_FILE = ".lock"
"""The file a run folder's writer holds locked (:class:`RunLock`)."""


class RunLocked(Exception):
    """Another process holds the run folder's lock. The message is one line."""


class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/.lock``, held while a sweep, a training run (train, sft,
    recipe's stages) or an RL run writes the folder.

    The lock belongs to the open file, so it is released when the process ends, however it ends; the
    file itself stays (deleting it would let two processes lock two different files).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            by = f" by process {holder}" if holder.isdigit() else ""
            raise RunLocked(
                f"{self.path.parent} is being written{by} (another process holds {self.path}); "
                "wait for it to finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd: int | None = fd

    def release(self) -> None:
        """Unlock (idempotent)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
