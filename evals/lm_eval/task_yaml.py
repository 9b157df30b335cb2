"""A suite's lm-eval task folder read as data: task YAMLs with their ``include`` chains (lm-eval's tags kept
as strings), the tasks a folder defines, and the files that belong to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from evals.lm_eval.common import one_line

_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints"}


def all_local(tasks: Any, include_path: Any) -> bool:
    """Whether every name in ``--tasks`` is a task defined by a YAML under ``--include_path``."""
    if not tasks or not include_path:
        return False
    names = {t for item in ([tasks] if isinstance(tasks, str) else tasks) for t in str(item).split(",")}
    roots = [Path(p) for p in ([include_path] if isinstance(include_path, str) else include_path)]
    try:
        return names <= {t for r in roots if r.is_dir() for t in defined_tasks(r)}
    except ValueError:  # a YAML we cannot read: let lm-eval index everything and report it
        return False


class _Loader(yaml.SafeLoader):
    """Safe YAML loader that keeps lm-eval tags (``!function x``) as plain strings."""


_Loader.add_multi_constructor("!", lambda loader, tag, node: f"{tag} {getattr(node, 'value', '')}")


def load_yaml(path: Path) -> Any:
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"lm_eval: {path}: not readable YAML ({one_line(e)})") from None


def read_task_yaml(
    path: Path, seen: tuple[Path, ...] = (), root: Path | None = None
) -> tuple[dict, list[Path]]:
    """A task YAML merged over its ``include`` chain as lm-eval merges it, and the files read (task file
    first). With ``root`` (a suite's task folder), an include must be a file inside ``root``
    (ValueError otherwise); without it, includes that are not files are skipped."""
    cfg = load_yaml(path)
    cfg, files = (cfg if isinstance(cfg, dict) else {}), [path]
    inc = cfg.pop("include", None)
    merged: dict = {}
    for name in [inc] if isinstance(inc, str) else inc if isinstance(inc, list) else []:
        target = Path(name) if Path(str(name)).is_absolute() else path.parent / str(name)
        if root is not None:
            resolved = target.resolve()
            if not resolved.is_relative_to(root.resolve()) or not resolved.is_file():
                raise ValueError(
                    f"lm_eval: {path}: include {name!r} must be a file inside the task folder {root}"
                )
        if not target.is_file() or path in seen or target in (*seen, path):
            continue
        base, more = read_task_yaml(target, (*seen, path), root)
        base.pop("task_list", None)
        merged, files = {**merged, **base}, files + more
    return {**merged, **cfg}, files


def defined_tasks(root: Path, strict: bool = False) -> dict[str, Path]:
    """Task name -> YAML file, for the single-task YAMLs under ``root`` (``strict``: includes must stay
    inside ``root``)."""
    found: dict[str, Path] = {}
    for path in sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")]):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        task = read_task_yaml(path, root=root if strict else None)[0].get("task")
        if isinstance(task, str):
            found.setdefault(task, path)
    return found


def task_files(task_dir: Path) -> list[Path]:
    """Every file of a suite's task folder (what is copied into the run folder and fingerprinted); a file
    that resolves outside the folder (a symlink) is a ValueError."""
    root, files = task_dir.resolve(), []
    for f in sorted(task_dir.rglob("*")):
        if not f.is_file() or _SKIP_DIRS.intersection(f.relative_to(task_dir).parts):
            continue
        if not f.resolve().is_relative_to(root):
            raise ValueError(f"lm_eval: {f} resolves to {f.resolve()}, outside the task folder {root}")
        files.append(f)
    return files
