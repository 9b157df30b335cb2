"""The run-folder contract of a sweep: what ``ernie5 sweep`` writes and ``reports/`` reads.

Layout of ``RUN_DIR``::

    manifest.json                  how the run was made (see MANIFEST_KEYS)
    units/<subnet>/<task>.json     one record per evaluated (subnet, task) unit (see UNIT_KEYS);
                                   units/random/<task>.json when the suite asks for the random baseline
    samples/<subnet>/<task>.jsonl  per example: {"id", "scores": {metric: value}, "sample": {...}}
    results.csv, results.parquet   one row per (subnet, task, metric) of the ``ok`` units (RESULT_COLUMNS)
    units.csv                      one row per unit: subnet, task, status, reason, wall_s, model_s
    efficiency.csv, efficiency.json  one row per subnet (EFFICIENCY_COLUMNS)
    routing/<subnet>.json          expert loads: {"n_experts", "layers": [...],
                                   "tasks": {task: {"modality", "counts": {layer: [count per expert]}}}}
    report/                        written by ``ernie5 report``
    .lock                          held (``flock``) by the sweep writing the folder (see RunLock)

Subnets are named by their compact spec (``full``, ``d0.75-w0.5-k1``), which is safe in paths.
A suite with ``subnets.random_baseline: true`` adds the pseudo-subnet :data:`RANDOM_BASELINE`
(``random``): every task also evaluated on a freshly initialised model of the checkpoint's
architecture (seeded with the suite seed; the checkpoint's tokenizers and frozen side models), the
baseline of chance-normalised scores. Its units, samples and table rows are written like any other
(``subnet == "random"``, listed in the manifest's ``units``), but it is no sub-model: it has no
efficiency row, no ``routing/random.json`` and no entry in the manifest's ``subnets``; the
manifest's ``baseline`` is ``"random"`` then, ``null`` otherwise.
Unit files and sample files are written atomically as soon as a unit finishes; the tables are
rebuilt from the unit files at the end of every sweep (so a resumed sweep ends with the same
tables as an uninterrupted one), and only from the units of that sweep: the manifest's ``units``
names them, and a unit file of an earlier sweep with another suite may stay on disk but never enters
a table (:func:`all_units`). One sweep at a time writes a folder (:class:`RunLock`); it first removes
what a killed run left (:func:`remove_leftovers`). ``metric`` values are floats; ``stderr`` may be
NaN (fewer than two examples). ``higher_is_better`` is the task's declared direction.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from ernie5.store.runs import write_atomic, write_json

RESULT_COLUMNS = (
    "subnet",
    "task",
    "metric",
    "value",
    "stderr",
    "n",
    "higher_is_better",
    "modality",
    "capability",
    "task_version",
)
UNIT_KEYS = (
    "fingerprint",
    "subnet",
    "task",
    "task_version",
    "modality",
    "capability",
    "status",  # ok | skipped | error
    "reason",  # why skipped / the error message ("" when ok)
    "metrics",  # {metric: {"value", "stderr", "n", "higher_is_better"}}
    "n_examples",
    "limit",
    "seed",
    "kwargs",
    "wall_s",
    "model_s",  # time inside model forward passes
)
RANDOM_BASELINE = "random"
"""The pseudo-subnet name of the random-initialised baseline model (never a valid subnet spec)."""
EFFICIENCY_COLUMNS = (
    "subnet",
    "depth",
    "width",
    "top_k",
    "total_params",
    "active_params",
    "active_params_measured",
    "flops_per_token",
    "prefill_ms",
    "prefill_ms_low",  # interquartile range of the prefill times
    "prefill_ms_high",
    "decode_tokens_per_s",
    "decode_tokens_per_s_low",  # from the interquartile range of the decoding-step times
    "decode_tokens_per_s_high",
    "matmul_peak_flops",  # the physical bound the timings were checked against
    "threads",
    "status",  # ok | failed (the timings are NaN and say nothing)
    "reason",
    "peak_memory_mb",
    "extracted_bytes",
)
"""The columns of ``efficiency.csv``: every key of an ``evals.efficiency.measure`` row."""
MANIFEST_KEYS = (
    "suite",  # name
    "suite_hash",
    "suite_yaml",
    "checkpoint",
    "checkpoint_hash",
    "model_config",
    "subnets",  # [{"name", "layers", "experts_per_layer", "top_k"}]
    "tasks",  # [{"name", "version", "modality", "capability", "data_hash"}]
    "units",  # [{"subnet", "task", "fingerprint"}]: the units of this sweep, the only ones in the tables
    "baseline",  # RANDOM_BASELINE when the random twin was evaluated (its units are in "units"), else null
    "data_dir",
    "seeds",
    "git_hash",
    "versions",
    "machine",
    "argv",
    "started",
    "finished",
)


def unit_path(run_dir: Path, subnet: str, task: str) -> Path:
    """Where a unit's record lives."""
    return Path(run_dir) / "units" / subnet / f"{task}.json"


def samples_path(run_dir: Path, subnet: str, task: str) -> Path:
    """Where a unit's per-sample records live."""
    return Path(run_dir) / "samples" / subnet / f"{task}.jsonl"


