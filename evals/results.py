"""The run-folder contract of a sweep: what ``ernie5 sweep`` writes and ``reports/`` reads.

Layout of ``RUN_DIR``::

    manifest.json                  how the run was made (see MANIFEST_KEYS)
    units/<subnet>/<task>.json     one record per evaluated (subnet, task) unit (see UNIT_KEYS)
    samples/<subnet>/<task>.jsonl  per example: {"id", "scores": {metric: value}, "sample": {...}}
    results.csv, results.parquet   one row per (subnet, task, metric) of the ``ok`` units (RESULT_COLUMNS)
    units.csv                      one row per unit: subnet, task, status, reason, wall_s, model_s
    efficiency.csv, efficiency.json  one row per subnet (EFFICIENCY_COLUMNS)
    routing/<subnet>.json          expert loads: {"n_experts", "layers": [...],
                                   "tasks": {task: {"modality", "counts": {layer: [count per expert]}}}}
    report/                        written by ``ernie5 report``

Subnets are named by their compact spec (``full``, ``d0.75-w0.5-k1``), which is safe in paths.
Unit files and sample files are written atomically as soon as a unit finishes; the tables are
rebuilt from the unit files at the end of every sweep (so a resumed sweep ends with the same
tables as an uninterrupted one). ``metric`` values are floats; ``stderr`` may be NaN (fewer than
two examples). ``higher_is_better`` is the task's declared direction.
"""

from __future__ import annotations

import json
import math
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
    "decode_tokens_per_s",
    "peak_memory_mb",
    "extracted_bytes",
)
MANIFEST_KEYS = (
    "suite",  # name
    "suite_hash",
    "suite_yaml",
    "checkpoint",
    "checkpoint_hash",
    "model_config",
    "subnets",  # [{"name", "layers", "experts_per_layer", "top_k"}]
    "tasks",  # [{"name", "version", "modality", "capability", "data_hash"}]
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
    except (OSError, json.JSONDecodeError):
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


def all_units(run_dir: Path) -> list[dict[str, Any]]:
    """Every readable unit record of a run, sorted by (subnet, task)."""
    root = Path(run_dir) / "units"
    recs = [r for p in sorted(root.glob("*/*.json")) if (r := read_unit(p)) is not None]
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


def write_tables(run_dir: Path, efficiency: list[dict[str, Any]] | None = None) -> pd.DataFrame:
    """Rebuild results.csv / results.parquet / units.csv (and efficiency tables) from the units."""
    run_dir = Path(run_dir)
    units = all_units(run_dir)
    results = results_frame(units)
    write_atomic(run_dir / "results.csv", results.to_csv(index=False))
    tmp = run_dir / ".results.parquet.tmp"
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
