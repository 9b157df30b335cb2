"""Skipped units grouped by why they were skipped: one row per reason instead of one per unit.

A sweep without a data root skips every data task on every subnet (144 units in the default
nightly); listed one by one, the few real causes drown. Units are grouped by their reason with the
unit's own task name taken out (``task {task} needs it``) and the how-to-get after ``; to get it:``
moved to its own column; a missing data file (``ernie5.data.root.DataMissing``: ``missing FILE
WHERE; to get it: HINT``) is grouped by where it was looked for and how to get it, so the tasks of
one dataset share a row whichever of its files each names. Failed units are not grouped: each
error is its own story.
"""

from __future__ import annotations

import re

import pandas as pd

GROUP_COLUMNS = ["reason", "tasks", "subnets", "units", "how_to_get"]
_MISSING = re.compile(
    r"^missing (?P<file>\S+) (?P<where>\(no data root[^)]*\)|under data root .+?)"
    r"(?:; to get it: (?P<hint>.*))?$"
)
_HINT = re.compile(r"; to get it: (?P<hint>.*)$")


def _key(reason: str, task: str) -> tuple[str, str, str]:
    """``(grouping reason, file named, how to get it)`` of one skipped unit."""
    m = _MISSING.match(reason)
    if m:
        return f"missing data {m['where']}", m["file"], m["hint"] or ""
    hint = _HINT.search(reason)
    text = reason[: hint.start()] if hint else reason
    if task:
        text = re.sub(rf"(?<![\w-]){re.escape(task)}(?![\w-])", "{task}", text)
    return text, "", hint["hint"] if hint else ""


def _subnets(names: list[str], every: list[str]) -> str:
    """``all N`` when ``names`` are all of the run's subnets, else the names in the run's order."""
    if set(names) == set(every):
        return f"all {len(every)}"
    return ", ".join(s for s in every if s in set(names))


def group_skips(units: pd.DataFrame, subnet_order: list[str] | None = None) -> pd.DataFrame:
    """One row per reason of the skipped units (:data:`GROUP_COLUMNS`), most units first.

    Args:
        units: the run's unit table (``subnet``, ``task``, ``status``, ``reason``).
        subnet_order: the order to list subnets in (default: as they appear).

    Returns:
        ``reason`` (with ``{task}`` for the task's own name, and the files named when data is
        missing), ``tasks``, ``subnets`` (``all N`` or the list), ``units`` (count), ``how_to_get``.
    """
    every = list(dict.fromkeys([*(subnet_order or []), *units["subnet"].astype(str)]))
    skipped = units[units["status"] == "skipped"]
    groups: dict[tuple[str, str], dict] = {}
    for subnet, task, reason in zip(skipped["subnet"], skipped["task"], skipped["reason"]):
        text, file, hint = _key(str(reason or "").strip(), str(task))
        g = groups.setdefault((text, hint), {"files": [], "tasks": [], "subnets": [], "units": 0})
        g["files"].append(file)
        g["tasks"].append(str(task))
        g["subnets"].append(str(subnet))
        g["units"] += 1
    rows = []
    for (text, hint), g in groups.items():
        files = [f for f in dict.fromkeys(g["files"]) if f]
        rows.append(
            {
                "reason": text + (f": {', '.join(files)}" if files else ""),
                "tasks": ", ".join(sorted(set(g["tasks"]))),
                "subnets": _subnets(g["subnets"], every),
                "units": g["units"],
                "how_to_get": hint,
            }
        )
    out = pd.DataFrame(rows, columns=GROUP_COLUMNS)
    return out.sort_values(["units", "reason"], ascending=[False, True], kind="stable").reset_index(drop=True)
