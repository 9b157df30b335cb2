"""An elastic study's report as one :class:`~reports.render.document.Document` (:func:`study_document`):
the tables of :class:`reports.study_folder.StudyReport` (as text, :mod:`reports.study_views`) with the
figures only this report draws; :mod:`reports.render` turns it into ``report.html`` and ``report.md``.

The page carries every section; the Markdown leaves out what is too long for a CI log (every per-task
cell, every unit, routing per layer and its figures, the glossary) and keeps the verdicts, the cost of
elasticity, each shape's rows, the Tables 9-12 analogues, the selection, seesaw and routing summaries.
"""

from __future__ import annotations

import base64
import io
import json
from typing import TYPE_CHECKING

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure as MplFigure
from matplotlib.ticker import PercentFormatter

from reports import formatting as f
from reports import plots, routing, seesaw, study_modality
from reports.render.document import (
    Block,
    Bullets,
    Code,
    Definitions,
    Details,
    Document,
    Figure,
    Heading,
    KeyValues,
    PageOnly,
    Section,
    Table,
    Text,
)
from reports.study_folder import ELASTIC, FAMILIES, STATIC
from reports.study_views import (
    TASK_COLUMNS,
    TASK_FORMATS,
    claim_matrix,
    cost_view,
    dims_view,
    groups_view,
    index_view,
    order_view,
    per_layer,
    routing_view,
    selection_view,
    shape_view,
    units_views,
)

if TYPE_CHECKING:
    from reports.study_folder import StudyReport

TITLE = "Elastic study: one elastic run against static, pruned and recovered models"
LOSS_PLOT = "loss.png"
"""The loss plot's file beside ``report.md``."""
RETENTION_PLOT = "retention.png"
"""The retention-per-family figure's file beside ``report.md``."""
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


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode("ascii")


def _claims(r: StudyReport, pick) -> tuple[str, ...]:
    return tuple(c for c in r.claims if pick(c))


def overview(r: StudyReport) -> tuple[Block, ...]:
    study = r.study
    cfg = study.meta.get("config", {})
    prov = study.meta.get("provenance", {})
    toks = study.meta.get("tokens_per_step", 0) * cfg.get("steps", 0)
    items = (
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
    )
    matrix = claim_matrix(r.claim_rows)
    blocks: list[Block] = [Heading("Verdicts"), Bullets((r.claims[0],), callout=True)]
    if len(matrix):
        blocks += [
            Text(
                "Per shape (loss of the family row minus the elastic row, or importance minus random "
                "selection; paired over the held-out batches, 95 % CI):"
            ),
            Table(matrix, rich=tuple(matrix.columns[1:])),
        ]
    blocks += [
        Bullets(_claims(r, lambda c: c.startswith(("Seesaw, ", "Routing"))), callout=True),
        PageOnly((Details("Every verdict in words", (Bullets(tuple(r.claims)),)),)),
        KeyValues(items),
    ]
    if study.command:
        blocks += [Heading("Command"), Code(study.command)]
    machine = prov.get("machine")
    if machine:
        versions = json.dumps({**machine, **prov.get("versions", {})}, indent=1, sort_keys=True, default=str)
        blocks.append(PageOnly((Details("machine and versions", (Code(versions),)),)))
    return tuple(blocks)


def cost_section(r: StudyReport) -> tuple[Block, ...]:
    return (
        Text(r.claims[0], "callout", rich=True),
        Text(
            f"Goal: ratio within {r.cost['goal']} (the elastic full model's loss within 2 % of the static "
            "one's)."
        ),
        Table(cost_view(r)),
    )


def shapes_section(r: StudyReport, loss_png: bytes) -> tuple[Block, ...]:
    if r.main.empty:
        return (Text("No shape has a row."),)
    blocks: list[Block] = [
        Text(
            "Scores: chance-normalised against the static full model (1 = its score, 0 = its random twin's), "
            "per modality with a 95 % interval. Δloss: paired over the same held-out batches against the "
            "elastic row of the same shape (negative = lower loss than elastic). Decode speed: median "
            "tokens/s with the interquartile range."
        )
    ]
    if loss_png:
        blocks.append(
            Figure(
                _b64(loss_png),
                "Held-out loss per shape and family",
                "Held-out loss per shape, one bar per family.",
                LOSS_PLOT,
            )
        )
    for shape, rows in r.main.groupby("shape", sort=False):
        blocks += [
            Heading(str(shape)),
            Table(shape_view(rows)),
            Bullets(tuple(c for c in r.claims if c.startswith(f"{shape}: "))),
        ]
    return tuple(blocks)


