"""The sections of a run report as :mod:`reports.render` blocks: overview, seesaw, efficiency, the units.

Each section's headline (the verdicts, the retention table, the operating points, the skipped and failed
units) is in both the page and the Markdown summary; its detail (second figures, long tables, the
manifest) is :class:`~reports.render.document.PageOnly`. Routing and the per-task drill-down are in
:mod:`reports.drilldown`.
"""

from __future__ import annotations

import json

import pandas as pd

from reports import formatting as f
from reports import pareto, plots, scores
from reports.analysis import Analysis
from reports.load import Run
from reports.render.document import (
    Block,
    Bullets,
    Code,
    Details,
    Figure,
    Heading,
    KeyValues,
    PageOnly,
    Table,
    Text,
)
from reports.skips import group_skips

MANIFEST_FIELDS = (
    "suite",
    "suite_hash",
    "checkpoint",
    "checkpoint_hash",
    "git_hash",
    "data_dir",
    "seeds",
    "started",
    "finished",
    "argv",
)
RETENTION_PLOT = "retention.png"
"""The seesaw figure's file beside ``summary.md``."""


def _json(x) -> str:
    return json.dumps(x, indent=2, sort_keys=True, default=str)


def speedup_text(point: pd.Series) -> str:
    """An operating point's speedup (``1.23x``), or "measurement failed" when a timing failed."""
    if point.get("speedup_failed", False):
        return pareto.FAILED
    return f.NA if pd.isna(point["speedup"]) else f"{point['speedup']:.2f}x"


def _arrow(higher_is_better: bool) -> str:
    return "\u2191" if higher_is_better else "\u2193"


def retention_line(a: Analysis) -> str:
    """Which retention the report uses and, with a random baseline, which tasks are at chance."""
    text = f"**Retention:** {a.retention_text}."
    if a.baseline:
        gone = a.at_chance
        text += (
            f" {len(gone)} of {len(a.chance)} tasks are not significantly above the random model and "
            "are left out of modality averages" + (f": {', '.join(gone['task'])}." if len(gone) else ".")
        )
    return text


def degrades_first(a: Analysis) -> str:
    """The modality that gives way first, where, and the order of the rest ("" without an order)."""
    if not len(a.degradation):
        return ""
    d = a.degradation.iloc[0]
    order = " > ".join(a.degradation["modality"])
    if d["crosses_at"]:
        return (
            f"**Degrades first:** {d['modality']}, below 95% retention first at {d['crosses_at']} "
            f"(retention there {f.pct(d['rel_at_crossing'])}); order {order}."
        )
    return (
        f"**Degrades first:** none falls below 95% retention; {d['modality']} is lowest at the smallest "
        f"subnet, {d['smallest']} ({f.pct(d['rel_at_smallest'])}); order {order}."
    )


def highlights(a: Analysis) -> Bullets:
    """The findings a reader needs at a glance."""
    items = [retention_line(a)]
    if first := degrades_first(a):
        items.append(first)
    idx = a.seesaw_index.dropna(subset=["seesaw_index"])
    if len(idx):
        top = idx.sort_values("seesaw_index").iloc[-1]
        items.append(
            f"**Most uneven subnet:** {top['subnet']}, seesaw index {f.pts(top['seesaw_index'])} "
            f"(best {top['best']}, worst {top['worst']})."
        )
    if a.pareto is not None:
        front = a.pareto[a.pareto["front_active_params"]]["subnet"]
        items.append(f"**Pareto frontier (score vs active params):** {', '.join(front) or 'none'}.")
    if a.operating_points is not None:
        for _, p in a.operating_points.iterrows():
            items.append(
                f"{p['point']} point {p['subnet']}: {f.pct(p['score'])} of the full score at "
                f"{f.pct(p['active_pct'])} active params, decode speedup {speedup_text(p)}."
            )
    if a.efficiency is not None and a.efficiency["timing_failed"].any():
        bad = a.efficiency[a.efficiency["timing_failed"]]
        why = "; ".join(f"{s} ({r})" for s, r in zip(bad["subnet"], bad["reason"]))
        items.append(f"**Speed {pareto.FAILED}:** {why} (see Efficiency trade-offs).")
    iou = a.routing.get("routing_iou_modality")
    if iou is not None and len(iou):
        last = iou[(iou["layer"] == iou["layer"].max()) & (iou["a"] < iou["b"])].dropna(subset=["iou"])
        if len(last):
            lo = last.sort_values("iou").iloc[0]
            items.append(
                f"**Routing:** most separated modalities in the last MoE layer: {lo['a']} / {lo['b']} "
                f"(top-25% expert IoU {f.num(lo['iou'], 2)})."
            )
    return Bullets(tuple(items), callout=True)


