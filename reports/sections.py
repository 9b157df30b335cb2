"""The HTML sections of a run report (overview, seesaw, efficiency, routing, drill-down, about).

Over 500 lines for one reason: the six sections of one page, each a short function over the same
:class:`~reports.analysis.Analysis`; not yet on :mod:`reports.render` (compare is), which is where they go.
"""

from __future__ import annotations

import json

import pandas as pd

from reports import formatting as f
from reports import pareto, plots, routing, scores
from reports.analysis import Analysis
from reports.definitions import ABOUT
from reports.html import badge, chip, definitions, details, esc, figure, key_values, paragraph, pre, table
from reports.load import Run, read_samples
from reports.paired import CORPUS_SCALE
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
N_SAMPLES = 3


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
    """Which retention the report uses and, with a random baseline, which tasks are at chance (HTML)."""
    text = f"Retention: {a.retention_text}."
    if a.baseline:
        gone = a.at_chance
        text += (
            f" {len(gone)} of {len(a.chance)} tasks are not significantly above the random model and "
            "are left out of modality averages" + (f": {', '.join(gone['task'])}." if len(gone) else ".")
        )
    return esc(text)


def chance_section(a: Analysis) -> str:
    """The retention used and, with a random baseline, the tasks at chance (left out of averages)."""
    parts = [paragraph(f"Retention used: {a.retention_text}.", "lead")]
    if not a.baseline:
        return "".join(parts)
    gone = a.at_chance
    if not len(gone):
        parts.append(
            paragraph(f"Every task's full model is significantly above the random model ({a.baseline}).")
        )
        return "".join(parts)
    view = pd.DataFrame(
        {
            "task": gone["task"],
            "modality": [chip(m) for m in gone["modality"]],
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
    view = view.assign(**{c: [esc(x) for x in view[c]] for c in view.columns if c != "modality"})
    parts.append(
        f"<h3>Tasks at chance: full model not significantly above random ({len(gone)}), left out of "
        "modality averages</h3>" + table(view, raw=view.columns)
    )
    return "".join(parts)


def task_scores(a: Analysis) -> str:
    """Per task, the primary score of every subnet with the random model's beside the full model's."""
    sc = a.scores
    if sc.empty:
        return ""
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
    return "<h3>Primary score per task</h3>" + table(pd.DataFrame(rows))


def highlights(a: Analysis) -> str:
    """The findings a reader needs at a glance, as a short list."""
    items = [retention_line(a)]
    if len(a.degradation):
        d = a.degradation.iloc[0]
        order = esc(" > ".join(a.degradation["modality"]))
        if d["crosses_at"]:
            at = f"falls below 95% retention first, at {d['crosses_at']}"
            items.append(f"Degrades first: {chip(d['modality'])} {esc(at)}; order {order}.")
        else:
            at = f"lowest at the smallest subnet, {d['smallest']} ({f.pct(d['rel_at_smallest'])})"
            items.append(f"No modality falls below 95% retention; {chip(d['modality'])} is {esc(at)}.")
    idx = a.seesaw_index.dropna(subset=["seesaw_index"])
    if len(idx):
        top = idx.sort_values("seesaw_index").iloc[-1]
        items.append(
            f"Most uneven subnet: {esc(top['subnet'])}, seesaw index {esc(f.pts(top['seesaw_index']))} "
            f"(best {chip(top['best'])}, worst {chip(top['worst'])})."
        )
    if a.pareto is not None:
        front = a.pareto[a.pareto["front_active_params"]]["subnet"]
        items.append(f"Pareto frontier (score vs active params): {esc(', '.join(front)) or 'none'}.")
    if a.operating_points is not None:
        for _, p in a.operating_points.iterrows():
            items.append(
                f"{esc(p['point'])} point {esc(p['subnet'])}: {esc(f.pct(p['score']))} of the full score at "
                f"{esc(f.pct(p['active_pct']))} active params, decode speedup {esc(speedup_text(p))}."
            )
    if a.efficiency is not None and a.efficiency["timing_failed"].any():
        bad = a.efficiency[a.efficiency["timing_failed"]]["subnet"]
        items.append(f"Speed {pareto.FAILED} for {esc(', '.join(bad))} (see Efficiency trade-offs).")
    iou = a.routing.get("routing_iou_modality")
    if iou is not None and len(iou):
        last = iou[(iou["layer"] == iou["layer"].max()) & (iou["a"] < iou["b"])].dropna(subset=["iou"])
        if len(last):
            lo = last.sort_values("iou").iloc[0]
            items.append(
                f"Routing: most separated modalities in the last MoE layer: {chip(lo['a'])} / "
                f"{chip(lo['b'])} "
                f"(top-25% expert IoU {esc(f.num(lo['iou'], 2))})."
            )
    if not items:
        return ""
    return '<div class="callout"><ul>' + "".join(f"<li>{i}</li>" for i in items) + "</ul></div>"


def overview(run: Run, a: Analysis) -> str:
    """Highlights, manifest, subnets, tasks, which units ran, the skipped ones grouped by reason (with
    how to get the data) and the failed ones one by one."""
    m = run.manifest
    parts = [highlights(a)]
    parts += [
        key_values(
            [(k, m[k] if isinstance(m.get(k), str) else _json(m.get(k))) for k in MANIFEST_FIELDS if k in m]
        )
    ]
    counts = run.units["status"].value_counts()
    parts.append(
        paragraph(
            f"{len(run.units)} units: {counts.get('ok', 0)} ok, {counts.get('skipped', 0)} skipped, "
            f"{counts.get('error', 0)} failed; {run.units['subnet'].nunique()} subnets x "
            f"{run.units['task'].nunique()} tasks.",
            "lead",
        )
    )
    if run.baseline_units is not None:
        bc = run.baseline_units["status"].value_counts()
        parts.append(
            paragraph(
                f"Random baseline {run.baseline!r} (a random-initialised twin of the checkpoint, the chance "
                f"level of retention; not a subnet): {len(run.baseline_units)} units, {bc.get('ok', 0)} ok, "
                f"{bc.get('skipped', 0)} skipped, {bc.get('error', 0)} failed."
            )
        )
    for note in run.notes:
        parts.append(f'<div class="callout">{esc(note)}</div>')
    status = run.units.assign(cell=[badge(s) for s in run.units["status"]])
    grid = status.pivot_table(index="task", columns="subnet", values="cell", aggfunc="first").fillna(
        badge("missing")
    )
    grid = grid.reindex(
        columns=[s for s in a.order if s in grid.columns] + [c for c in grid.columns if c not in a.order]
    )
    tasks = run.units.drop_duplicates("task").set_index("task")
    grid.insert(0, "modality", [chip(str(tasks.loc[t, "modality"])) for t in grid.index])
    grid.insert(1, "capability", [esc(tasks.loc[t, "capability"]) for t in grid.index])
    grid.insert(0, "task", [esc(t) for t in grid.index])
    parts.append("<h3>Units by task and subnet</h3>" + table(grid, raw=grid.columns))
    skips = group_skips(run.units, a.order)
    if len(skips):
        parts.append(
            f"<h3>Skipped units, by reason ({int(skips['units'].sum())} units, {len(skips)} reasons)</h3>"
            + table(
                skips.assign(how_to_get=[h or "-" for h in skips["how_to_get"]]),
                headers={"how_to_get": "how to get it"},
            )
        )
    bad = run.units[~run.units["status"].isin(["ok", "skipped"])][["subnet", "task", "status", "reason"]]
    if len(bad):
        bad = bad.assign(
            status=[badge(s) for s in bad["status"]],
            reason=[pre(r) for r in bad["reason"]],
            subnet=[esc(s) for s in bad["subnet"]],
            task=[esc(t) for t in bad["task"]],
        )
        parts.append("<h3>Failed units</h3>" + table(bad, raw=bad.columns))
    for key in ("subnets", "tasks"):
        if m.get(key) and isinstance(m[key], list):
            df = pd.DataFrame(m[key]).astype(str)
            df = df[sorted(df.columns, key=lambda c: c != "name")]
            parts.append(f"<h3>{key.capitalize()} (manifest)</h3>" + table(df))
    for key in ("model_config", "versions", "machine", "suite_yaml"):
        if m.get(key):
            parts.append(details(key, pre(m[key] if isinstance(m[key], str) else _json(m[key]))))
    return "".join(parts)


def seesaw(a: Analysis) -> str:
    """Per-modality and per-capability retention, the change heatmap, the seesaw index and order."""
    head = chance_section(a)
    if a.by_modality.empty:
        why = (
            "every task with a score is at chance"
            if len(a.at_chance)
            else "the full model has no results to compare against"
        )
        return head + paragraph(f"No relative scores: {why}.") + task_scores(a)
    parts = [head]
    first = a.degradation.iloc[0] if len(a.degradation) else None
    if first is not None:
        where = (
            f"falls below 95% retention first, at {first['crosses_at']}"
            if first["crosses_at"]
            else f"keeps >= 95% everywhere but is lowest at {first['smallest']}"
        )
        there = first["rel_at_crossing"] if first["crosses_at"] else first["rel_at_smallest"]
        parts.append(
            f'<div class="callout">Degrades first: {chip(first["modality"])} {esc(where)} '
            f"(retention there {esc(f.pct(there))}).</div>"
        )
    parts.append(
        figure(
            plots.retention_plot(
                a.by_modality,
                a.order,
                a.labels,
                "Retention per modality as the model shrinks (95% intervals)",
            ),
            "Relative score per modality by subnet",
            "Each line is a modality's mean relative score vs the full model; bars are 95% intervals.",
        )
    )
    parts.append(
        figure(
            plots.change_heatmap(a.scores, a.order, a.task_modality),
            "Subnet by task heatmap",
            "Relative change of each task's primary metric vs the full model (direction-aware)."
            + (" Tasks at chance are shown but left out of every average." if len(a.at_chance) else ""),
        )
    )
    if a.seesaw_index["seesaw_index"].notna().any():
        caption = "Seesaw index = max - min of the per-modality retention of a subnet."
        parts.append(figure(plots.seesaw_bars(a.seesaw_index, a.order), "Seesaw index per subnet", caption))
    else:
        modalities = ", ".join(sorted(a.by_modality["group"].unique()))
        parts.append(
            paragraph(f"No seesaw index: it needs two or more modalities; this run has {modalities}.")
        )
    wide = a.by_modality.pivot_table(index="subnet", columns="group", values="rel", aggfunc="first")
    ci = a.by_modality.assign(
        txt=[
            f"{f.pct(r)} {f.ci(lo, hi)}"
            for r, lo, hi in zip(a.by_modality["rel"], a.by_modality["ci_low"], a.by_modality["ci_high"])
        ]
    )
    ci_wide = ci.pivot_table(index="subnet", columns="group", values="txt", aggfunc="first")
    summary = a.seesaw_index.set_index("subnet").reindex(wide.index)
    view = ci_wide.reindex([s for s in a.order if s in ci_wide.index]).reset_index()
    view["seesaw index"] = [f.pts(summary.loc[s, "seesaw_index"]) for s in view["subnet"]]
    view["worst modality"] = [summary.loc[s, "worst"] for s in view["subnet"]]
    parts.append(
        "<h3>Retention per modality (95% interval) and seesaw index</h3>" + table(view.fillna("n/a"))
    )
    cap = a.by_capability.assign(
        txt=[
            f"{f.pct(r)} {f.ci(lo, hi)}"
            for r, lo, hi in zip(
                a.by_capability["rel"], a.by_capability["ci_low"], a.by_capability["ci_high"]
            )
        ]
    )
    cap_wide = cap.pivot_table(index="subnet", columns="group", values="txt", aggfunc="first")
    cap_wide = cap_wide.reindex([s for s in a.order if s in cap_wide.index]).reset_index()
    parts.append("<h3>Retention per capability (95% interval)</h3>" + table(cap_wide.fillna("n/a")))
    parts.append(
        "<h3>Degradation order</h3>"
        + table(
            a.degradation,
            formats={"rel_at_crossing": f.pct, "rel_at_smallest": f.pct, "crosses_at_active_params": f.si},
        )
    )
    parts.append("<h3>Mean win rate (HELM)</h3>" + table(a.win_rates, formats={"mean_win_rate": f.pct}))
    parts.append(task_scores(a))
    return "".join(parts)


def efficiency(a: Analysis) -> str:
    """Score against cost with the Pareto frontier, and the paper-style operating points."""
    if a.efficiency is None:
        return paragraph("This run recorded no efficiency table (efficiency.csv / efficiency.json).")
    if a.pareto is None:
        return paragraph("No aggregate scores (no subnet has relative scores) to place against cost.")
    parts = [
        figure(
            plots.pareto_plot(a.pareto, a.by_modality),
            "Score against cost with Pareto frontier",
            "Black: aggregate score (mean over modalities); coloured: per modality; dashed: frontier.",
        )
    ]
    front = a.pareto.copy()
    cost_fmt = {c: f.si for c in ("active_params", "total_params", "flops_per_token")}
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
    front = front.drop(columns="pos")
    parts.append(
        "<h3>Efficiency table (frontier: the costs on whose frontier the subnet sits)</h3>"
        + table(
            front,
            formats={"score": f.pct, "mean_win_rate": f.pct, "decode_ms_per_token": f.num, **cost_fmt},
            headers={"score": "aggregate score", "decode_ms_per_token": "decode ms/token"},
        )
    )
    parts.append("<h3>Measured speed (median, interquartile range)</h3>" + measured_speed(a.efficiency))
    points = a.operating_points
    if points is not None and len(points):
        points = points.assign(speedup=[speedup_text(p) for _, p in points.iterrows()])
        parts.append(
            "<h3>Operating points (paper-style)</h3>"
            + table(
                points.drop(columns="speedup_failed"),
                formats={
                    "top_k_fraction": f.pct,
                    "score": f.pct,
                    "active_pct": f.pct,
                    "total_pct": f.pct,
                },
                headers={
                    "score": "relative score",
                    "active_pct": "active params",
                    "total_pct": "total params",
                    "paper": "paper reference (ERNIE 5.0-Exp, Table 12)",
                },
            )
        )
    else:
        parts.append(paragraph("No top-k-only or fully elastic subnet in this run: no operating points."))
    return "".join(parts)


def measured_speed(eff: pd.DataFrame) -> str:
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
    return table(pd.DataFrame(rows))


def routing_section(run: Run, a: Analysis) -> str:
    """Figures 8-10 of the paper for the reference subnet's recorded routing."""
    if not a.routing:
        return paragraph("This run recorded no routing statistics (routing/<subnet>.json).")
    rec = run.routing[a.routing_subnet]
    layers = routing.key_layers(routing.layers_of(rec))
    parts = [
        paragraph(
            f"Routing of subnet {a.routing_subnet} ({rec['n_experts']} routed experts; MoE layers "
            f"{', '.join(map(str, routing.layers_of(rec)))})."
        )
    ]
    parts.append(
        figure(
            plots.frequency_plot(a.routing["routing_frequency"], layers),
            "Expert activation frequency",
            "Share of each modality's routed tokens per expert (paper Fig. 8).",
        )
    )
    for by in ("modality", "task"):
        ious = a.routing[f"routing_iou_{by}"]
        if ious["a"].nunique() < 2:
            parts.append(paragraph(f"No IoU between {by}s: the routing record has only one {by}."))
            continue
        caption = f"IoU of the top-25% most activated experts between {by}s (paper Fig. 9)."
        parts.append(figure(plots.iou_plot(ious, layers), f"Top-25% expert IoU by {by}", caption))
    parts.append(
        figure(
            plots.entropy_plot(a.routing["routing_entropy"]),
            "Normalised routing entropy",
            "Normalised routing entropy per layer and modality (paper Fig. 10).",
        )
    )
    by_subnet = a.routing["routing_entropy_by_subnet"]
    if by_subnet["subnet"].nunique() > 1:
        wide = by_subnet.pivot_table(index="subnet", columns="group", values="mean_entropy").reset_index()
        parts.append("<h3>Mean normalised entropy over layers, per recorded subnet</h3>" + table(wide))
    return "".join(parts)


def _score_text(metric: str, score) -> str:
    """A per-example score; corpus components ``[num, den]`` shown as their ratio too."""
    if isinstance(score, list) and len(score) == 2 and score[1]:
        ratio = CORPUS_SCALE.get(metric, 1.0) * score[0] / score[1]
        return f"{metric} = {ratio:.3f} ({score[0]:.1f} / {score[1]:g})"
    return f"{metric} = {f.text(score)}"


def _sample_rows(run: Run, task: str, metric: str, subnets: list[str]) -> pd.DataFrame:
    per = {s: {r["id"]: r for r in read_samples(run, s, task)} for s in subnets}
    ids = list(per[subnets[0]])[:N_SAMPLES] if subnets else []
    rows = []
    for i in ids:
        ref = per[subnets[0]][i].get("sample", {})
        row = {"id": esc(i), "prompt": pre(ref.get("prompt", "")), "target": pre(ref.get("target", ""))}
        for s in subnets:
            rec = per[s].get(i)
            score = (rec or {}).get("scores", {}).get(metric)
            pred = (rec or {}).get("sample", {}).get("prediction", "") if rec else "(not scored)"
            row[f"{s}: prediction"] = pre(pred) + esc(_score_text(metric, score))
        rows.append(row)
    return pd.DataFrame(rows)


def drilldown(run: Run, a: Analysis) -> str:
    """Per task: every metric with stderr and n, and a few sample predictions."""
    parts = []
    small = a.order[-1] if a.order else None
    position = {s: i for i, s in enumerate(a.order)}
    if run.baseline:
        position[run.baseline] = len(position)
    for task in sorted(run.results["task"].unique()):
        rows = run.results[run.results["task"] == task]
        first = rows.iloc[0]
        if run.baseline_results is not None:
            rows = pd.concat([rows, run.baseline_results[run.baseline_results["task"] == task]])
        rows = rows.assign(order=rows["subnet"].map(position)).sort_values(["order", "metric"])
        tab = rows[["subnet", "metric", "value", "stderr", "n", "higher_is_better", "task_version"]]
        subnets = [s for s in dict.fromkeys(["full", small]) if s in set(rows["subnet"])]
        metric = str(first["metric"])
        samples = _sample_rows(run, task, metric, subnets)
        body = table(tab, formats={"value": lambda x: f.num(x, 4), "stderr": lambda x: f.num(x, 4)})
        if len(samples):
            body += "<h3>Sample predictions</h3>" + table(samples, raw=samples.columns)
        title = f"{task} ({first['modality']}, {first['capability']}; primary metric {metric})"
        parts.append(details(title, body))
    return "".join(parts) or paragraph("No unit finished ok.")


def about() -> str:
    """The definitions of every derived number."""
    return definitions(ABOUT)