def dims_section(r: StudyReport) -> tuple[Block, ...]:
    return (
        Text(
            "Each elastic sub-model's held-out loss against the elastic full model's, beside the paper's "
            "(ERNIE 5.0 §6.4.2: 16 layers, 64 experts, top-8, 250 B tokens; Table 12 gives the EA point's "
            "parameter shares, not a loss). Shares: of the elastic full model's active and total parameters."
        ),
        Table(dims_view(r.dims)),
    )


def selection_section(r: StudyReport) -> tuple[Block, ...]:
    if r.selection.empty:
        return (Text("No selection rows."),)
    return (
        Bullets(_claims(r, lambda c: "selection (loss difference" in c)),
        Table(
            selection_view(r.selection),
            headers={"same_as": "same sub-model as", "mean_score": "mean score", "val_loss": "held-out loss"},
        ),
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
    fig = MplFigure(figsize=(plots.WIDTH + 2.0, 4.4))
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


def seesaw_section(r: StudyReport) -> tuple[Block, ...]:
    if r.seesaw_groups.empty:
        return (Text("No family has two rows with scores."),)
    by = r.seesaw_by
    blocks: list[Block] = [
        Bullets(_claims(r, lambda c: c.startswith("Seesaw, ")), callout=True),
        Text(
            f"Grouped by {by}. Retention against the static full model; the elastic family's "
            "full row is the elastic full model (its retention includes the cost of elasticity)."
        ),
        Figure(
            _b64(family_retention(r)),
            f"Retention per {by} in each family",
            f"Each panel is a family, its rows from the most to the fewest active parameters; one line per "
            f"{by} with its 95 % interval.",
            RETENTION_PLOT,
        ),
    ]
    if r.seesaw_index["seesaw_index"].notna().any():
        blocks += [Heading("Seesaw index per family row"), Table(index_view(r.seesaw_index))]
    else:
        blocks.append(Text(f"No seesaw index: it needs two {by} groups above chance."))
    return (
        *blocks,
        Heading(f"Score per {by} (95% interval)"),
        Table(groups_view(r.seesaw_groups)),
        Heading("Degradation order per family"),
        Table(
            order_view(r.seesaw_order),
            formats={"rel_at_crossing": f.pct, "rel_at_smallest": f.pct},
            headers={"crosses_at": "below 95 % at", "rel_at_crossing": "score there"},
        ),
    )


def routing_figures(r: StudyReport, arm: str) -> tuple[Block, ...]:
    """The frequency, IoU and entropy figures of ``arm``'s full model (none without its record)."""
    run = r.study.runs.get(arm)
    rec = run.routing.get("full") if run is not None else None
    if rec is None:
        return ()
    layers = routing.key_layers(routing.layers_of(rec))
    blocks: list[Block] = [
        Heading(f"{arm} full model"),
        Figure(
            plots.frequency_plot(routing.frequency_table(rec, "modality"), layers),
            f"Expert activation frequency, {arm} full model",
            "Share of each modality's routed tokens per expert (paper Fig. 8).",
        ),
    ]
    ious = routing.iou_table(rec, "modality")
    if ious["a"].nunique() > 1:
        blocks.append(
            Figure(
                plots.iou_plot(ious, layers),
                f"Top-25% expert IoU by modality, {arm} full model",
                "IoU of the top-25% most activated experts between modalities (paper Fig. 9).",
            )
        )
    else:
        blocks.append(Text("One modality: no IoU between modalities (see the per-task IoU in the tables)."))
    blocks.append(
        Figure(
            plots.entropy_plot(routing.entropy_table(rec, "modality")),
            f"Normalised routing entropy, {arm} full model",
            "Normalised routing entropy per layer and modality (paper Fig. 10).",
        )
    )
    return tuple(blocks)


def routing_section(r: StudyReport) -> tuple[Block, ...]:
    if r.routing_rows.empty:
        return (Text("The sweeps recorded no routing statistics (routing/<subnet>.json)."),)
    blocks: list[Block] = [
        Bullets(_claims(r, lambda c: c.startswith("Routing")), callout=True),
        Heading("By family row"),
        Text(
            "Normalised entropy per modality (mean over MoE layers), top-25 % IoU between modalities (mean "
            "over layers and pairs, and in the last layer), the last layer's most separated and most shared "
            "pair, the share of (layer, expert) pairs that receive any token."
        ),
        Table(routing_view(r.routing_rows)),
    ]
    page: list[Block] = []
    if len(r.routing_iou):
        iou = r.routing_iou.assign(pair=r.routing_iou["a"] + " / " + r.routing_iou["b"])
        wide = per_layer(iou, ["family", "row", "pair"], "iou")
        page.append(Details("Top-25 % IoU between modalities per layer", (Table(wide),)))
    if len(r.routing_entropy):
        ent = per_layer(r.routing_entropy, ["family", "row", "group"], "entropy")
        page.append(
            Details(
                "Normalised entropy per modality and layer",
                (Table(ent.rename(columns={"group": "modality"})),),
            )
        )
    page += routing_figures(r, ELASTIC) or routing_figures(r, STATIC)
    blocks.append(PageOnly(tuple(page)))
    if len(r.routing):
        blocks.append(
            Details(
                "Every sub-model of the elastic and static sweeps (selections too)",
                (
                    Text(
                        "Mean normalised entropy over layers and tasks; mean top-25 % IoU between tasks "
                        "and between modalities."
                    ),
                    Table(r.routing),
                ),
            )
        )
    return tuple(blocks)


def tasks_section(r: StudyReport) -> tuple[Block, ...]:
    cells = r.cells
    if cells.empty:
        return (Text("No per-task pairs (the sweeps share no examples)."),)
    view = cells[TASK_COLUMNS]
    sig = view[cells["verdict"].isin(["regression", "improvement"]).to_numpy()]
    counts = cells["verdict"].value_counts()
    return (
        Text(
            f"{len(cells)} cells (row minus the elastic row of its shape, raw metric direction): "
            f"{counts.get('improvement', 0)} improvements and {counts.get('regression', 0)} regressions "
            "of the row against elastic after Holm's adjustment."
        ),
        Heading("Significant cells"),
        Table(sig, formats=TASK_FORMATS, badges=("verdict",)),
        PageOnly((Details("Every cell", (Table(view, formats=TASK_FORMATS, badges=("verdict",)),)),)),
    )


def units_section(r: StudyReport) -> tuple[Block, ...]:
    every, kinds = units_views(r)
    seconds = {"wall_s": lambda x: f.num(x, 1)}
    blocks: list[Block] = [Text(f"Units' wall time: {r.wall_s / 60:.1f} min in all.", "lead")]
    if r.study.command:
        blocks.append(Code(r.study.command))
    if len(kinds):
        blocks += [
            Table(kinds, formats=seconds),
            PageOnly((Details("Every unit", (Table(every, formats=seconds),)),)),
        ]
    return tuple(blocks)


def study_document(r: StudyReport, loss_png: bytes) -> Document:
    """The study report as one document; ``loss_png``: the loss plot's PNG bytes (b"" for none)."""
    study = r.study
    cfg = study.meta.get("config", {})
    subtitle = (
        f"Study {study.root.name} | base {cfg.get('base', '?')} | shapes {', '.join(study.shapes)} | "
        f"suite {cfg.get('suite', '?')} | finished {study.meta.get('provenance', {}).get('time', '?')}"
    )
    return Document(
        TITLE,
        subtitle,
        (
            Section("overview", "Overview and verdicts", overview(r)),
            Section("cost", "Cost of elasticity", cost_section(r)),
            Section(
                "shapes",
                "Each shape: elastic, static, pruned, pruned + recovery",
                shapes_section(r, loss_png),
            ),
            Section("tables", "Tables 9-12 analogues", dims_section(r)),
            Section("selection", "Random vs importance selection", selection_section(r)),
            Section("seesaw", "Seesaw per family", seesaw_section(r)),
            Section("routing", "Routing by modality", routing_section(r)),
            Section("tasks", "Per-task paired tests", tasks_section(r)),
            Section("units", "Run time and command", units_section(r)),
            Section("about", "About these numbers", (Definitions(ABOUT),), markdown=False),
        ),
    )
