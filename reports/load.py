"""Read a sweep run folder (the contract of :mod:`evals.results`) into plain tables.

Required: ``manifest.json`` and at least one ``units/<subnet>/<task>.json``. Optional and tolerated
when absent: ``results.csv`` (rebuilt from the units), ``efficiency.csv|json``, ``routing/``,
``samples/``. Problems with optional files become :attr:`Run.notes`, shown in the report.

**Random baseline.** When ``manifest["baseline"]`` names a subnet (``"random"``: the sweep also
evaluated a random-initialised twin of the checkpoint), that subnet's rows are split out of
:attr:`Run.results` and :attr:`Run.units` into :attr:`Run.baseline_results` and
:attr:`Run.baseline_units` (and dropped from efficiency and routing should any be there), so every
table that compares subnets (seesaw, Pareto, win rates, operating points, routing, the units grid,
``compare``) sees only real subnets. It serves only as the chance level of
:func:`reports.scores.relative_scores`. A manifest naming a baseline without rows gets a note.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from reports.contract import results as contract

UNIT_COLUMNS = (
    "subnet",
    "task",
    "status",
    "reason",
    "modality",
    "capability",
    "task_version",
    "n_examples",
    "wall_s",
    "model_s",
)


class ReportError(ValueError):
    """A folder that is not a readable sweep run (one-line message)."""


@dataclass(frozen=True)
class Run:
    """One sweep run folder, read."""

    path: Path
    manifest: dict[str, Any]
    units: pd.DataFrame
    """One row per unit (:data:`UNIT_COLUMNS`), ok or not."""
    results: pd.DataFrame
    """One row per (subnet, task, metric) of the ok units (``evals.results.RESULT_COLUMNS``)."""
    efficiency: pd.DataFrame | None
    """One row per subnet (``evals.results.EFFICIENCY_COLUMNS``), or None if not recorded."""
    routing: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per subnet, the routing record ``{"n_experts", "layers", "tasks": {...}}``."""
    notes: list[str] = field(default_factory=list)
    """Problems with optional files."""
    baseline: str | None = None
    """The random baseline's subnet name (``manifest["baseline"]``) when it has rows, else None."""
    baseline_results: pd.DataFrame | None = None
    """The baseline's :attr:`results` rows (not in :attr:`results`), or None without a baseline."""
    baseline_units: pd.DataFrame | None = None
    """The baseline's :attr:`units` rows (not in :attr:`units`), or None without a baseline."""

    @property
    def name(self) -> str:
        """The run folder's name."""
        return self.path.name


