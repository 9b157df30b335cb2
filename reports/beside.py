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


def common_tasks(analysis: Analysis, other_analysis: Analysis) -> set[str]:
    """The tasks both full models answer above chance (with a score in both runs)."""

    def usable(a: Analysis) -> set[str]:
        return set(a.scores.loc[~at_chance(a.scores), "task"])

    return usable(analysis) & usable(other_analysis)


def beside_table(run: Run, analysis: Analysis, other: Run, other_analysis: Analysis) -> pd.DataFrame:
    """One row per matched cut: its shares in each run, each run's sub-model, the task it loses first
    with its retention, and its whole order (lowest retention first)."""
    ours, theirs = cut_shares(run), cut_shares(other)
    tasks = common_tasks(analysis, other_analysis)
    lost, lost_other = losses(analysis, tasks), losses(other_analysis, tasks)
    rows = []
    for mine, match in matched_cuts(run, other):
        label = cut_label(ours[mine])
        if theirs[match] != ours[mine]:
            label += f" ({other.name}: {cut_label(theirs[match])})"
        row = {"cut": label}
        for who, sub, table in ((run.name, mine, lost), (other.name, match, lost_other)):
            order = table.get(sub, [])
            row[f"{who}: subnet"] = sub
            row[f"{who}: loses first"] = lost_first(order)
            row[f"{who}: order"] = " < ".join(t for t, _ in order)
        rows.append(row)
    return pd.DataFrame(rows)


def beside_section(run: Run, analysis: Analysis, other: Run, other_analysis: Analysis) -> tuple[Block, ...]:
    """The report section: the rule, the table, and one sentence per cut."""
    table = beside_table(run, analysis, other, other_analysis)
    ours, theirs = (f"{r.name} ({r.manifest.get('checkpoint', '?')})" for r in (run, other))
    who = f"{ours} and {theirs}"
    if not len(table):
        return (Text(f"{who}: no sub-model of one matches one of the other's (same spec or same shares)."),)
    if not common_tasks(analysis, other_analysis):

        def above(a: Analysis) -> str:
            return ", ".join(sorted(set(a.scores.loc[~at_chance(a.scores), "task"]))) or "none"

        return (
            Text(
                f"{who}: no task is answered above chance by both full models, so neither loss order "
                f"means anything yet (above chance: {run.name}: {above(analysis)}; {other.name}: "
                f"{above(other_analysis)})."
            ),
            Table(table),
        )

    def phrase(name: str, lost: str) -> str:
        if lost.startswith("nothing"):
            return f"{name} keeps every task ({lost.removeprefix('nothing (').rstrip(')')})"
        return f"{name} loses {lost} first"

    lines = [
        f"**{row['cut']}**: {phrase(run.name, row[f'{run.name}: loses first'])}, "
        f"{phrase(other.name, row[f'{other.name}: loses first'])}."
        for _, row in table.iterrows()
    ]
    return (
        Text(
            f"{who}, sub-models matched by the share of the full model they keep; retention "
            f"{analysis.retention}, lowest first, over the tasks both full models answer above chance."
        ),
        Bullets(tuple(lines), callout=True, title="What each model loses first"),
        Heading("Order of loss per cut"),
        Table(table),
    )
