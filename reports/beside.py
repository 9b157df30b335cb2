"""Two models' seesaws side by side: under the same relative cut, which capability each loses first.

``ernie5 report RUN --beside OTHER_RUN`` (two sweeps, usually of one suite: ernie5's reference and a
Hugging Face MoE swept with ``--checkpoint hf:PATH``) matches the two runs' sub-models by the share of
the full model they keep, read from each manifest: depth (kept layers over all), width (experts kept
per MoE layer over all, mean over the kept MoE layers) and top-k (over the full model's). ``k1`` of a
top-2 Mixtral and ``k2`` of a top-4 ERNIE5 are both "top-k 50 %". For every cut both runs have, and
for each run, the tasks are ordered by retention (the report's relative score: chance-normalised with
a random baseline), lowest first; the first is what that model **loses first** under the cut (nothing,
when even it keeps :data:`KEPT` of its score). Tasks
the full model does not answer above chance are left out (their retention is noise), as in the
seesaw's modality averages; so are tasks only one of the runs has.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from reports import formatting as f
from reports.analysis import Analysis
from reports.load import Run
from reports.render.document import Block, Bullets, Heading, Table, Text
from reports.scores import at_chance


def cut_shares(run: Run) -> dict[str, tuple[float, float, float]]:
    """Subnet -> (depth, width, top-k) kept, as shares of the run's full model (from the manifest)."""

    def depth(s: dict) -> int:  # the kept layers' indices (or their count)
        return len(s["layers"]) if isinstance(s["layers"], list) else int(s["layers"])

    def experts(s: dict) -> list[int]:  # per kept MoE layer (or one count for all)
        e = s["experts_per_layer"]
        return [x for x in (e if isinstance(e, list) else [e]) if x]

    subs = {s["name"]: s for s in run.manifest.get("subnets", [])}
    full = subs.get("full") or max(subs.values(), key=lambda s: (depth(s), s["top_k"]), default=None)
    if full is None:
        return {}
    widest = max(experts(full), default=0)
    out = {}
    for name, s in subs.items():
        kept = experts(s)
        width = (sum(kept) / len(kept) / widest) if kept and widest else 1.0
        out[name] = (round(depth(s) / depth(full), 3), round(width, 3), round(s["top_k"] / full["top_k"], 3))
    return out


def cut_label(shares: tuple[float, float, float]) -> str:
    """``depth 75% + top-k 50%`` (only the dimensions that are cut; ``full`` for none)."""
    parts = [
        f"{what} {f.pct(v)}" for what, v in zip(("depth", "width", "top-k"), shares, strict=True) if v < 1
    ]
    return " + ".join(parts) or "full"


def losses(analysis: Analysis, tasks: set[str]) -> dict[str, list[tuple[str, float]]]:
    """Subnet -> ``[(task, retention), ...]`` over ``tasks`` above chance, lowest retention first."""
    rel = analysis.scores[~at_chance(analysis.scores) & analysis.scores["task"].isin(tasks)]
    out: dict[str, list[tuple[str, float]]] = {}
    for sub, group in rel.dropna(subset=["rel"]).groupby("subnet"):
        out[str(sub)] = sorted(
            ((str(t), float(r)) for t, r in zip(group["task"], group["rel"], strict=True)), key=lambda x: x[1]
        )
    return out


KEPT = 0.95
"""A retention at or above this is not a loss: under a cut whose every task keeps it, nothing is lost."""


def lost_first(order: list[tuple[str, float]]) -> str:
    """``task (retention)`` of the lowest retention, or ``nothing`` when even that is >= :data:`KEPT`."""
    if not order:
        return "-"
    task, rel = order[0]
    return f"nothing (lowest {task} {f.pct(rel)})" if rel >= KEPT else f"{task} ({f.pct(rel)})"


def matched_cuts(run: Run, other: Run) -> list[tuple[str, str]]:
    """``(our subnet, their subnet)`` pairs, the full models left out: the same spec name in both runs
    (a relative spec such as ``d0.75`` asks both for the same cut, whatever their layer counts round
    to), then sub-models of different names that keep the same shares."""
    ours, theirs = cut_shares(run), cut_shares(other)
    pairs = [(n, n) for n in ours if n in theirs and ours[n] != (1.0, 1.0, 1.0)]
    by_share = {v: k for k, v in theirs.items() if k not in ours}
    pairs += [(n, by_share[v]) for n, v in ours.items() if n not in theirs and v in by_share]
    return pairs


