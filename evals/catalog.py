"""The task catalog behind ``ernie5 tasks [--data-dir DIR] [--json]``: what is registered and runnable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import evals.tasks  # noqa: F401 - registers every task
from ernie5.data.root import resolve_data_dir
from evals.task import TASKS

_COLUMNS = ("name", "version", "modality", "capability", "metrics", "available")


def list_tasks(data_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """One row per registered task, sorted by name.

    Args:
        data_dir: the data root; None falls back to ``$ERNIE5_DATA_DIR``.

    Returns:
        Rows with ``name``, ``version``, ``modality``, ``capability``, ``metrics`` (primary first) and
        ``available``; unavailable tasks also have ``how_to_get``: one line naming the missing file and
        how to get it.
    """
    root = resolve_data_dir(data_dir)
    rows = []
    for name in TASKS.names():
        cls = TASKS.get(name)
        ok, reason = cls().available(root)
        row: dict[str, Any] = {
            "name": name,
            "version": cls.version,
            "modality": cls.modality,
            "capability": cls.capability,
            "metrics": list(cls.metrics),
            "available": ok,
        }
        if not ok:
            row["how_to_get"] = reason
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of :func:`list_tasks` rows, then one line per unavailable task."""
    cells = [
        [
            str(r["name"]),
            f"v{r['version']}",
            str(r["modality"]),
            str(r["capability"]),
            ",".join(r["metrics"]),
            "yes" if r["available"] else "no",
        ]
        for r in rows
    ]
    widths = [max(len(c[i]) for c in [list(_COLUMNS), *cells]) for i in range(len(_COLUMNS))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(_COLUMNS, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    missing = [r for r in rows if not r["available"]]
    if missing:
        lines.append("")
        lines += [f"{r['name']}: {r['how_to_get']}" for r in missing]
    return "\n".join(lines)