def text_column(df: pd.DataFrame, col: str) -> pd.Series:
    """``df[col]`` as strings, with "" for a missing value or a missing column (a text column whose
    every value is empty reads back from CSV as floats)."""
    if col not in df:
        return pd.Series("", index=df.index)
    return df[col].map(lambda v: "" if pd.isna(v) else str(v))


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _read_manifest(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "manifest.json"
    if not path.is_file():
        raise ReportError(f"{run_dir} is not a sweep run: no manifest.json")
    try:
        manifest = _read_json(path)
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: unreadable manifest ({type(e).__name__})") from None
    if not isinstance(manifest, dict):
        raise ReportError(f"{path}: manifest is not a JSON object")
    return manifest


def _read_efficiency(run_dir: Path, notes: list[str]) -> pd.DataFrame | None:
    columns = list(contract.EFFICIENCY_COLUMNS)
    try:
        if (run_dir / "efficiency.csv").is_file():
            eff = pd.read_csv(run_dir / "efficiency.csv")
        elif (run_dir / "efficiency.json").is_file():
            eff = pd.DataFrame(_read_json(run_dir / "efficiency.json"))
        else:
            return None
    except (OSError, ValueError) as e:
        notes.append(f"efficiency table unreadable ({type(e).__name__}); efficiency section skipped")
        return None
    if "subnet" not in eff.columns:
        notes.append("efficiency table has no 'subnet' column; efficiency section skipped")
        return None
    for c in columns:
        if c not in eff.columns:
            eff[c] = math.nan
    eff["subnet"] = eff["subnet"].astype(str)
    return eff[columns + [c for c in eff.columns if c not in columns]]


def _read_routing(run_dir: Path, notes: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path in sorted((run_dir / "routing").glob("*.json")):
        try:
            rec = _read_json(path)
            if not isinstance(rec, dict) or not isinstance(rec.get("tasks"), dict):
                raise ValueError("no 'tasks' mapping")
            int(rec["n_experts"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            notes.append(f"routing/{path.name} unreadable ({e}); skipped")
            continue
        out[path.stem] = rec
    return out


def load_run(run_dir: str | Path) -> Run:
    """Read a sweep run folder.

    Args:
        run_dir: the folder ``ernie5 sweep`` / ``ernie5 nightly`` wrote.

    Returns:
        The :class:`Run`.

    Raises:
        ReportError: the folder is missing, has no ``manifest.json`` or has no unit records.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder")
    manifest = _read_manifest(run_dir)
    units = contract.all_units(run_dir)
    if not units:
        raise ReportError(f"{run_dir} is not a sweep run: no units/<subnet>/<task>.json records")
    notes: list[str] = []
    unit_table = pd.DataFrame(
        [{c: u.get(c) for c in UNIT_COLUMNS} for u in units], columns=list(UNIT_COLUMNS)
    )
    unit_table["reason"] = text_column(unit_table, "reason")
    results = None
    if (run_dir / "results.csv").is_file():
        try:
            results = contract.read_results(run_dir)
        except (OSError, ValueError) as e:
            notes.append(f"results.csv unreadable ({type(e).__name__}); rebuilt from the unit records")
    if results is None or not set(contract.RESULT_COLUMNS) <= set(results.columns):
        results = contract.results_frame(units)
    for col in ("subnet", "task", "metric", "modality", "capability"):
        results[col] = results[col].astype(str)
    results["higher_is_better"] = results["higher_is_better"].astype(bool)
    efficiency = _read_efficiency(run_dir, notes)
    routing = _read_routing(run_dir, notes)
    name = baseline_name(manifest)
    baseline = base_results = base_units = None
    if name is not None:
        in_units, in_results = unit_table["subnet"] == name, results["subnet"] == name
        if in_results.any():
            baseline = name
            base_results = results[in_results].reset_index(drop=True)
            base_units = unit_table[in_units].reset_index(drop=True)
        else:
            why = "no unit records" if not in_units.any() else "no finished (ok) unit"
            notes.append(
                f"manifest names the random baseline {name!r} but it has {why}; retention is the plain "
                "ratio sub/full"
            )
        results, unit_table = results[~in_results], unit_table[~in_units]
        if efficiency is not None:
            efficiency = efficiency[efficiency["subnet"] != name].reset_index(drop=True)
        routing.pop(name, None)
        if unit_table.empty:
            raise ReportError(f"{run_dir} has unit records only for the random baseline {name!r}")
    return Run(
        path=run_dir,
        manifest=manifest,
        units=unit_table.reset_index(drop=True),
        results=results.reset_index(drop=True),
        efficiency=efficiency,
        routing=routing,
        notes=notes,
        baseline=baseline,
        baseline_results=base_results,
        baseline_units=base_units,
    )


def baseline_name(manifest: dict[str, Any]) -> str | None:
    """The random baseline's subnet name the manifest declares (``"baseline"``), or None (old runs)."""
    name = manifest.get("baseline")
    return name if isinstance(name, str) and name else None


def read_samples(run: Run | Path, subnet: str, task: str) -> list[dict[str, Any]]:
    """The per-example records of a unit (``[]`` if absent); a torn or bad line is skipped."""
    root = run.path if isinstance(run, Run) else Path(run)
    path = contract.samples_path(root, subnet, task)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "id" in rec:
            out.append(rec)
    return out
