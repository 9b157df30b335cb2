"""The ``dataset`` task option: read a task's items through ``datasets`` from a local mirror or a cached
Hugging Face Hub dataset instead of the files under the data root.

Usage, in a suite::

    tasks:
      - {task: arc_easy, kwargs: {dataset: {path: allenai/ai2_arc, name: ARC-Easy, split: test}}}
      - {task: gsm8k, kwargs: {dataset: {path: /data/mirrors/gsm8k}}}

``dataset`` is a mapping with the fields of :class:`DatasetSpec`: ``path`` (a hub dataset id, or a
local folder, absolute or relative to the working directory), ``name`` (the config, e.g.
``ARC-Easy``; "" for none), ``split`` (the evaluated split; "" for the task's own, e.g. ``test``) and
``revision`` (a full commit sha a hub dataset must be cached at; "" for whichever is cached). Without
it (the default) a task reads the data root exactly as before, and its ``kwargs`` (hence the sweep's
unit fingerprints) have no ``dataset`` key.

Where the rows come from (:func:`load_rows`):

* a folder written by ``save_to_disk``: :func:`datasets.load_from_disk`. A ``DatasetDict`` gives its
  splits by name; a single ``Dataset`` is the split it was saved as, or, when it has no split name
  (``Dataset.from_list``), the evaluated split only (so a few-shot pool must be a ``DatasetDict``
  split);
* any other folder: ``datasets.load_dataset(path, name, split=...)``, which infers the builder
  (json/jsonl, parquet, csv, ...) and the splits from the file names (``test.jsonl``,
  ``data/test-00000-of-00001.parquet``: the layout of a hub snapshot). The builder's cache is keyed by
  the sha256 of the folder's files, so an edited mirror is never served stale;
* anything else is a hub dataset id, loaded with ``datasets.load_dataset(path, name, split=...)``
  from the ``datasets`` cache only (``HF_DATASETS_CACHE``).

Nothing is downloaded, whatever ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` say: every load runs in
``datasets``' offline mode, so a hub dataset that is not cached makes :meth:`DatasetOption.available`
answer ``(False, reason)``, the reason saying how to get it (run the ``load_dataset`` call once
online, or point ``path`` at a local folder). The rows then go through the task's row parser
(:mod:`ernie5.data.text`), whose :class:`~ernie5.data.text.DataCorrupt` names the dataset and the row
(``<path> (<name>, <split>):<row>: what``, rows numbered from 1).

Fingerprint (:func:`fingerprint`): sha256 over the spec, the splits read and the content: for a local
folder the names and bytes of its files (hidden ones skipped, as ``datasets`` skips them); for a hub
dataset each split's ``Dataset._fingerprint`` (a hash of its cache folder, which names the dataset
commit) and row count, so a re-cached newer commit never reuses stale results.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ernie5.config import ConfigError, from_dict
from ernie5.data.text import DataCorrupt
from ernie5.files import hash_file_into
from ernie5.runtime.packages import missing_reason

if TYPE_CHECKING:
    import datasets

T = TypeVar("T")

_SPLIT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_SHA = re.compile(r"[0-9a-f]{40}")
_SAVED = ("dataset_dict.json", "state.json")
"""Files ``save_to_disk`` writes at the top of a ``DatasetDict`` / ``Dataset`` folder."""


class DatasetUnavailable(Exception):
    """A ``dataset`` option names data that is not on this machine. The message is one line."""


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """Where a task reads its rows from: a hub dataset id or a local folder (see the module docstring)."""

    path: str
    """Hub dataset id (``allenai/ai2_arc``) or local folder (absolute, or relative to the working
    directory)."""
    name: str = ""
    """Dataset config (``ARC-Easy``, ``main``); "" for the default."""
    split: str = ""
    """Evaluated split; "" for the task's own (``test``)."""
    revision: str = ""
    """Full commit sha the cached hub dataset must be at (the most recently cached one is read and
    checked); "" for whichever is cached."""

    def __post_init__(self) -> None:
        if not self.path or self.path != self.path.strip():
            raise ValueError(f"path={self.path!r} must be a non-empty hub id or folder")
        if self.split and not _SPLIT.fullmatch(self.split):
            raise ValueError(f"split={self.split!r} must be a split name (no slicing; use the limit)")
        if self.revision and not _SHA.fullmatch(self.revision):
            raise ValueError(
                f"revision={self.revision!r} must be a full 40-hex commit sha (offline loads cannot "
                "resolve branches or tags)"
            )

    def label(self, split: str) -> str:
        """``<path> (<name>, <split>)``: how errors name this dataset split."""
        return f"{self.path} ({', '.join(p for p in (self.name, split) if p)})"


