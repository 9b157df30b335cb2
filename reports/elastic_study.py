"""An elastic study folder -> ``report.md``, ``report.html``, ``summary.json``, ``loss.png`` and
``retention.png``.

Reads only what ``ernie5 study elastic`` wrote (``study.json``, ``loss/<arm>.json``, the sweep run
folders under ``sweeps/``; :class:`reports.study_folder.Study`). For each studied shape it puts four
rows side by side:

* **elastic**: the elastic model's sub-model (``sweeps/elastic``, subnet = the shape);
* **static**: a model of that exact shape trained from scratch on the same tokens
  (``sweeps/static-<shape>``, its full model);
* **pruned**: the static full model sliced to the shape by the same deploy selection
  (``sweeps/static``, subnet = the shape; slicing is exact, so the masked sub-model is the pruned model);
* **pruned+rec**: the pruned model after the recovery fine-tune (``sweeps/recover-<shape>``).

Scores are chance-normalised against one reference for every row, the static full model and its
random twin (:func:`reports.study_folder.relative`), so rows of different checkpoints compare on one
scale; a modality's score is the harness's group score (mean over its tasks that the static full
model answers above chance, with a propagated 95 % interval). Paired statistics: the held-out loss of
two rows on the same fixed batches (paired bootstrap of the mean difference,
:func:`reports.paired.paired_test`), and every task's primary metric on the same examples (McNemar or
paired bootstrap), Holm-adjusted over all task cells of the report. The cost of elasticity is the
ratio of the elastic and static full models' held-out losses with a paired bootstrap interval, against
the paper's implied goal (within 2 %). The seesaw per family and routing by modality are
:mod:`reports.study_modality`; the report (page and Markdown, one document) is
:func:`reports.study_report.study_document`.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ernie5.store.runs import write_atomic, write_json
from reports import formatting as f
from reports import paired, scores, seesaw, study_modality
from reports.load import read_samples
from reports.render.files import write_figures
from reports.render.html import to_html
from reports.render.markdown import to_markdown
from reports.study_folder import ELASTIC, FAMILIES, STATIC, Study, StudyReport, relative
from reports.study_report import study_document

__all__ = ["FAMILIES", "Study", "StudyReport", "analyze_study", "ratio_ci", "write_report"]

LOSS_GOAL = 1.02
"""The paper's implied goal: the elastic full model's loss within 2 % of a static model's."""
BOOT = 10_000
PAPER_COST = pd.DataFrame(
    [
        ("Table 9 (depth, L in [1,16])", 1.945, 1.941),
        ("Table 10 (width, E in {64,32})", 1.957, 1.964),
        ("Table 11 (top-k, k in [1,8])", 1.945, 1.969),
    ],
    columns=["paper", "static_loss", "elastic_loss"],
)
"""The report's full-size rows (ERNIE 5.0 §6.4.2: 16 layers, 64 experts, top-8, 250 B tokens)."""
PAPER_SUBMODELS = {
    # our shape -> (paper's row, elastic full loss, elastic sub-model loss)
    "d0.75": ("Table 9: 12 of 16 layers", 1.941, 2.137),
    "w0.5": ("Table 10: 32 of 64 experts", 1.964, 2.218),
    "k1": ("Table 11: top-1 of 8", 1.969, 2.175),
}
PAPER_EA = {"active": 0.537, "total": 0.358}
"""Table 12's EA35.8 % point: shares of the full model's activated and total parameters."""


# ---------------------------------------------------------------------------- statistics
def ratio_ci(new: list[float], base: list[float], seed: int = 0) -> tuple[float, float, float]:
    """``mean(new) / mean(base)`` with a paired bootstrap 95 % interval (batches resampled jointly)."""
    a, b = np.asarray(new, dtype=np.float64), np.asarray(base, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(a), size=(BOOT, len(a)))
    stats = a[idx].mean(1) / b[idx].mean(1)
    low, high = np.quantile(stats, [0.025, 0.975])
    return float(a.mean() / b.mean()), float(low), float(high)


def loss_delta(study: Study, new: tuple[str, str], base: tuple[str, str]) -> dict:
    """Paired held-out loss difference ``new - base`` (same batches) with a 95 % interval."""
    a, b = study.losses(*new), study.losses(*base)
    if not a or not b or len(a) != len(b):
        return {"delta": math.nan, "ci_low": math.nan, "ci_high": math.nan, "p_value": math.nan}
    t = paired.paired_test(a, b, "loss")
    return {k: t[k] for k in ("delta", "ci_low", "ci_high", "p_value")}


