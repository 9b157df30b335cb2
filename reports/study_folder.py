"""An elastic study folder (``ernie5 study elastic``), read: its ledger, held-out losses and sweeps.

A study's rows are named ``arm/subnet``: ``elastic/d0.75`` is the elastic model's d0.75 sub-model,
``static-d0.75/full`` the static model trained at that shape. The static full model is also the one
reference every row's scores are chance-normalised against (:func:`relative`), under the plain name
``full``, so rows of different checkpoints compare on one scale.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from reports import scores
from reports.load import ReportError, Run, load_run

ELASTIC, STATIC = "elastic", "static"
FAMILIES = ("elastic", "static", "pruned", "pruned+rec")
EFFICIENCY_COLUMNS = (
    "active_params",
    "total_params",
    "decode_tokens_per_s",
    "decode_tokens_per_s_low",
    "decode_tokens_per_s_high",
)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: unreadable ({type(e).__name__})") from None


class Study:
    """A study folder, read: its ledger, held-out losses and sweeps."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not (self.root / "study.json").is_file():
            raise ReportError(f"{self.root} is not an elastic study folder (no study.json)")
        self.meta = _read_json(self.root / "study.json")
        self.shapes: dict[str, dict[str, str]] = self.meta["shapes"]
        self.loss = {p.stem: _read_json(p) for p in sorted((self.root / "loss").glob("*.json"))}
        self.runs: dict[str, Run] = {}
        for d in sorted((self.root / "sweeps").glob("*")):
            if (d / "manifest.json").is_file():
                self.runs[d.name] = load_run(d)
        if STATIC not in self.runs:
            raise ReportError(f"{self.root}: no sweep of the static full model (sweeps/static)")

    def alias(self, arm: str, spec: str) -> str:
        """The subnet name a sweep of ``arm`` recorded ``spec`` under: the sweep keeps one name per
        concrete sub-model, so a selection identical to an earlier spec's is found under that one."""
        run = self.runs.get(arm)
        names = set(run.results["subnet"]) if run is not None else set()
        if spec in names:
            return spec
        subs = self.loss.get(arm, {}).get("subnets", {})
        ident = subs.get(spec, {}).get("identity")
        for other, rec in subs.items():
            if rec.get("identity") == ident and other in names:
                return other
        return spec

    def source(self, family: str, shape: str, selection: str = "default") -> tuple[str, str] | None:
        """``(arm, subnet)`` of a family's row for ``shape`` (None when the study has no such row)."""
        spec = self.shapes[shape].get(selection)
        if spec is None:
            return None
        if family == "elastic":
            return ELASTIC, spec
        if family == "pruned":
            return STATIC, spec
        if selection != "default":
            return None
        arm = f"static-{shape}" if family == "static" else f"recover-{shape}"
        return (arm, "full") if arm in self.runs or arm in self.loss else None

    def row(self, family: str, shape: str, selection: str = "default") -> str | None:
        """The ``arm/subnet`` name of a family's row in :func:`relative` (None without the row)."""
        src = self.source(family, shape, selection)
        return None if src is None else f"{src[0]}/{self.alias(*src)}"

    def family_rows(self, family: str) -> dict[str, str]:
        """``arm/subnet`` -> label of a family's rows: its full model (``full``: the elastic full
        model for the elastic family, the static full model for the others) and each shape."""
        names = {f"{ELASTIC}/full" if family == ELASTIC else "full": "full"}
        for shape in self.shapes:
            name = self.row(family, shape)
            if name is not None:
                names[name] = shape
        return names

    def losses(self, arm: str, subnet: str) -> list[float] | None:
        rec = self.loss.get(arm, {}).get("subnets", {}).get(subnet)
        return rec["batches"] if rec else None

    def efficiency(self, arm: str, subnet: str) -> dict[str, float]:
        """Active and total params and decode speed (median and interquartile range) of a row."""
        run = self.runs.get(arm)
        if run is None or run.efficiency is None:
            return {}
        eff = run.efficiency[run.efficiency["subnet"] == subnet]
        if eff.empty:
            return {}
        row = eff.iloc[0]
        return {k: float(pd.to_numeric(row.get(k), errors="coerce")) for k in EFFICIENCY_COLUMNS}

    def active_params(self, names: dict[str, str]) -> dict[str, float] | None:
        """Label -> active params of the ``arm/subnet`` rows in ``names`` (None if any is unknown)."""
        out = {}
        for name, label in names.items():
            arm, subnet = name.split("/", 1) if "/" in name else (STATIC, name)
            out[label] = self.efficiency(arm, subnet).get("active_params", math.nan)
        return None if any(math.isnan(v) for v in out.values()) else out

    @property
    def command(self) -> str:
        """The command that ran the study, as typed (``ernie5 ...``), or "" when not recorded."""
        argv = list(self.meta.get("provenance", {}).get("argv") or [])
        if not argv:
            return ""
        return shlex.join(["ernie5", *argv[1:]])


def _scores(study: Study) -> pd.DataFrame:
    """Primary-metric rows of every (arm, subnet) of the study, subnet renamed ``arm/subnet``, plus
    the static full model as ``full`` (the one reference)."""
    frames = []
    for arm, run in study.runs.items():
        p = scores.primary_scores(run.results).copy()
        p["subnet"] = arm + "/" + p["subnet"].astype(str)
        frames.append(p)
    static = scores.primary_scores(study.runs[STATIC].results)
    frames.append(static[static["subnet"] == "full"])
    return pd.concat(frames, ignore_index=True)


def relative(study: Study) -> pd.DataFrame:
    """Chance-normalised score of every row against the static full model and its random twin."""
    return scores.relative_scores(_scores(study), "full", study.runs[STATIC].baseline_results)


@dataclass
class StudyReport:
    """Every table and verdict of a study's report (what :func:`write_report` renders)."""

    study: Study
    cost: dict
    paper_cost: pd.DataFrame
    """The paper's full-size rows (:data:`PAPER_COST` with their ratio)."""
    main: pd.DataFrame
    dims: pd.DataFrame
    selection: pd.DataFrame
    seesaw_by: str
    seesaw_groups: pd.DataFrame
    seesaw_index: pd.DataFrame
    seesaw_order: pd.DataFrame
    routing: pd.DataFrame
    """Per (arm, sub-model) of the elastic and static sweeps, every selection."""
    routing_rows: pd.DataFrame
    """Routing by modality of every family row (:func:`reports.study_modality.routing_rows`)."""
    routing_entropy: pd.DataFrame
    routing_iou: pd.DataFrame
    cells: pd.DataFrame
    claim_rows: pd.DataFrame
    """:func:`claim_table`: the loss claims per shape, structured."""
    claims: list[str]
    """Plain-words verdicts (Markdown bold marks the decision)."""
    wall_s: float

    def summary(self) -> dict:
        """The ``summary.json`` content."""

        def records(df: pd.DataFrame) -> list:
            return json.loads(df.to_json(orient="records")) if len(df) else []

        return {
            "cost_of_elasticity": self.cost,
            "main": records(self.main),
            "dimensions": records(self.dims),
            "selection": records(self.selection),
            "seesaw_by": self.seesaw_by,
            "seesaw_index": records(self.seesaw_index),
            "seesaw_groups": records(self.seesaw_groups),
            "seesaw_order": records(self.seesaw_order),
            "routing": records(self.routing),
            "routing_rows": records(self.routing_rows),
            "task_cells": records(self.cells),
            "verdicts": self.claims,
            "wall_s": self.wall_s,
            "command": self.study.command,
        }