def read_unit(path: Path) -> dict[str, Any] | None:
    """A unit record, or None if it is absent or unreadable (then it is recomputed)."""
    try:
        rec = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON: recompute it
        return None
    return rec if isinstance(rec, dict) and "fingerprint" in rec else None


def write_unit(run_dir: Path, record: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    """Write a unit's samples, then its record (the record's presence means the unit is done)."""
    text = "".join(json.dumps(s, sort_keys=True, default=_json_default) + "\n" for s in samples)
    write_atomic(samples_path(run_dir, record["subnet"], record["task"]), text)
    write_json(unit_path(run_dir, record["subnet"], record["task"]), record)


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


def manifest_units(run_dir: Path) -> set[tuple[str, str]] | None:
    """The (subnet, task) units the run's manifest names, or None when it names none (no manifest,
    or one written before manifests listed their units)."""
    try:
        manifest = json.loads((Path(run_dir) / "manifest.json").read_text(encoding="utf-8"))
        return {(u["subnet"], u["task"]) for u in manifest["units"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def all_units(run_dir: Path, names: Iterable[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """The readable unit records of a run, sorted by (subnet, task).

    Args:
        run_dir: the run folder.
        names: the (subnet, task) units to read; None = those the manifest names
            (:func:`manifest_units`), or every unit file when it names none.
    """
    root = Path(run_dir) / "units"
    wanted = set(names) if names is not None else manifest_units(run_dir)
    recs = [r for p in sorted(root.glob("*/*.json")) if (r := read_unit(p)) is not None]
    if wanted is not None:
        recs = [r for r in recs if (r["subnet"], r["task"]) in wanted]
    return sorted(recs, key=lambda r: (r["subnet"], r["task"]))


def results_frame(units: list[dict[str, Any]]) -> pd.DataFrame:
    """The results table (RESULT_COLUMNS) from unit records."""
    rows = []
    for u in units:
        if u["status"] != "ok":
            continue
        for metric, m in u["metrics"].items():
            rows.append(
                {
                    "subnet": u["subnet"],
                    "task": u["task"],
                    "metric": metric,
                    "value": float(m["value"]) if m["value"] is not None else math.nan,
                    "stderr": float(m["stderr"]) if m.get("stderr") is not None else math.nan,
                    "n": int(m["n"]),
                    "higher_is_better": bool(m["higher_is_better"]),
                    "modality": u["modality"],
                    "capability": u["capability"],
                    "task_version": int(u["task_version"]),
                }
            )
    return pd.DataFrame(rows, columns=list(RESULT_COLUMNS))


def units_frame(units: list[dict[str, Any]]) -> pd.DataFrame:
    """The unit status table."""
    cols = ["subnet", "task", "status", "reason", "wall_s", "model_s"]
    return pd.DataFrame([{c: u.get(c) for c in cols} for u in units], columns=cols)


def write_tables(
    run_dir: Path,
    efficiency: list[dict[str, Any]] | None = None,
    names: Iterable[tuple[str, str]] | None = None,
) -> pd.DataFrame:
    """Rebuild results.csv / results.parquet / units.csv (and efficiency tables) from the units
    ``names`` (None: those of the manifest, see :func:`all_units`)."""
    run_dir = Path(run_dir)
    units = all_units(run_dir, names)
    results = results_frame(units)
    write_atomic(run_dir / "results.csv", results.to_csv(index=False))
    tmp = run_dir / f".results.parquet.tmp-{os.getpid()}"
    results.to_parquet(tmp, index=False)
    tmp.replace(run_dir / "results.parquet")
    write_atomic(run_dir / "units.csv", units_frame(units).to_csv(index=False))
    if efficiency is not None:
        eff = pd.DataFrame(efficiency, columns=list(EFFICIENCY_COLUMNS))
        write_atomic(run_dir / "efficiency.csv", eff.to_csv(index=False))
        write_json(run_dir / "efficiency.json", efficiency)
    return results


def read_results(run_dir: Path) -> pd.DataFrame:
    """The results table of a finished run."""
    return pd.read_csv(Path(run_dir) / "results.csv")


# ---------------------------------------------------------------------------- one writer at a time
LEFTOVER = re.compile(r"\..+\.(tmp|old)(-\d+)?")
"""Names of what an interrupted atomic write leaves: ``.NAME.tmp-PID`` (``write_atomic``),
``.NAME.old-PID`` (a folder moved aside before its replacement is published)."""
SWEEP_AREAS = ("units", "samples", "efficiency", "routing")
"""The sub-folders a sweep writes (besides the run folder's own files)."""


def remove_leftovers(run_dir: str | Path) -> list[Path]:
    """Delete the temp files and moved-aside folders a killed run left in the run folder's own files
    and in the folders a sweep writes (:data:`SWEEP_AREAS`); call it holding the :class:`RunLock`.
    Returns what was removed."""
    run_dir = Path(run_dir)
    found = [p for p in run_dir.iterdir() if LEFTOVER.fullmatch(p.name)] if run_dir.is_dir() else []
    for area in SWEEP_AREAS:
        if (run_dir / area).is_dir():
            found += [p for p in (run_dir / area).rglob(".*") if LEFTOVER.fullmatch(p.name)]
    removed = []
    for p in sorted(found, key=lambda p: len(p.parts)):
        if not p.exists() and not p.is_symlink():
            continue  # inside a folder removed just before
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
        removed.append(p)
    return removed