def main_table(study: Study, rel: pd.DataFrame) -> pd.DataFrame:
    """Per shape and family: loss (and its paired difference from the elastic row), the score per
    modality with its 95 % interval, params and decode speed (median and interquartile range)."""
    groups = seesaw.group_scores(rel, "modality")
    modalities = sorted(groups["group"].unique(), key=study_modality.group_key)
    tokens = study.meta.get("tokens_per_step", 0) * study.meta.get("config", {}).get("steps", 0)
    rows = []
    for shape in study.shapes:
        elastic = study.source("elastic", shape)
        for family in FAMILIES:
            src = study.source(family, shape)
            if src is None:
                continue
            arm, spec = src
            subnet = study.alias(arm, spec)
            losses = study.losses(arm, spec)
            d = loss_delta(study, src, elastic) if family != "elastic" else {}
            row = {
                "shape": shape,
                "family": family,
                "tokens": tokens + (study.meta.get("recovery_tokens", 0) if family == "pruned+rec" else 0),
                "val_loss": float(np.mean(losses)) if losses else math.nan,
                "d_loss_vs_elastic": d.get("delta", math.nan),
                "d_loss_ci_low": d.get("ci_low", math.nan),
                "d_loss_ci_high": d.get("ci_high", math.nan),
            }
            mine = groups[groups["subnet"] == f"{arm}/{subnet}"].set_index("group")
            for m in modalities:
                for col, key in (("rel", ""), ("ci_low", "_ci_low"), ("ci_high", "_ci_high")):
                    row[f"score_{m}{key}"] = float(mine[col].get(m, math.nan))
            row.update(study.efficiency(arm, subnet))
            rows.append(row)
    return pd.DataFrame(rows)


def _values(run_path: Path, subnet: str, task: str, metric: str) -> dict:
    return {r["id"]: r.get("scores", {}).get(metric) for r in read_samples(run_path, subnet, task)}


def task_cells(study: Study) -> pd.DataFrame:
    """Paired per-task tests of the static, pruned and recovered rows against the elastic row of
    each shape (Holm-adjusted over all cells)."""
    rows = []
    for shape in study.shapes:
        e_arm, e_spec = study.source("elastic", shape)
        e_run = study.runs.get(e_arm)
        if e_run is None:
            continue
        e_sub = study.alias(e_arm, e_spec)
        prim = scores.primary_scores(e_run.results)
        prim = prim[prim["subnet"] == e_sub]
        for family in FAMILIES[1:]:
            src = study.source(family, shape)
            if src is None or src[0] not in study.runs:
                continue
            arm, spec = src
            sub = study.alias(arm, spec)
            for t in prim.itertuples(index=False):
                new = _values(study.runs[arm].path, sub, t.task, t.metric)
                base = _values(e_run.path, e_sub, t.task, t.metric)
                ids = [i for i in base if new.get(i) is not None and base[i] is not None]
                if len(ids) < 2:
                    continue
                test = paired.paired_test([new[i] for i in ids], [base[i] for i in ids], t.metric)
                rows.append(
                    {
                        "shape": shape,
                        "family": family,
                        "task": t.task,
                        "metric": t.metric,
                        "higher_is_better": bool(t.higher_is_better),
                        "n": len(ids),
                        **test,
                    }
                )
    cells = pd.DataFrame(rows)
    if cells.empty:
        return cells
    cells["p_adjusted"] = paired.holm(cells["p_value"].tolist())
    cells["verdict"] = [
        # the verdict is for the family row against the elastic row
        paired.verdict(d, p, h)
        for d, p, h in zip(cells["delta"], cells["p_adjusted"], cells["higher_is_better"])
    ]
    return cells


def selection_table(study: Study, rel: pd.DataFrame) -> pd.DataFrame:
    """Deploy-time selection: per shape, family (elastic, pruned) and selection, the held-out loss, its
    paired difference from the default selection, and the mean score."""
    rows = []
    for shape, sels in study.shapes.items():
        for family in ("elastic", "pruned"):
            default = study.source(family, shape)
            for sel in sels:
                arm, spec = study.source(family, shape, sel)
                losses = study.losses(arm, spec)
                d = loss_delta(study, (arm, spec), default) if sel != "default" else {}
                sub = study.alias(arm, spec)
                mine = rel[(rel["subnet"] == f"{arm}/{sub}") & ~scores.at_chance(rel)]
                rows.append(
                    {
                        "shape": shape,
                        "family": family,
                        "selection": sel,
                        "spec": spec,
                        "val_loss": float(np.mean(losses)) if losses else math.nan,
                        "d_loss_vs_default": d.get("delta", math.nan),
                        "ci_low": d.get("ci_low", math.nan),
                        "ci_high": d.get("ci_high", math.nan),
                        "mean_score": float(mine["rel"].mean()) if len(mine) else math.nan,
                        "same_as": sub if sub != spec else "",
                    }
                )
    return pd.DataFrame(rows)