def above_chance(analysis: Analysis) -> set[str]:
    """The tasks the run's full model answers above chance (all scored tasks without a baseline)."""
    return set(analysis.scores.loc[~at_chance(analysis.scores), "task"])


@dataclass(frozen=True)
class Cut:
    """One matched cut: its label, and per run (ours, theirs) the sub-model and its loss order."""

    label: str
    subnets: tuple[str, str]
    orders: tuple[list[tuple[str, float]], list[tuple[str, float]]]


@dataclass(frozen=True)
class Beside:
    """Two runs compared cut by cut (:func:`compare`)."""

    names: tuple[str, str]
    who: str
    """Both runs with their checkpoints, for the section's first sentence."""
    above: tuple[set[str], set[str]]
    """Per run, the tasks its full model answers above chance."""
    retention: str
    cuts: list[Cut]

    @property
    def common(self) -> set[str]:
        """The tasks both full models answer above chance: the ones the loss orders range over."""
        return self.above[0] & self.above[1]

    def table(self) -> pd.DataFrame:
        """One row per cut: each run's sub-model, what it loses first (with its retention) and its
        whole order, lowest retention first."""
        rows = []
        for cut in self.cuts:
            row = {"cut": cut.label}
            for who, sub, order in zip(self.names, cut.subnets, cut.orders, strict=True):
                row[f"{who}: subnet"] = sub
                row[f"{who}: loses first"] = lost_first(order)
                row[f"{who}: order"] = " < ".join(t for t, _ in order)
            rows.append(row)
        return pd.DataFrame(rows)


def compare(run: Run, analysis: Analysis, other: Run, other_analysis: Analysis) -> Beside:
    """The matched cuts of ``run`` and ``other`` with both loss orders over the common tasks."""
    ours, theirs = cut_shares(run), cut_shares(other)
    above = (above_chance(analysis), above_chance(other_analysis))
    tasks = above[0] & above[1]
    lost, lost_other = losses(analysis, tasks), losses(other_analysis, tasks)
    cuts = []
    for mine, match in matched_cuts(run, other):
        label = cut_label(ours[mine])
        if theirs[match] != ours[mine]:
            label += f" ({other.name}: {cut_label(theirs[match])})"
        cuts.append(Cut(label, (mine, match), (lost.get(mine, []), lost_other.get(match, []))))
    who = " and ".join(f"{r.name} ({r.manifest.get('checkpoint', '?')})" for r in (run, other))
    return Beside((run.name, other.name), who, above, analysis.retention, cuts)


def beside_table(run: Run, analysis: Analysis, other: Run, other_analysis: Analysis) -> pd.DataFrame:
    """:meth:`Beside.table` of :func:`compare`."""
    return compare(run, analysis, other, other_analysis).table()


def _phrase(name: str, order: list[tuple[str, float]]) -> str:
    if order and order[0][1] >= KEPT:
        return f"{name} keeps every task (lowest {order[0][0]} {f.pct(order[0][1])})"
    return f"{name} loses {lost_first(order)} first"


def beside_section(beside: Beside) -> tuple[Block, ...]:
    """The report section: the rule, one sentence per cut, and the table."""
    b = beside
    if not b.cuts:
        return (Text(f"{b.who}: no sub-model of one matches one of the other's (same spec or same shares)."),)
    if not b.common:
        ours, theirs = (", ".join(sorted(a)) or "none" for a in b.above)
        return (
            Text(
                f"{b.who}: no task is answered above chance by both full models, so neither loss order "
                f"means anything yet (above chance: {b.names[0]}: {ours}; {b.names[1]}: {theirs})."
            ),
            Table(b.table()),
        )
    lines = [
        f"**{cut.label}**: {_phrase(b.names[0], cut.orders[0])}, {_phrase(b.names[1], cut.orders[1])}."
        for cut in b.cuts
    ]
    return (
        Text(
            f"{b.who}, sub-models matched by the share of the full model they keep; retention "
            f"{b.retention}, lowest first, over the tasks both full models answer above chance."
        ),
        Bullets(tuple(lines), callout=True, title="What each model loses first"),
        Heading("Order of loss per cut"),
        Table(b.table()),
    )
