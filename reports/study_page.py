"""An elastic study's ``report.html``: the tables of :class:`reports.study_folder.StudyReport` with
their figures, on the run report's page machinery (:mod:`reports.html`, :mod:`reports.plots`).

Over 500 lines for one reason: one page's sections and the figures only it draws; not yet on
:mod:`reports.render` (compare is), which is where they go.

Self-contained like ``ernie5 report``'s ``index.html``: figures embedded as ``data:`` PNGs, CSS inline,
the page's Content-Security-Policy allows nothing else; every piece of text goes through
:func:`reports.html.esc`.
"""

from __future__ import annotations

import base64
import io
import json
import re
from typing import TYPE_CHECKING

import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from reports import formatting as f
from reports import plots, routing, seesaw, study_modality
from reports.html import badge, definitions, details, esc, figure, key_values, page, paragraph, pre, table
from reports.study_folder import ELASTIC, FAMILIES, STATIC
from reports.study_markdown import decode_text, delta_text, groups_view, index_view, modalities, order_view

if TYPE_CHECKING:
    from reports.study_folder import StudyReport

DECISIONS = {
    "holds": "b-ok",
    "does not hold": "b-regression",
    "inconclusive": "b-nochange",
    "importance better": "b-compared",
    "random better": "b-compared",
    "no difference": "b-nochange",
    "not measured": "b-na",
}
ABOUT = (
    (
        "Held-out loss",
        "Mean next-token loss (nats/token) on the study's fixed validation batches; every model sees the "
        "same batches, so two rows' losses are paired batch by batch.",
    ),
    (
        "Δloss [95% CI]",
        "Mean paired difference (row minus elastic row, or minus the default selection) with a paired "
        "bootstrap interval over the batches. Negative: the row's loss is lower (better) than the "
        "elastic one.",
    ),
    (
        "Cost of elasticity",
        "Elastic full model's loss / static full model's loss with a paired bootstrap interval; the "
        "paper's implied goal is a ratio within 1.02.",
    ),
    (
        "Score per modality",
        "Chance-normalised retention against the static full model (1 = its score, 0 = its random twin's), "
        "averaged over the modality's tasks the static full model answers above chance; the interval "
        "propagates the per-task standard errors (the harness's group score).",
    ),
    (
        "Seesaw index",
        "Max minus min of a row's per-modality scores; its interval is that of the best-minus-worst "
        "difference (it does not account for picking the pair after the fact).",
    ),
    (
        "Gives way first",
        "Walking a family's rows from the most to the fewest active parameters, the first modality whose "
        "score falls below 95 % retention (ties: the lower score).",
    ),
    (
        "Routing",
        "Activation frequency: share of a modality's routed tokens per expert. Top-25 % IoU: overlap of "
        "two modalities' most activated quarter of experts (1 same, 0 disjoint). Normalised entropy: "
        "1 = tokens spread evenly over all experts, 0 = one expert.",
    ),
    (
        "Per-task tests",
        "Each task's primary metric of a row against the elastic row of the same shape on the same "
        "examples (McNemar for 0/1 metrics, paired bootstrap otherwise), Holm-adjusted over every cell.",
    ),
)


def rich(text: str) -> str:
    """A verdict line as HTML: escaped, its ``**decision**`` as a coloured label (bold otherwise)."""

    def mark(m: re.Match) -> str:
        word = m.group(1)
        cls = DECISIONS.get(word)
        return f'<span class="badge {cls}">{word}</span>' if cls else f"<strong>{word}</strong>"

    return re.sub(r"\*\*(.+?)\*\*", mark, esc(text))