def dimension_table(study: Study, main: pd.DataFrame) -> pd.DataFrame:
    """Tables 9-11 analogues: each elastic sub-model's loss against the elastic full model's, and the
    paper's."""
    full = study.losses(ELASTIC, "full")
    rows = []
    for shape in study.shapes:
        mine = study.losses(ELASTIC, study.shapes[shape]["default"])
        paper = PAPER_SUBMODELS.get(shape)
        ea = paper is None and shape.count("-") == 2  # depth, width and top-k together: the EA point
        eff = study.efficiency(ELASTIC, study.alias(ELASTIC, study.shapes[shape]["default"]))
        eff_full = study.efficiency(ELASTIC, "full")
        rows.append(
            {
                "shape": shape,
                "elastic_full_loss": float(np.mean(full)) if full else math.nan,
                "elastic_sub_loss": float(np.mean(mine)) if mine else math.nan,
                "increase": (np.mean(mine) / np.mean(full) - 1) if mine and full else math.nan,
                "active_share": eff.get("active_params", math.nan) / eff_full.get("active_params", math.nan)
                if eff and eff_full
                else math.nan,
                "total_share": eff.get("total_params", math.nan) / eff_full.get("total_params", math.nan)
                if eff and eff_full
                else math.nan,
                "paper_row": paper[0] if paper else ("Table 12 EA35.8%" if ea else ""),
                "paper_full_loss": paper[1] if paper else math.nan,
                "paper_sub_loss": paper[2] if paper else math.nan,
                "paper_increase": paper[2] / paper[1] - 1 if paper else math.nan,
                "paper_active_share": PAPER_EA["active"] if ea else math.nan,
                "paper_total_share": PAPER_EA["total"] if ea else math.nan,
            }
        )
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------- verdicts
def _interval_verdict(low: float, high: float, holds_if_below: float, claim: str) -> str:
    if math.isnan(low) or math.isnan(high):
        return f"{claim}: not measured"
    if high <= holds_if_below:
        return f"{claim}: **holds** at this scale"
    if low > holds_if_below:
        return f"{claim}: **does not hold** at this scale"
    return f"{claim}: **inconclusive** at this scale (the interval straddles the bound)"


CLAIMS = (
    ("static", "at least as good as static"),
    ("pruned", "better than pruned"),
    ("pruned+rec", "better than pruned + recovery"),
)


def _claim(shape: str, family: str, claim: str, d: float, lo: float, hi: float) -> dict:
    """One shape's claim against a family row (``d``: loss of the row minus the elastic row's)."""
    ci = f.ci(lo, hi, f.signed)
    text = f"{shape}: elastic {claim} (loss {family} - elastic = {f.signed(d)}, CI {ci})"
    if math.isnan(lo):
        word, note = "not measured", ""
    elif family == "static":  # at least as good: the static row is not significantly better
        word = "does not hold" if hi < 0 else "holds"
        note = (
            " (elastic significantly better)" if lo > 0 else " (no significant difference)" if hi >= 0 else ""
        )
    else:  # better: the family row is significantly worse
        word, note = ("holds" if lo > 0 else "does not hold" if hi < 0 else "inconclusive"), ""
    suffix = ": not measured" if word == "not measured" else f": **{word}** at this scale{note}"
    return {
        "shape": shape,
        "claim": f"elastic {claim}",
        "family": family,
        "delta": d,
        "ci_low": lo,
        "ci_high": hi,
        "decision": word,
        "text": text + suffix,
    }


def claim_table(study: Study, main: pd.DataFrame) -> pd.DataFrame:
    """Per shape, the paper's claims against the static, pruned and recovered rows (paired held-out
    loss) and importance against random selection for the elastic and pruned rows: ``shape``,
    ``claim``, ``family``, ``delta`` with its 95 % interval, ``decision`` and the sentence ``text``."""
    rows = []
    for shape in study.shapes:
        for family, claim in CLAIMS:
            r = main[(main["shape"] == shape) & (main["family"] == family)]
            if len(r):
                r = r.iloc[0]
                rows.append(
                    _claim(
                        shape,
                        family,
                        claim,
                        *(float(r[c]) for c in ("d_loss_vs_elastic", "d_loss_ci_low", "d_loss_ci_high")),
                    )
                )
    for shape, sels in study.shapes.items():
        randoms = [s for s in sels if s.startswith("random:")]
        if "importance" not in sels:
            continue
        for family in ("elastic", "pruned"):
            imp = study.source(family, shape, "importance")
            for sel in randoms:
                d = loss_delta(study, imp, study.source(family, shape, sel))
                if math.isnan(d["ci_low"]):
                    continue
                hi, lo = d["ci_high"], d["ci_low"]
                word = "importance better" if hi < 0 else "random better" if lo > 0 else "no difference"
                ci = f.ci(lo, hi, f.signed)
                rows.append(
                    {
                        "shape": shape,
                        "claim": f"importance vs {sel} ({family})",
                        "family": family,
                        "delta": d["delta"],
                        "ci_low": lo,
                        "ci_high": hi,
                        "decision": word,
                        "text": f"{shape} {family}: importance against {sel} selection (loss difference "
                        f"{f.signed(d['delta'])}, CI {ci}): **{word}**",
                    }
                )
    cols = ["shape", "claim", "family", "delta", "ci_low", "ci_high", "decision", "text"]
    return pd.DataFrame(rows, columns=cols)


