"""Every table of a run report, computed from a :class:`reports.load.Run` (no rendering, no I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from reports import pareto, routing, scores, seesaw
from reports.load import Run
from reports.skips import group_skips

ROUTING_REFERENCE = "full"


@dataclass
class Analysis:
    """The derived tables of one run."""

    scores: pd.DataFrame
    """Primary-metric rows with relative scores (:func:`reports.scores.relative_scores`)."""
    by_modality: pd.DataFrame
    by_capability: pd.DataFrame
    seesaw_index: pd.DataFrame
    degradation: pd.DataFrame
    win_rates: pd.DataFrame
    aggregate: pd.DataFrame
    order: list[str]
    """Subnets from largest to smallest (active params, else score)."""
    labels: dict[str, str]
    """Subnet -> axis label (name and share of active params)."""
    active_params: dict[str, float] = field(default_factory=dict)
    efficiency: pd.DataFrame | None = None
    pareto: pd.DataFrame | None = None
    operating_points: pd.DataFrame | None = None
    routing_subnet: str = ""
    routing: dict[str, pd.DataFrame] = field(default_factory=dict)
    baseline: str | None = None
    """The random baseline's subnet name, or None (retention is then the plain ratio)."""
    chance: pd.DataFrame = field(default_factory=lambda: scores.chance_table(pd.DataFrame()))
    """Per task with a random score: full vs random margin (:func:`reports.scores.chance_table`)."""

    @property
    def retention(self) -> str:
        """Which retention the relative scores are: chance-normalised or the plain ratio."""
        return scores.RETENTION_NORMALISED if self.baseline else scores.RETENTION_RATIO

    @property
    def ratio_tasks(self) -> list[str]:
        """With a random baseline, the tasks it has no score on (their retention is the plain ratio)."""
        if not self.baseline:
            return []
        return sorted(set(self.scores.loc[~self.scores["normalised"].astype(bool), "task"]))

    @property
    def retention_text(self) -> str:
        """:attr:`retention`, naming the tasks that fall back to the plain ratio."""
        fallback = self.ratio_tasks
        if not fallback:
            return self.retention
        tasks = ", ".join(fallback)
        return f"{self.retention}; plain ratio sub/full for the tasks without a random score ({tasks})"

    @property
    def at_chance(self) -> pd.DataFrame:
        """The :attr:`chance` rows of tasks not significantly above random (left out of averages)."""
        return self.chance[~self.chance["above_chance"].astype(bool)]

    @property
    def task_modality(self) -> dict[str, str]:
        """Task -> modality."""
        return dict(zip(self.scores["task"], self.scores["modality"]))


def _active_params(eff: pd.DataFrame | None) -> dict[str, float]:
    if eff is None:
        return {}
    values = pd.to_numeric(eff["active_params"], errors="coerce")
    return {s: float(v) for s, v in zip(eff["subnet"], values) if not math.isnan(v)}


def _labels(order: list[str], active: dict[str, float]) -> dict[str, str]:
    full = active.get(scores.REFERENCE)
    out = {}
    for s in order:
        if full and s in active:
            out[s] = f"{s}\n{100 * active[s] / full:.0f}% active"
        else:
            out[s] = s
    return out


def _routing_tables(run: Run) -> tuple[str, dict[str, pd.DataFrame]]:
    if not run.routing:
        return "", {}
    subnet = ROUTING_REFERENCE if ROUTING_REFERENCE in run.routing else sorted(run.routing)[0]
    rec = run.routing[subnet]
    tables = {
        "routing_frequency": routing.frequency_table(rec, "modality"),
        "routing_entropy": routing.entropy_table(rec, "modality"),
        "routing_iou_modality": routing.iou_table(rec, "modality"),
        "routing_iou_task": routing.iou_table(rec, "task"),
    }
    mean_entropy = []
    for name, r in sorted(run.routing.items()):
        ent = routing.entropy_table(r, "modality")
        for group, g in ent.groupby("group", sort=False):
            mean_entropy.append({"subnet": name, "group": group, "mean_entropy": float(g["entropy"].mean())})
    tables["routing_entropy_by_subnet"] = pd.DataFrame(
        mean_entropy, columns=["subnet", "group", "mean_entropy"]
    )
    return subnet, tables


def analyze(run: Run) -> Analysis:
    """Compute the seesaw, win-rate, efficiency and routing tables of ``run``."""
    rel = scores.relative_scores(scores.primary_scores(run.results), baseline=run.baseline_results)
    by_modality = seesaw.group_scores(rel, "modality")
    eff = pareto.efficiency_table(run.efficiency) if run.efficiency is not None else None
    active = _active_params(eff)
    order = seesaw.subnet_order(by_modality, active) if len(by_modality) else sorted(rel["subnet"].unique())
    order += [s for s in dict.fromkeys(rel["subnet"]) if s not in order]
    agg = pareto.aggregate_scores(by_modality)
    analysis = Analysis(
        scores=rel,
        by_modality=by_modality,
        by_capability=seesaw.group_scores(rel, "capability"),
        seesaw_index=seesaw.seesaw_index(by_modality),
        degradation=seesaw.degradation_order(by_modality, active or None),
        win_rates=scores.win_rates(rel[~scores.at_chance(rel)]),  # a task at chance ranks noise
        aggregate=agg,
        order=order,
        labels=_labels(order, active),
        active_params=active,
        efficiency=eff,
        baseline=run.baseline,
        chance=scores.chance_table(rel),
    )
    if eff is not None and len(agg):
        analysis.pareto = pareto.pareto_table(agg, eff)
        analysis.operating_points = pareto.operating_points(eff, agg)
    analysis.routing_subnet, analysis.routing = _routing_tables(run)
    return analysis


def tables(run: Run, analysis: Analysis) -> dict[str, pd.DataFrame]:
    """Every table written to ``report/tables/`` (name -> frame)."""
    out = {
        "units": run.units,
        "results": run.results,
        "scores": analysis.scores,
        "seesaw_modality": analysis.by_modality,
        "seesaw_capability": analysis.by_capability,
        "seesaw_index": analysis.seesaw_index,
        "degradation_order": analysis.degradation,
        "win_rates": analysis.win_rates,
        "aggregate": analysis.aggregate,
        "skipped_by_reason": group_skips(run.units, analysis.order),
    }
    if analysis.baseline:
        out["chance"] = analysis.chance
        out["baseline_results"] = run.baseline_results
    if analysis.pareto is not None:
        out["pareto"] = analysis.pareto
    if analysis.operating_points is not None:
        out["operating_points"] = analysis.operating_points
    out.update(analysis.routing)
    return out