def as_spec(value: Any) -> DatasetSpec | None:
    """A ``dataset`` option value (None, a mapping of :class:`DatasetSpec` fields, or a spec) as a spec.

    Raises:
        ValueError: a one-line error naming the bad or unknown field.
    """
    if value is None or isinstance(value, DatasetSpec):
        return value
    if not isinstance(value, dict) or "path" not in value:
        raise ValueError(f"dataset: expected a mapping with a path (and name, split, revision): {value!r}")
    try:
        return from_dict(DatasetSpec, value)
    except ConfigError as e:
        raise ValueError(f"dataset: {e}") from None


# Loading ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _offline_and_quiet() -> Iterator[None]:
    """Run ``datasets`` offline (no request leaves the machine) without progress bars or warnings."""
    import datasets
    import huggingface_hub.constants as hub_constants

    switches = [
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),
        (hub_constants, "HF_HUB_OFFLINE"),
    ]
    saved = [getattr(module, name) for module, name in switches]
    bars_were_off, verbosity = datasets.are_progress_bars_disabled(), datasets.logging.get_verbosity()
    for module, name in switches:
        setattr(module, name, True)
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.ERROR)
    try:
        yield
    finally:
        for (module, name), value in zip(switches, saved, strict=True):
            setattr(module, name, value)
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.enable_progress_bars()


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def local_folder(spec: DatasetSpec) -> Path | None:
    """The local folder ``spec.path`` names, or None for a hub id.

    Raises:
        DatasetUnavailable: ``path`` looks like a filesystem path but is not a folder.
    """
    folder = Path(spec.path).expanduser()
    if folder.is_dir():
        return folder
    looks_local = os.path.isabs(spec.path) or spec.path.startswith((".", "~")) or spec.path.count("/") > 1
    if looks_local or folder.exists():
        raise DatasetUnavailable(f"dataset {spec.path}: not a folder (relative paths are from {Path.cwd()})")
    return None