def cost_verdict(cost: dict) -> str:
    """The cost-of-elasticity claim against the 2 % goal."""
    return _interval_verdict(
        cost["ci_low"],
        cost["ci_high"],
        LOSS_GOAL,
        f"Elastic full loss within 2 % of the static full model (ratio {f.num(cost['ratio'], 4)}, "
        f"95 % CI {f.ci(cost['ci_low'], cost['ci_high'], lambda x: f.num(x, 4))})",
    )


# ---------------------------------------------------------------------------- report
def loss_plot(main: pd.DataFrame) -> bytes:
    """PNG bytes: held-out loss per shape, one bar per family."""
    shapes = list(dict.fromkeys(main["shape"]))
    fig = Figure(figsize=(1.8 + 1.6 * len(shapes), 3.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / len(FAMILIES)
    for i, family in enumerate(FAMILIES):
        sub = main[main["family"] == family].set_index("shape")
        xs = [j + (i - 1.5) * width for j in range(len(shapes))]
        ax.bar(xs, [sub["val_loss"].get(s, np.nan) for s in shapes], width, label=family)
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_xlabel("shape")
    ax.set_ylabel("held-out loss (nats/token)")
    lo = np.nanmin(main["val_loss"]) if main["val_loss"].notna().any() else 0
    ax.set_ylim(bottom=max(0.0, lo * 0.9))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def _cost(study: Study) -> dict:
    e_full, s_full = study.losses(ELASTIC, "full"), study.losses(STATIC, "full")
    if not (e_full and s_full):
        return {"ratio": math.nan, "ci_low": math.nan, "ci_high": math.nan, "goal": LOSS_GOAL}
    r, lo, hi = ratio_ci(e_full, s_full)
    return {
        "elastic_loss": float(np.mean(e_full)),
        "static_loss": float(np.mean(s_full)),
        "ratio": r,
        "ci_low": lo,
        "ci_high": hi,
        "goal": LOSS_GOAL,
    }


def analyze_study(root: str | Path) -> StudyReport:
    """Read a study folder and compute every table and verdict of its report."""
    study = Study(root)
    rel = relative(study)
    main = main_table(study, rel)
    cost = _cost(study)
    groups, index, order, by = study_modality.family_seesaw(study, rel)
    rrows, rent, riou = study_modality.routing_rows(study)
    claim_rows = claim_table(study, main)
    claims = (
        [cost_verdict(cost), *claim_rows["text"]]
        + study_modality.seesaw_words(groups, order, by)
        + study_modality.routing_words(rrows)
    )
    units = study.meta.get("units", {})
    return StudyReport(
        study=study,
        cost=cost,
        paper_cost=PAPER_COST.assign(ratio=PAPER_COST["elastic_loss"] / PAPER_COST["static_loss"]),
        main=main,
        dims=dimension_table(study, main),
        selection=selection_table(study, rel),
        seesaw_by=by,
        seesaw_groups=groups,
        seesaw_index=index,
        seesaw_order=order,
        routing=study_modality.routing_table(study),
        routing_rows=rrows,
        routing_entropy=rent,
        routing_iou=riou,
        cells=task_cells(study),
        claim_rows=claim_rows,
        claims=claims,
        wall_s=sum(u.get("wall_s", 0.0) for u in units.values()),
    )


def write_report(root: str | Path) -> Path:
    """Write ``report.md`` and ``report.html`` (one document), the figures the Markdown shows
    (``loss.png``, ``retention.png``) and ``summary.json`` of a study folder; returns ``report.md``."""
    report = analyze_study(root)
    root = report.study.root
    doc = study_document(report, loss_plot(report.main) if len(report.main) else b"")
    write_figures(doc, root)
    write_atomic(root / "report.md", to_markdown(doc))
    write_atomic(root / "report.html", to_html(doc))
    write_json(root / "summary.json", report.summary())
    return root / "report.md"
