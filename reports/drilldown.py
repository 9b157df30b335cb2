"""The page-only sections of a run report as :mod:`reports.render` blocks: the routing analysis (the
paper's Figures 8-10) and the per-task drill-down (every metric, a few sample predictions)."""

from __future__ import annotations

import pandas as pd

from reports import formatting as f
from reports import plots, routing
from reports.analysis import Analysis
from reports.load import Run, read_samples
from reports.paired import CORPUS_SCALE
from reports.render.document import Block, Details, Figure, Heading, Table, Text

N_SAMPLES = 3
"""Sample predictions shown per task."""


def routing_section(run: Run, a: Analysis) -> tuple[Block, ...]:
    """Figures 8-10 of the paper for the reference subnet's recorded routing."""
    if not a.routing:
        return (Text("This run recorded no routing statistics (routing/<subnet>.json)."),)
    rec = run.routing[a.routing_subnet]
    layers = routing.key_layers(routing.layers_of(rec))
    blocks: list[Block] = [
        Text(
            f"Routing of subnet {a.routing_subnet} ({rec['n_experts']} routed experts; MoE layers "
            f"{', '.join(map(str, routing.layers_of(rec)))})."
        ),
        Figure(
            plots.frequency_plot(a.routing["routing_frequency"], layers),
            "Expert activation frequency",
            "Share of each modality's routed tokens per expert (paper Fig. 8).",
        ),
    ]
    for by in ("modality", "task"):
        ious = a.routing[f"routing_iou_{by}"]
        if ious["a"].nunique() < 2:
            blocks.append(Text(f"No IoU between {by}s: the routing record has only one {by}."))
            continue
        caption = f"IoU of the top-25% most activated experts between {by}s (paper Fig. 9)."
        blocks.append(Figure(plots.iou_plot(ious, layers), f"Top-25% expert IoU by {by}", caption))
    blocks.append(
        Figure(
            plots.entropy_plot(a.routing["routing_entropy"]),
            "Normalised routing entropy",
            "Normalised routing entropy per layer and modality (paper Fig. 10).",
        )
    )
    by_subnet = a.routing["routing_entropy_by_subnet"]
    if by_subnet["subnet"].nunique() > 1:
        wide = by_subnet.pivot_table(index="subnet", columns="group", values="mean_entropy").reset_index()
        blocks += [Heading("Mean normalised entropy over layers, per recorded subnet"), Table(wide)]
    return tuple(blocks)


def score_text(metric: str, score) -> str:
    """A per-example score; corpus components ``[num, den]`` shown as their ratio too."""
    if isinstance(score, list) and len(score) == 2 and score[1]:
        ratio = CORPUS_SCALE.get(metric, 1.0) * score[0] / score[1]
        return f"{metric} = {ratio:.3f} ({score[0]:.1f} / {score[1]:g})"
    return f"{metric} = {f.text(score)}"


def sample_rows(run: Run, task: str, metric: str, subnets: list[str]) -> pd.DataFrame:
    """The first :data:`N_SAMPLES` examples of ``task``: prompt, target, and each subnet's prediction
    with its score (the prediction and the score on two lines)."""
    per = {s: {r["id"]: r for r in read_samples(run, s, task)} for s in subnets}
    ids = list(per[subnets[0]])[:N_SAMPLES] if subnets else []
    rows = []
    for i in ids:
        ref = per[subnets[0]][i].get("sample", {})
        row = {"id": i, "prompt": ref.get("prompt", ""), "target": ref.get("target", "")}
        for s in subnets:
            rec = per[s].get(i)
            score = (rec or {}).get("scores", {}).get(metric)
            pred = (rec or {}).get("sample", {}).get("prediction", "") if rec else "(not scored)"
            row[f"{s}: prediction"] = f"{f.text(pred)}\n[{score_text(metric, score)}]"
        rows.append(row)
    return pd.DataFrame(rows)


def drilldown(run: Run, a: Analysis) -> tuple[Block, ...]:
    """Per task: every metric with stderr and n, and a few sample predictions."""
    blocks: list[Block] = []
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
        samples = sample_rows(run, task, metric, subnets)
        body: list[Block] = [
            Table(tab, formats={"value": lambda x: f.num(x, 4), "stderr": lambda x: f.num(x, 4)})
        ]
        if len(samples):
            shown = tuple(c for c in samples.columns if c != "id")
            body += [Heading("Sample predictions"), Table(samples, code=shown)]
        title = f"{task} ({first['modality']}, {first['capability']}; primary metric {metric})"
        blocks.append(Details(title, tuple(body)))
    return tuple(blocks) or (Text("No unit finished ok."),)
