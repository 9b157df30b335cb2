"""The Markdown summary (for CI logs and pull requests) of a run report; text is escaped by
:mod:`reports.render.markdown`."""

from __future__ import annotations

from reports import formatting as f
from reports.analysis import Analysis
from reports.load import Run
from reports.pareto import FAILED
from reports.render.markdown import cell, code, md_table
from reports.skips import group_skips


def retention_summary(a: Analysis) -> str:
    """One line: which retention the report uses and, with a random baseline, the tasks at chance."""
    line = f"**Retention:** {cell(a.retention_text)}."
    if a.baseline:
        gone = a.at_chance
        if len(gone):
            line += (
                f" Tasks at chance (full model not significantly above random; left out of modality "
                f"averages): {', '.join(code(t) for t in gone['task'])}."
            )
        else:
            line += " Every task's full model is significantly above random."
    return line


def report_summary(run: Run, a: Analysis, html_path: str) -> str:
    """The Markdown summary of a run report."""
    m = run.manifest
    counts = run.units["status"].value_counts()
    out = [
        f"# Sweep report: {cell(run.name)}",
        "",
        f"Suite {code(m.get('suite', '?'))}, checkpoint {code(m.get('checkpoint', '?'))}, "
        f"git {code(str(m.get('git_hash', '?'))[:12])}. Units: {counts.get('ok', 0)} ok, "
        f"{counts.get('skipped', 0)} skipped, {counts.get('error', 0)} failed. "
        f"Full report: {code(html_path)}.",
        "",
        retention_summary(a),
        "",
    ]
    if len(a.degradation):
        d = a.degradation.iloc[0]
        where = (
            f"below 95% at {code(d['crosses_at'])}"
            if d["crosses_at"]
            else f"never below 95%; lowest at {code(d['smallest'])}"
        )
        out += [
            f"**Degrades first:** {cell(d['modality'])} ({where}; order: "
            f"{', '.join(cell(x) for x in a.degradation['modality'])}).",
            "",
        ]
    if len(a.by_modality):
        wide = a.by_modality.pivot_table(index="subnet", columns="group", values="rel", aggfunc="first")
        wide = wide.reindex([s for s in a.order if s in wide.index])
        idx = a.seesaw_index.set_index("subnet")
        wide["seesaw_index"] = [idx["seesaw_index"].get(s) for s in wide.index]
        agg = a.aggregate.set_index("subnet")["score"]
        wide["aggregate"] = [agg.get(s) for s in wide.index]
        out += [
            "## Retention vs full (per modality)",
            "",
            md_table(wide.reset_index(), {**{c: f.pct for c in wide.columns}, "seesaw_index": f.pts}),
        ]
    if a.pareto is not None:
        front = a.pareto[a.pareto["front_active_params"]]["subnet"].tolist()
        out += [
            f"**Pareto frontier (score vs active params):** {', '.join(cell(s) for s in front) or 'none'}.",
            "",
        ]
    if a.operating_points is not None and len(a.operating_points):
        ops = a.operating_points
        pts = ops[["point", "subnet", "score", "active_pct", "total_pct"]].assign(
            speedup=[
                FAILED if failed else f.num(x, 2) + "x"
                for x, failed in zip(ops["speedup"], ops["speedup_failed"])
            ]
        )
        out += [
            "## Operating points",
            "",
            md_table(pts, {"score": f.pct, "active_pct": f.pct, "total_pct": f.pct}),
        ]
    if a.efficiency is not None and a.efficiency["timing_failed"].any():
        bad = a.efficiency[a.efficiency["timing_failed"]]
        out += [
            f"**Speed {FAILED}:** "
            + "; ".join(f"{cell(s)} ({cell(r)})" for s, r in zip(bad["subnet"], bad["reason"]))
            + ".",
            "",
        ]
    skips = group_skips(run.units, a.order)
    if len(skips):
        out += ["## Skipped units, by reason", "", md_table(skips)]
    bad = run.units[~run.units["status"].isin(["ok", "skipped"])][["subnet", "task", "reason"]]
    if len(bad):
        out += ["## Failed units", "", md_table(bad)]
    return "\n".join(out)