def _list(items: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{rich(i)}</li>" for i in items) + "</ul>" if items else ""


def _figure(png: bytes, alt: str, caption: str) -> str:
    return figure(base64.b64encode(png).decode("ascii"), alt, caption) if png else ""


def claim_matrix(claims: pd.DataFrame) -> str:
    """Shapes x claims: each cell the decision's label over the loss difference and its interval."""
    if claims.empty:
        return ""
    cell = [
        f'{rich(f"**{w}**")}<br><span class="muted">{esc(f.signed(d))} {esc(f.ci(lo, hi, f.signed))}</span>'
        for w, d, lo, hi in zip(claims["decision"], claims["delta"], claims["ci_low"], claims["ci_high"])
    ]
    wide = claims.assign(cell=cell).pivot_table(
        index="shape", columns="claim", values="cell", aggfunc="first", sort=False
    )
    wide = wide.reindex(columns=list(dict.fromkeys(claims["claim"]))).fillna(esc("-"))
    wide.insert(0, "shape", [esc(s) for s in wide.index])
    return paragraph(
        "Per shape (loss of the family row minus the elastic row, or importance minus random "
        "selection; paired over the held-out batches, 95 % CI):"
    ) + table(wide.reset_index(drop=True), raw=wide.columns)


def overview(r: StudyReport) -> str:
    study = r.study
    cfg = study.meta.get("config", {})
    prov = study.meta.get("provenance", {})
    toks = study.meta.get("tokens_per_step", 0) * cfg.get("steps", 0)
    items = [
        ("base config", cfg.get("base")),
        ("overrides", ", ".join(cfg.get("overrides", [])) or "none"),
        ("tokens per from-scratch model", f"{cfg.get('steps')} steps = {toks:,} tokens"),
        (
            "recovery fine-tune",
            f"{cfg.get('recovery_steps')} steps = {study.meta.get('recovery_tokens', 0):,} more tokens",
        ),
        ("shapes", ", ".join(study.shapes)),
        ("suite", cfg.get("suite")),
        ("held-out loss", f"{cfg.get('val_batches')} fixed batches"),
        ("units' wall time", f"{r.wall_s / 60:.1f} min ({len(study.meta.get('units', {}))} units)"),
        ("finished", prov.get("time", "n/a")),
        ("git", f"{prov.get('git_hash', 'n/a')}{' (dirty)' if prov.get('git_dirty') else ''}"),
    ]
    words = [c for c in r.claims if c.startswith(("Seesaw, ", "Routing"))]
    parts = [
        '<div class="callout"><strong>Verdicts</strong>'
        + _list([r.claims[0]])
        + claim_matrix(r.claim_rows)
        + _list(words)
        + "</div>",
        details("Every verdict in words", _list(r.claims)),
        key_values(items),
    ]
    if study.command:
        parts.append("<h3>Command</h3>" + pre(study.command))
    machine = prov.get("machine")
    if machine:
        versions = json.dumps({**machine, **prov.get("versions", {})}, indent=1, sort_keys=True, default=str)
        parts.append(details("machine and versions", pre(versions)))
    return "".join(parts)


def cost_section(r: StudyReport) -> str:
    c = r.cost
    rows = [
        {
            "model": "this study",
            "static loss": f.num(c.get("static_loss")),
            "elastic loss": f.num(c.get("elastic_loss")),
            "ratio": f.num(c["ratio"], 4),
            "95% CI": f.ci(c["ci_low"], c["ci_high"], lambda x: f.num(x, 4)),
        }
    ] + [
        {
            "model": f"paper, {p.paper}",
            "static loss": f.num(p.static_loss),
            "elastic loss": f.num(p.elastic_loss),
            "ratio": f.num(p.ratio, 4),
            "95% CI": "not reported",
        }
        for p in r.paper_cost.itertuples(index=False)
    ]
    return (
        '<div class="callout">'
        + rich(r.claims[0])
        + "</div>"
        + paragraph(
            f"Goal: ratio within {c['goal']} (the elastic full model's loss within 2 % of the static one's)."
        )
        + table(pd.DataFrame(rows))
    )


def shapes_section(r: StudyReport, loss_png: bytes) -> str:
    if r.main.empty:
        return paragraph("No shape has a row.")
    parts = [
        paragraph(
            "Scores: chance-normalised against the static full model (1 = its score, 0 = its random twin's), "
            "per modality with a 95 % interval. Δloss: paired over the same held-out batches against the "
            "elastic row of the same shape (negative = lower loss than elastic). Decode speed: median "
            "tokens/s with the interquartile range."
        ),
        _figure(
            loss_png, "Held-out loss per shape and family", "Held-out loss per shape, one bar per family."
        ),
    ]
    for shape, rows in r.main.groupby("shape", sort=False):
        view = pd.DataFrame(
            {
                "family": rows["family"],
                "tokens": [f.si(x) for x in rows["tokens"]],
                "held-out loss": [f.num(x) for x in rows["val_loss"]],
                "Δloss vs elastic [95% CI]": [
                    delta_text(d, lo, hi) or "(reference)"
                    for d, lo, hi in zip(
                        rows["d_loss_vs_elastic"], rows["d_loss_ci_low"], rows["d_loss_ci_high"]
                    )
                ],
            }
        )
        for m in modalities(r.main):
            view[f"{m} score [95% CI]"] = [
                f.NA if pd.isna(x) else f"{f.num(x)} {f.ci(lo, hi, f.num)}"
                for x, lo, hi in zip(
                    rows[f"score_{m}"], rows[f"score_{m}_ci_low"], rows[f"score_{m}_ci_high"]
                )
            ]
        view["active params"] = [f.si(x) for x in rows.get("active_params", [None] * len(rows))]
        view["total params"] = [f.si(x) for x in rows.get("total_params", [None] * len(rows))]
        view["decode tok/s [IQR]"] = [decode_text(x) for _, x in rows.iterrows()]
        claims = [c for c in r.claims if c.startswith(f"{shape}: ")]
        parts.append(f"<h3>{esc(shape)}</h3>" + table(view) + _list(claims))
    return "".join(parts)


def dims_section(r: StudyReport) -> str:
    d = r.dims
    view = pd.DataFrame(
        {
            "shape": d["shape"],
            "active share": [f.pct(x) for x in d["active_share"]],
            "total share": [f.pct(x) for x in d["total_share"]],
            "elastic full -> sub-model loss": [
                f"{f.num(a)} -> {f.num(b)}" for a, b in zip(d["elastic_full_loss"], d["elastic_sub_loss"])
            ],
            "loss increase": [f.signed_pct(x) for x in d["increase"]],
            "paper's row": [x or "-" for x in d["paper_row"]],
            "paper: full -> sub-model loss": [
                "-" if pd.isna(a) else f"{f.num(a)} -> {f.num(b)}"
                for a, b in zip(d["paper_full_loss"], d["paper_sub_loss"])
            ],
            "paper: loss increase": ["-" if pd.isna(x) else f.signed_pct(x) for x in d["paper_increase"]],
            "paper: active / total share": [
                "-" if pd.isna(a) else f"{f.pct(a)} / {f.pct(b)}"
                for a, b in zip(d["paper_active_share"], d["paper_total_share"])
            ],
        }
    )
    return paragraph(
        "Each elastic sub-model's held-out loss against the elastic full model's, beside the paper's "
        "(ERNIE 5.0 §6.4.2: 16 layers, 64 experts, top-8, 250 B tokens; Table 12 gives the EA point's "
        "parameter shares, not a loss). Shares: of the elastic full model's active and total parameters."
    ) + table(view)


def selection_section(r: StudyReport) -> str:
    sel = r.selection
    if sel.empty:
        return paragraph("No selection rows.")
    view = sel.assign(
        **{
            "Δloss vs default [95% CI]": [
                delta_text(d, lo, hi)
                for d, lo, hi in zip(sel["d_loss_vs_default"], sel["ci_low"], sel["ci_high"])
            ]
        }
    ).drop(columns=["d_loss_vs_default", "ci_low", "ci_high"])
    claims = [c for c in r.claims if "selection (loss difference" in c]
    return _list(claims) + table(
        view,
        headers={"same_as": "same sub-model as", "mean_score": "mean score", "val_loss": "held-out loss"},
    )


def family_retention(r: StudyReport) -> bytes:
    """PNG bytes: one panel per family (shared y axis), each group's retention along the family's
    rows from the most to the fewest active parameters, with 95 % intervals."""
    families = [x for x in FAMILIES if x in set(r.seesaw_groups["family"])]
    names = sorted(dict.fromkeys(r.seesaw_groups["group"]), key=study_modality.group_key)
    palette = colormaps["tab10"].colors
    color = {
        g: plots.color_of(g) if plots.color_of(g) != plots.color_of("") else palette[i % 10]
        for i, g in enumerate(names)
    }
    fig = Figure(figsize=(plots.WIDTH + 2.0, 4.4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(families), sharey=True, squeeze=False)[0]
    for ax, family in zip(axes, families):
        g = r.seesaw_groups[r.seesaw_groups["family"] == family]
        rows = {n: s for n, s in r.study.family_rows(family).items() if s in set(g["subnet"])}
        active = study_modality.family_active(r.study, rows)
        order = seesaw.subnet_order(g, active)
        x_of = {s: i for i, s in enumerate(order)}
        plots.retention_lines(ax, g, names, x_of, color, spread=0.07, capsize=2, lw=1.6)
        ax.axhline(1.0, color="#444", lw=0.8)
        ax.axhline(seesaw.RETENTION_THRESHOLD, color="#999", lw=0.8, ls="--")
        full = (active or {}).get("full")
        labels = [f"{s} ({100 * active[s] / full:.0f}%)" if active and full else s for s in order]
        ax.set_xticks(range(len(order)), labels, fontsize=8, rotation=30, ha="right")
        ax.set_title(f"{family}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].yaxis.set_major_formatter(PercentFormatter(1.0))
    axes[0].set_ylabel(f"Retention vs static full ({r.seesaw_by})")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="upper center", ncol=min(len(names), 6), fontsize=9, bbox_to_anchor=(0.5, 1.0)
    )
    fig.suptitle(
        "Retention per family as it shrinks (x: rows, % of the full model's active params; dashed: 95 %)",
        y=1.07,
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=plots.DPI, bbox_inches="tight")
    return buf.getvalue()


def seesaw_section(r: StudyReport) -> str:
    if r.seesaw_groups.empty:
        return paragraph("No family has two rows with scores.")
    words = [c for c in r.claims if c.startswith("Seesaw, ")]
    parts = [
        '<div class="callout">' + _list(words) + "</div>",
        paragraph(
            f"Grouped by {r.seesaw_by}. Retention against the static full model; the elastic family's "
            "full row is the elastic full model (its retention includes the cost of elasticity)."
        ),
    ]
    parts.append(
        _figure(
            family_retention(r),
            f"Retention per {r.seesaw_by} in each family",
            f"Each panel is a family, its rows from the most to the fewest active parameters; one line per "
            f"{r.seesaw_by} with its 95 % interval.",
        )
    )
    if r.seesaw_index["seesaw_index"].notna().any():
        parts.append("<h3>Seesaw index per family row</h3>" + table(index_view(r.seesaw_index)))
    else:
        parts.append(paragraph(f"No seesaw index: it needs two {r.seesaw_by} groups above chance."))
    parts.append(
        f"<h3>Score per {esc(r.seesaw_by)} (95% interval)</h3>" + table(groups_view(r.seesaw_groups))
    )
    parts.append(
        "<h3>Degradation order per family</h3>"
        + table(
            order_view(r.seesaw_order),
            formats={"rel_at_crossing": f.pct, "rel_at_smallest": f.pct},
            headers={"crosses_at": "below 95 % at", "rel_at_crossing": "score there"},
        )
    )
    return "".join(parts)


def _routing_figures(r: StudyReport, arm: str) -> str:
    run = r.study.runs.get(arm)
    rec = run.routing.get("full") if run is not None else None
    if rec is None:
        return ""
    layers = routing.key_layers(routing.layers_of(rec))
    parts = [
        figure(
            plots.frequency_plot(routing.frequency_table(rec, "modality"), layers),
            f"Expert activation frequency, {arm} full model",
            "Share of each modality's routed tokens per expert (paper Fig. 8).",
        )
    ]
    ious = routing.iou_table(rec, "modality")
    if ious["a"].nunique() > 1:
        parts.append(
            figure(
                plots.iou_plot(ious, layers),
                f"Top-25% expert IoU by modality, {arm} full model",
                "IoU of the top-25% most activated experts between modalities (paper Fig. 9).",
            )
        )
    else:
        parts.append(
            paragraph("One modality: no IoU between modalities (see the per-task IoU in the tables).")
        )
    parts.append(
        figure(
            plots.entropy_plot(routing.entropy_table(rec, "modality")),
            f"Normalised routing entropy, {arm} full model",
            "Normalised routing entropy per layer and modality (paper Fig. 10).",
        )
    )
    return f"<h3>{esc(arm)} full model</h3>" + "".join(parts)


def routing_view(rows: pd.DataFrame) -> pd.DataFrame:
    """The routing summary per family row as text, one column per modality's entropy."""
    ents = [c for c in rows.columns if c.startswith("entropy_")]
    view = rows[["family", "row"]].copy()
    for c in ents:
        view[f"entropy {c.removeprefix('entropy_')}"] = [f.num(x, 2) for x in rows[c]]
    if rows["most_separated"].astype(bool).any():
        view["IoU between modalities: mean / last layer"] = [
            f"{f.num(a, 2)} / {f.num(b, 2)}" for a, b in zip(rows["iou_modality"], rows["iou_last_layer"])
        ]
        for k in ("most_separated", "most_shared"):
            view[f"last layer: {k.replace('_', ' ')} (IoU)"] = [
                f"{p} ({f.num(v, 2)})" for p, v in zip(rows[k], rows[f"{k}_iou"])
            ]
    view["experts used"] = [f.pct(x) for x in rows["experts_used"]]
    return view


def routing_section(r: StudyReport) -> str:
    if r.routing_rows.empty:
        return paragraph("The sweeps recorded no routing statistics (routing/<subnet>.json).")
    words = [c for c in r.claims if c.startswith("Routing")]
    rows = routing_view(r.routing_rows)
    parts = [
        '<div class="callout">' + _list(words) + "</div>",
        "<h3>By family row</h3>"
        + paragraph(
            "Normalised entropy per modality (mean over MoE layers), top-25 % IoU between modalities (mean "
            "over layers and pairs, and in the last layer), the last layer's most separated and most shared "
            "pair, the share of (layer, expert) pairs that receive any token."
        )
        + table(rows),
    ]
    if len(r.routing_iou):
        iou = r.routing_iou.assign(pair=r.routing_iou["a"] + " / " + r.routing_iou["b"])
        wide = iou.pivot_table(
            index=["family", "row", "pair"], columns="layer", values="iou", aggfunc="first", sort=False
        )
        wide.columns = [f"layer {c}" for c in wide.columns]
        parts.append(details("Top-25 % IoU between modalities per layer", table(wide.reset_index())))
    if len(r.routing_entropy):
        ent = r.routing_entropy.pivot_table(
            index=["family", "row", "group"], columns="layer", values="entropy", aggfunc="first", sort=False
        )
        ent.columns = [f"layer {c}" for c in ent.columns]
        parts.append(
            details(
                "Normalised entropy per modality and layer",
                table(ent.reset_index().rename(columns={"group": "modality"})),
            )
        )
    parts.append(_routing_figures(r, ELASTIC) or _routing_figures(r, STATIC))
    if len(r.routing):
        parts.append(
            details(
                "Every sub-model of the elastic and static sweeps (selections too)",
                paragraph(
                    "Mean normalised entropy over layers and tasks; mean top-25 % IoU between tasks "
                    "and between modalities."
                )
                + table(r.routing),
            )
        )
    return "".join(parts)


def tasks_section(r: StudyReport) -> str:
    cells = r.cells
    if cells.empty:
        return paragraph("No per-task pairs (the sweeps share no examples).")
    view = cells[
        [
            "shape",
            "family",
            "task",
            "metric",
            "n",
            "delta",
            "ci_low",
            "ci_high",
            "p_value",
            "p_adjusted",
            "verdict",
        ]
    ]
    view = view.assign(
        verdict=[badge(v) for v in view["verdict"]],
        **{c: [esc(x) for x in view[c]] for c in ("shape", "family", "task", "metric")},
        **{c: [esc(f.signed(x)) for x in view[c]] for c in ("delta", "ci_low", "ci_high")},
        **{c: [esc(f.pvalue(x)) for x in view[c]] for c in ("p_value", "p_adjusted")},
        n=[esc(x) for x in view["n"]],
    )
    sig = view[cells["verdict"].isin(["regression", "improvement"]).to_numpy()]
    counts = cells["verdict"].value_counts()
    head = paragraph(
        f"{len(cells)} cells (row minus the elastic row of its shape, raw metric direction): "
        f"{counts.get('improvement', 0)} improvements and {counts.get('regression', 0)} regressions "
        "of the row against elastic after Holm's adjustment."
    )
    body = "<h3>Significant cells</h3>" + (table(sig, raw=sig.columns) if len(sig) else paragraph("None."))
    return head + body + details("Every cell", table(view, raw=view.columns))


def units_section(r: StudyReport) -> str:
    units = r.study.meta.get("units", {})
    df = pd.DataFrame([{"unit": k, "wall_s": v.get("wall_s")} for k, v in units.items()])
    kinds = (
        df.assign(kind=df["unit"].str.split("/").str[0])
        .groupby("kind", sort=False)["wall_s"]
        .sum()
        .reset_index()
        if len(df)
        else df
    )
    return (
        paragraph(f"Units' wall time: {r.wall_s / 60:.1f} min in all.", "lead")
        + (pre(r.study.command) if r.study.command else "")
        + (table(kinds, formats={"wall_s": lambda x: f.num(x, 1)}) if len(kinds) else "")
        + (details("Every unit", table(df, formats={"wall_s": lambda x: f.num(x, 1)})) if len(df) else "")
    )


def render(r: StudyReport, loss_png: bytes) -> str:
    """The HTML page of a study report; ``loss_png``: the loss plot's PNG bytes (b"" for none)."""
    study = r.study
    cfg = study.meta.get("config", {})
    subtitle = (
        f"Study {study.root.name} | base {cfg.get('base', '?')} | shapes {', '.join(study.shapes)} | "
        f"suite {cfg.get('suite', '?')} | finished {study.meta.get('provenance', {}).get('time', '?')}"
    )
    body = [
        ("overview", "Overview and verdicts", overview(r)),
        ("cost", "Cost of elasticity", cost_section(r)),
        ("shapes", "Each shape: elastic, static, pruned, pruned + recovery", shapes_section(r, loss_png)),
        ("tables", "Tables 9-12 analogues", dims_section(r)),
        ("selection", "Random vs importance selection", selection_section(r)),
        ("seesaw", "Seesaw per family", seesaw_section(r)),
        ("routing", "Routing by modality", routing_section(r)),
        ("tasks", "Per-task paired tests", tasks_section(r)),
        ("units", "Run time and command", units_section(r)),
        ("about", "About these numbers", definitions(ABOUT)),
    ]
    return page("Elastic study: one elastic run against static, pruned and recovered models", subtitle, body)