def folder_digest(folder: Path) -> str:
    """sha256 over the relative names and bytes of the files under ``folder`` (hidden ones skipped)."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        hash_file_into(digest, rel.as_posix(), path)
    return digest.hexdigest()


def _from_saved(folder: Path, spec: DatasetSpec, split: str) -> datasets.Dataset:
    import datasets

    if spec.name or spec.revision:
        raise DatasetUnavailable(
            f"dataset {spec.path}: a save_to_disk folder has no configs or revisions; drop name/revision"
        )
    saved = datasets.load_from_disk(str(folder))
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DatasetUnavailable(f"dataset {spec.label(split)}: no such split (has {', '.join(saved)})")
        return saved[split]
    if saved.split is not None and str(saved.split) != split:
        raise DatasetUnavailable(f"dataset {spec.label(split)}: the folder holds split {saved.split!s} only")
    if saved.split is None and split != spec.split:
        raise DatasetUnavailable(
            f"dataset {spec.label(split)}: the folder holds one unnamed split, read as {spec.split!r}; "
            f"save a DatasetDict with a {split!r} split"
        )
    return saved


def _from_files(folder: Path, spec: DatasetSpec, split: str) -> datasets.Dataset:
    import datasets

    if spec.revision:
        raise DatasetUnavailable(f"dataset {spec.path}: revision applies to hub ids, not local folders")
    try:
        return datasets.load_dataset(
            str(folder),
            spec.name or None,
            split=split,
            description=f"ernie5 sha256={folder_digest(folder)}",  # content, not mtime, keys the cache
        )
    except datasets.exceptions.DatasetGenerationError as e:
        cause = _one_line(e.__cause__) if e.__cause__ is not None else _one_line(e)
        raise DataCorrupt(Path(spec.label(split)), None, f"the files do not load ({cause})") from None


def _how_to_get(spec: DatasetSpec, split: str) -> str:
    args = ", ".join(
        [repr(spec.path)]
        + ([repr(spec.name)] if spec.name else [])
        + [f"split={split!r}"]
        + ([f"revision={spec.revision!r}"] if spec.revision else [])
    )
    return (
        f'run once online: python -c "import datasets; datasets.load_dataset({args})", '
        "or point dataset.path at a local folder (save_to_disk, or json/jsonl/parquet files)"
    )


def _from_hub(spec: DatasetSpec, split: str) -> datasets.Dataset:
    import datasets

    try:
        ds = datasets.load_dataset(spec.path, spec.name or None, split=split, revision=spec.revision or None)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        detail = "" if isinstance(e, ConnectionError) else f" ({_one_line(e)})"  # else: not cached at all
        raise DatasetUnavailable(
            f"dataset {spec.label(split)} is not in the datasets cache{detail}; "
            f"to get it: {_how_to_get(spec, split)}"
        ) from None
    cached_at = Path(ds.cache_files[0]["filename"]).parent.name if ds.cache_files else ""
    if spec.revision and cached_at != spec.revision:
        raise DatasetUnavailable(
            f"dataset {spec.label(split)} is cached at {cached_at or 'an unknown commit'}, not revision "
            f"{spec.revision}; to get it: {_how_to_get(spec, split)}"
        )
    return ds


def load_rows(spec: DatasetSpec, split: str | None = None) -> datasets.Dataset:
    """The rows of ``split`` (default ``spec.split``, which the task has filled in) of the dataset.

    Raises:
        DatasetUnavailable: not on this machine (not cached, no such folder, config or split).
        DataCorrupt: a local folder's files do not load.
    """
    split = split or spec.split
    if not split:
        raise ValueError(f"dataset {spec.path}: no split given")
    with _offline_and_quiet():
        folder = local_folder(spec)
        if folder is None:
            return _from_hub(spec, split)
        read = _from_saved if any((folder / name).is_file() for name in _SAVED) else _from_files
        try:
            return read(folder, spec, split)
        except DataCorrupt:
            raise
        except (OSError, ValueError, KeyError) as e:  # no such config or split, unreadable folder
            raise DatasetUnavailable(f"dataset {spec.label(split)}: {_one_line(e)}") from None


def parse_rows(spec: DatasetSpec, split: str, parse: Callable[[datasets.Dataset, str], list[T]]) -> list[T]:
    """``parse(rows, where)`` over the rows of ``split``; ``where`` names the dataset in row errors."""
    return parse(load_rows(spec, split), spec.label(split))


def available(spec: DatasetSpec, splits: tuple[str, ...]) -> tuple[bool, str]:
    """``(True, "")`` if every split loads, else ``(False, one-line reason)``. A split whose files are
    corrupt counts as available: evaluating it raises the :class:`DataCorrupt` (an error, not a skip).
    Without the ``datasets`` package the reason says so."""
    if why := missing_reason("datasets"):
        return False, f"dataset {spec.path}: {why}"
    for split in splits:
        try:
            load_rows(spec, split)
        except DatasetUnavailable as e:
            return False, str(e)
        except DataCorrupt:
            return True, ""
    return True, ""


def fingerprint(spec: DatasetSpec, splits: tuple[str, ...]) -> str:
    """sha256 over the spec, the splits and the content (see the module docstring)."""
    digest = hashlib.sha256(repr((spec, splits)).encode("utf-8"))
    with _offline_and_quiet():
        folder = local_folder(spec)
    if folder is not None:
        digest.update(folder_digest(folder).encode("ascii"))
        return digest.hexdigest()
    for split in splits:
        ds = load_rows(spec, split)
        digest.update(f"{split}\0{ds._fingerprint}\0{ds.num_rows}\0".encode())
    return digest.hexdigest()


# The task side ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DatasetOptions:
    """Options of a task whose only option is ``dataset``."""

    dataset: Any = None
    """None (the data root), or a mapping of :class:`DatasetSpec` fields; held as a spec."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dataset", as_spec(self.dataset))


class DatasetOption:
    """Mixin (before the :class:`~evals.task.Task` base) for a task with a ``dataset`` option.

    With ``dataset`` unset every method is the base task's, and ``kwargs`` has no ``dataset`` key,
    so unit fingerprints are those of a task without the option."""

    options: Any
    splits: tuple[str, ...]

    @property
    def dataset(self) -> DatasetSpec | None:
        """The spec with its split filled in (the task's evaluated split by default), or None."""
        spec = self.options.dataset
        return None if spec is None else replace(spec, split=spec.split or self.splits[0])

    def dataset_splits(self) -> tuple[str, ...]:
        """The splits of ``dataset`` the task reads, the evaluated one first."""
        spec = self.dataset
        return () if spec is None else (spec.split,)

    @property
    def kwargs(self) -> dict[str, Any]:
        out = super().kwargs  # type: ignore[misc]
        if "dataset" in out and out["dataset"] is None:
            del out["dataset"]
        return out

    def available(self, data_dir: str | Path | None) -> tuple[bool, str]:
        spec = self.dataset
        if spec is None:
            return super().available(data_dir)  # type: ignore[misc]
        return available(spec, self.dataset_splits())

    def fingerprint_data(self, data_dir: str | Path | None) -> str:
        spec = self.dataset
        if spec is None:
            return super().fingerprint_data(data_dir)  # type: ignore[misc]
        return fingerprint(spec, self.dataset_splits())