def retention_figure(a: Analysis) -> Figure:
    """The report's answer: retention per modality as the model shrinks."""
    return Figure(
        plots.retention_plot(
            a.by_modality, a.order, a.labels, "Retention per modality as the model shrinks (95% intervals)"
        ),
        "Relative score per modality by subnet",
        "Each line is a modality's mean relative score vs the full model; bars are 95% intervals.",
        RETENTION_PLOT,
    )


def overview(run: Run, a: Analysis, html_path: str) -> tuple[Block, ...]:
    """The verdicts, the seesaw figure, what ran, and the run's notes."""
    m = run.manifest
    counts = run.units["status"].value_counts()
    blocks: list[Block] = [highlights(a)]
    if not a.by_modality.empty:
        blocks.append(retention_figure(a))
    blocks.append(
        Text(
            f"{len(run.units)} units: {counts.get('ok', 0)} ok, {counts.get('skipped', 0)} skipped, "
            f"{counts.get('error', 0)} failed; {run.units['subnet'].nunique()} subnets x "
            f"{run.units['task'].nunique()} tasks. Suite {m.get('suite', '?')}, checkpoint "
            f"{m.get('checkpoint', '?')}, git {str(m.get('git_hash', '?'))[:12]}. Full report: {html_path}.",
            "lead",
        )
    )
    if run.baseline_units is not None:
        bc = run.baseline_units["status"].value_counts()
        blocks.append(
            Text(
                f"Random baseline {run.baseline!r} (a random-initialised twin of the checkpoint, the chance "
                f"level of retention; not a subnet): {len(run.baseline_units)} units, {bc.get('ok', 0)} ok, "
                f"{bc.get('skipped', 0)} skipped, {bc.get('error', 0)} failed."
            )
        )
    blocks += [Text(note, "callout") for note in run.notes]
    return tuple(blocks)


def chance_blocks(a: Analysis) -> tuple[Block, ...]:
    """The retention used and, with a random baseline, the tasks at chance (left out of averages)."""
    blocks: list[Block] = [Text(f"Retention used: {a.retention_text}.", "lead")]
    if not a.baseline:
        return tuple(blocks)
    gone = a.at_chance
    if not len(gone):
        blocks.append(
            Text(f"Every task's full model is significantly above the random model ({a.baseline}).")
        )
        return tuple(blocks)
    view = pd.DataFrame(
        {
            "task": gone["task"],
            "modality": gone["modality"],
            "metric": [f"{m} {_arrow(h)}" for m, h in zip(gone["metric"], gone["higher_is_better"])],
            "full": [f.num(v, 4) for v in gone["full_value"]],
            "random": [f.num(v, 4) for v in gone["rand_value"]],
            "margin (95% CI)": [
                f"{f.signed(m, 4)} {f.ci(lo, hi, lambda v: f.signed(v, 4))}"
                for m, lo, hi in zip(gone["margin"], gone["margin_ci_low"], gone["margin_ci_high"])
            ],
            "status": "left out of modality averages",
        }
    )
    blocks += [
        Heading(
            f"Tasks at chance: full model not significantly above random ({len(gone)}), left out of "
            "modality averages"
        ),
        Table(view, chips=("modality",)),
    ]
    return tuple(blocks)


def task_scores(a: Analysis) -> tuple[Block, ...]:
    """Per task, the primary score of every subnet with the random model's beside the full model's."""
    sc = a.scores
    if sc.empty:
        return ()
    wide = sc.pivot_table(index="task", columns="subnet", values="value", aggfunc="first")
    subnets = [s for s in a.order if s in wide.columns]
    if scores.REFERENCE in subnets:  # the full model first, the random model next to it
        subnets.remove(scores.REFERENCE)
        subnets.insert(0, scores.REFERENCE)
    first = sc.drop_duplicates("task").set_index("task")
    rows = []
    for task in sorted(wide.index):
        r = first.loc[task]
        row = {
            "task": task,
            "modality": r["modality"],
            "metric": f"{r['metric']} {_arrow(r['higher_is_better'])}",
        }
        for s_ in subnets[:1]:
            row[s_] = f.num(wide.loc[task, s_], 4)
        if a.baseline:
            row[a.baseline] = f.num(r["rand_value"], 4)
            row["above chance"] = (
                "n/a" if pd.isna(r["above_chance"]) else ("yes" if r["above_chance"] else "no")
            )
        for s_ in subnets[1:]:
            row[s_] = f.num(wide.loc[task, s_], 4)
        rows.append(row)
    return (Heading("Primary score per task"), Table(pd.DataFrame(rows), chips=("modality",)))


def _ci_wide(groups: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    """Retention per subnet (rows, in ``order``) and group (columns) as ``93.0% [88.1%, 97.2%]``."""
    txt = groups.assign(
        txt=[
            f"{f.pct(r)} {f.ci(lo, hi)}"
            for r, lo, hi in zip(groups["rel"], groups["ci_low"], groups["ci_high"])
        ]
    )
    wide = txt.pivot_table(index="subnet", columns="group", values="txt", aggfunc="first")
    return wide.reindex([s for s in order if s in wide.index]).reset_index()


def seesaw(a: Analysis) -> tuple[Block, ...]:
    """Per-modality and per-capability retention, the change heatmap, the seesaw index and order."""
    head = chance_blocks(a)
    if a.by_modality.empty:
        why = (
            "every task with a score is at chance"
            if len(a.at_chance)
            else "the full model has no results to compare against"
        )
        return (*head, Text(f"No relative scores: {why}."), PageOnly(task_scores(a)))
    blocks: list[Block] = [PageOnly(head)]
    if first := degrades_first(a):
        blocks.append(Text(first, "callout", rich=True))
    view = _ci_wide(a.by_modality, a.order)
    summary = a.seesaw_index.set_index("subnet")
    aggregate = a.aggregate.set_index("subnet")["score"]
    view["seesaw index"] = [f.pts(summary["seesaw_index"].get(s)) for s in view["subnet"]]
    view["worst modality"] = [summary["worst"].get(s) for s in view["subnet"]]
    view["aggregate"] = [f.pct(aggregate.get(s)) for s in view["subnet"]]
    blocks += [
        Heading("Retention vs full per modality (95% interval), seesaw index and aggregate score"),
        Table(view.fillna("n/a")),
    ]
    detail: list[Block] = [
        Figure(
            plots.change_heatmap(a.scores, a.order, a.task_modality),
            "Subnet by task heatmap",
            "Relative change of each task's primary metric vs the full model (direction-aware)."
            + (" Tasks at chance are shown but left out of every average." if len(a.at_chance) else ""),
        )
    ]
    if a.seesaw_index["seesaw_index"].notna().any():
        caption = "Seesaw index = max - min of the per-modality retention of a subnet."
        detail.append(Figure(plots.seesaw_bars(a.seesaw_index, a.order), "Seesaw index per subnet", caption))
    else:
        modalities = ", ".join(sorted(a.by_modality["group"].unique()))
        detail.append(Text(f"No seesaw index: it needs two or more modalities; this run has {modalities}."))
    detail += [
        Heading("Retention per capability (95% interval)"),
        Table(_ci_wide(a.by_capability, a.order).fillna("n/a")),
        Heading("Degradation order"),
        Table(
            a.degradation,
            formats={"rel_at_crossing": f.pct, "rel_at_smallest": f.pct, "crosses_at_active_params": f.si},
        ),
        Heading("Mean win rate (HELM)"),
        Table(a.win_rates, formats={"mean_win_rate": f.pct}),
        *task_scores(a),
    ]
    blocks.append(PageOnly(tuple(detail)))
    return tuple(blocks)


def _frontier_table(a: Analysis) -> Table:
    front = a.pareto.copy()
    front["frontier"] = [
        ", ".join(
            c
            for c in ("active_params", "total_params", "decode_ms_per_token", "flops_per_token")
            if r[f"front_{c}"]
        )
        for _, r in front.iterrows()
    ]
    front = front.drop(columns=[c for c in front.columns if c.startswith("front_")])
    if "timing_failed" in front:
        front["decode_ms_per_token"] = [
            pareto.FAILED if failed else f.num(v)
            for v, failed in zip(front["decode_ms_per_token"], front["timing_failed"].fillna(False))
        ]
        front = front.drop(columns="timing_failed")
    front = front.merge(a.win_rates[["subnet", "mean_win_rate"]], on="subnet", how="left")
    front = front.assign(pos=front["subnet"].map({s: i for i, s in enumerate(a.order)})).sort_values("pos")
    return Table(
        front.drop(columns="pos"),
        formats={
            "score": f.pct,
            "mean_win_rate": f.pct,
            "decode_ms_per_token": f.num,
            **{c: f.si for c in ("active_params", "total_params", "flops_per_token")},
        },
        headers={"score": "aggregate score", "decode_ms_per_token": "decode ms/token"},
    )


def efficiency(a: Analysis) -> tuple[Block, ...]:
    """Score against cost with the Pareto frontier, and the paper-style operating points."""
    if a.efficiency is None:
        return (Text("This run recorded no efficiency table (efficiency.csv / efficiency.json)."),)
    if a.pareto is None:  # nothing to place against cost; what each subnet costs still stands
        return (
            Text("No aggregate scores (no subnet has relative scores) to place against cost."),
            Heading("Measured speed (median, interquartile range)"),
            measured_speed(a.efficiency),
        )
    blocks: list[Block] = [
        PageOnly(
            (
                Figure(
                    plots.pareto_plot(a.pareto, a.by_modality),
                    "Score against cost with Pareto frontier",
                    "Black: aggregate score (mean over modalities); coloured: per modality; "
                    "dashed: frontier.",
                ),
                Heading("Efficiency table (frontier: the costs on whose frontier the subnet sits)"),
                _frontier_table(a),
                Heading("Measured speed (median, interquartile range)"),
                measured_speed(a.efficiency),
            )
        )
    ]
    points = a.operating_points
    if points is None or not len(points):
        blocks.append(Text("No top-k-only or fully elastic subnet in this run: no operating points."))
        return tuple(blocks)
    points = points.assign(speedup=[speedup_text(p) for _, p in points.iterrows()])
    blocks += [
        Heading("Operating points (paper-style)"),
        Table(
            points.drop(columns="speedup_failed"),
            formats={"top_k_fraction": f.pct, "score": f.pct, "active_pct": f.pct, "total_pct": f.pct},
            headers={
                "score": "relative score",
                "active_pct": "active params",
                "total_pct": "total params",
                "paper": "paper reference (ERNIE 5.0-Exp, Table 12)",
            },
        ),
    ]
    return tuple(blocks)


def measured_speed(eff: pd.DataFrame) -> Table:
    """Per subnet, the prefill and decode timings with their interquartile ranges, the threads and
    matmul peak they were checked against, and "measurement failed" with the reason where a timing
    is not a measurement (see :mod:`reports.pareto`)."""

    def timing(r: pd.Series, col: str, digits: int) -> str:
        if r["timing_failed"]:
            return pareto.FAILED
        low, high = r.get(f"{col}_low"), r.get(f"{col}_high")
        spread = "" if pd.isna(low) or pd.isna(high) else f" [{f.num(low, digits)}, {f.num(high, digits)}]"
        return f.num(r[col], digits) + spread

    rows = [
        {
            "subnet": r["subnet"],
            "prefill ms": timing(r, "prefill_ms", 2),
            "decode tokens/s": timing(r, "decode_tokens_per_s", 1),
            "threads": f.text(r.get("threads")),
            "matmul peak FLOP/s": f.si(r.get("matmul_peak_flops")),
            "status": r["status"] or "unchecked",
            "reason": r["reason"],
        }
        for _, r in eff.iterrows()
    ]
    return Table(pd.DataFrame(rows))


def units(run: Run, a: Analysis) -> tuple[Block, ...]:
    """Which units ran (the grid), the skipped ones grouped by reason with how to get the data, the
    failed ones one by one, and the manifest."""
    m = run.manifest
    grid = run.units.pivot_table(index="task", columns="subnet", values="status", aggfunc="first").fillna(
        "missing"
    )
    grid = grid.reindex(
        columns=[s for s in a.order if s in grid.columns] + [c for c in grid.columns if c not in a.order]
    )
    tasks = run.units.drop_duplicates("task").set_index("task")
    grid.insert(0, "modality", [str(tasks.loc[t, "modality"]) for t in grid.index])
    grid.insert(1, "capability", [tasks.loc[t, "capability"] for t in grid.index])
    grid = grid.reset_index()
    subnet_cols = tuple(c for c in grid.columns if c not in ("task", "modality", "capability"))
    blocks: list[Block] = [
        PageOnly((Heading("Units by task and subnet"), Table(grid, badges=subnet_cols, chips=("modality",))))
    ]
    skips = group_skips(run.units, a.order)
    if len(skips):
        blocks += [
            Heading(f"Skipped units, by reason ({int(skips['units'].sum())} units, {len(skips)} reasons)"),
            Table(
                skips.assign(how_to_get=[h or "-" for h in skips["how_to_get"]]),
                headers={"how_to_get": "how to get it"},
            ),
        ]
    bad = run.units[~run.units["status"].isin(["ok", "skipped"])][["subnet", "task", "status", "reason"]]
    if len(bad):
        blocks += [Heading("Failed units"), Table(bad, badges=("status",), code=("reason",))]
    if not len(skips) and not len(bad):
        blocks.append(Text("Every unit finished ok."))
    manifest: list[Block] = [
        Heading("Manifest"),
        KeyValues(
            tuple(
                (k, m[k] if isinstance(m.get(k), str) else _json(m.get(k))) for k in MANIFEST_FIELDS if k in m
            )
        ),
    ]
    for key in ("subnets", "tasks"):
        if m.get(key) and isinstance(m[key], list):
            df = pd.DataFrame(m[key]).astype(str)
            manifest += [
                Heading(f"{key.capitalize()} (manifest)"),
                Table(df[sorted(df.columns, key=lambda c: c != "name")]),
            ]
    for key in ("model_config", "versions", "machine", "suite_yaml"):
        if m.get(key):
            manifest.append(Details(key, (Code(m[key] if isinstance(m[key], str) else _json(m[key])),)))
    blocks.append(PageOnly(tuple(manifest)))
    return tuple(blocks)
