"""An elastic study's ``report.md`` (the tables of :class:`reports.study_folder.StudyReport`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pandas as pd

from reports import formatting as f
from reports.render.markdown import cell, code, md_table
from reports.study_modality import group_key

if TYPE_CHECKING:
    from reports.study_folder import StudyReport


def modalities(main: pd.DataFrame) -> list[str]:
    """The modalities with a score column in the main table."""
    return [c.removeprefix("score_") for c in main.columns if c.startswith("score_") and "_ci_" not in c]


def score_text(row: pd.Series, m: str) -> str:
    """A row's score of modality ``m`` with its interval: ``0.93 [0.87, 0.99]``."""
    ci = f.ci(row.get(f"score_{m}_ci_low"), row.get(f"score_{m}_ci_high"), f.num)
    return f.NA if pd.isna(row.get(f"score_{m}")) else f"{f.num(row[f'score_{m}'])} {ci}"


def delta_text(d: float, lo: float, hi: float) -> str:
    """A signed difference with its interval, or "" when not measured."""
    return "" if math.isnan(d) else f"{f.signed(d)} {f.ci(lo, hi, f.signed)}"


def decode_text(row: pd.Series) -> str:
    """Median decode tokens/s with the interquartile range."""
    v, lo, hi = (
        row.get(k) for k in ("decode_tokens_per_s", "decode_tokens_per_s_low", "decode_tokens_per_s_high")
    )
    if pd.isna(v):
        return f.NA
    return f"{v:.0f}" + ("" if pd.isna(lo) or pd.isna(hi) else f" [{lo:.0f}, {hi:.0f}]")


def main_view(main: pd.DataFrame) -> pd.DataFrame:
    """The main table as text: loss, paired difference, score per modality, params, decode speed."""
    rows = []
    for _, r in main.iterrows():
        row = {
            "shape": r["shape"],
            "family": r["family"],
            "tokens": f.si(r["tokens"]),
            "held-out loss": f.num(r["val_loss"]),
            "Δloss vs elastic [95% CI]": delta_text(
                r["d_loss_vs_elastic"], r["d_loss_ci_low"], r["d_loss_ci_high"]
            ),
        }
        for m in modalities(main):
            row[f"{m} score [95% CI]"] = score_text(r, m)
        row["active params"] = f.si(r.get("active_params"))
        row["total params"] = f.si(r.get("total_params"))
        row["decode tok/s [IQR]"] = decode_text(r)
        rows.append(row)
    return pd.DataFrame(rows)


def index_view(index: pd.DataFrame) -> pd.DataFrame:
    """Seesaw index per family row with its interval, best and worst group."""
    if index.empty:
        return index
    return pd.DataFrame(
        {
            "family": index["family"],
            "row": index["subnet"],
            "seesaw index [95% CI]": [
                f"{f.pts(v)} {f.ci(lo, hi, f.pts)}"
                for v, lo, hi in zip(index["seesaw_index"], index["ci_low"], index["ci_high"])
            ],
            "best kept": index["best"],
            "worst kept": index["worst"],
        }
    )


def groups_view(groups: pd.DataFrame) -> pd.DataFrame:
    """Group score per family row (wide: one column per group), with intervals."""
    if groups.empty:
        return groups
    txt = groups.assign(
        txt=[
            f"{f.pct(r)} {f.ci(lo, hi)}"
            for r, lo, hi in zip(groups["rel"], groups["ci_low"], groups["ci_high"])
        ]
    )
    wide = txt.pivot_table(index=["family", "subnet"], columns="group", values="txt", aggfunc="first")
    order = {(fa, s): i for i, (fa, s) in enumerate(zip(groups["family"], groups["subnet"]))}
    wide = wide.reindex(sorted(wide.index, key=lambda k: order[k]))
    wide = wide[sorted(wide.columns, key=group_key)].reset_index()
    return wide.rename(columns={"subnet": "row"}).fillna(f.NA)


def order_view(order: pd.DataFrame) -> pd.DataFrame:
    """The degradation order per family."""
    if order.empty:
        return order
    return order[
        ["family", "rank", "modality", "crosses_at", "rel_at_crossing", "smallest", "rel_at_smallest"]
    ].rename(columns={"modality": "group"})


def render(r: StudyReport) -> str:
    """The Markdown report."""
    study = r.study
    cfg = study.meta.get("config", {})
    toks = study.meta.get("tokens_per_step", 0) * cfg.get("steps", 0)
    units = study.meta.get("units", {})
    overrides = cell(", ".join(cfg.get("overrides", [])) or "none")
    lines = [
        "# Elastic study: one elastic run against static, pruned and recovered models",
        "",
        f"Base config {code(cfg.get('base'))} (overrides: {overrides}); "
        f"{cfg.get('steps')} steps = {toks:,} tokens per from-scratch model; recovery "
        f"{cfg.get('recovery_steps')} steps = {study.meta.get('recovery_tokens', 0):,} more tokens; "
        f"suite {code(cfg.get('suite'))}; held-out loss on {cfg.get('val_batches')} fixed batches. "
        f"Units' wall time: {r.wall_s / 60:.1f} min."
        + (f" Command: {code(study.command)}." if study.command else ""),
        "",
        "The same tables with figures: `report.html`.",
        "",
        "## Verdicts",
        "",
        *[f"- {cell(c)}" for c in r.claims],
        "",
        "## Cost of elasticity (full size)",
        "",
        md_table(pd.DataFrame([r.cost])),
        "The paper's full-size rows (§6.4.2, validation loss):",
        "",
        md_table(r.paper_cost, {"ratio": lambda x: f.num(x, 4)}),
        "## Each shape: elastic, static, pruned and pruned + recovery",
        "",
        "Scores: chance-normalised against the static full model (1 = its score, 0 = its random twin's), "
        "mean per modality with a 95 % interval. Δloss: paired over the same held-out batches. Decode "
        "speed: median tokens/s with the interquartile range.",
        "",
        md_table(main_view(r.main)),
        "![held-out loss](loss.png)",
        "",
        "## Tables 9-12 analogues: the elastic sub-models against the elastic full model",
        "",
        md_table(
            r.dims,
            {
                c: f.signed_pct if "increase" in c else f.pct
                for c in r.dims.columns
                if "increase" in c or "share" in c
            },
        ),
        "",
        "## Deploy-time selection (random against importance)",
        "",
        md_table(r.selection),
        f"## Seesaw per family (by {r.seesaw_by})",
        "",
        "Retention against the static full model; the elastic family's `full` row is the elastic full model.",
        "",
        md_table(index_view(r.seesaw_index)) if len(r.seesaw_index) else "_(no family has two rows)_\n",
        md_table(groups_view(r.seesaw_groups)) if len(r.seesaw_groups) else "",
        "Which group gives way first (falls below 95 % retention at the most active parameters):",
        "",
        md_table(order_view(r.seesaw_order), {"rel_at_crossing": f.pct, "rel_at_smallest": f.pct})
        if len(r.seesaw_order)
        else "_(none)_\n",
        "## Routing",
        "",
        "By modality, every family row with a routing record: normalised entropy per modality (mean over "
        "MoE layers), top-25 % expert IoU between modalities (mean over layers and in the last layer), "
        "the last layer's most separated and most shared pair, the share of (layer, expert) pairs used.",
        "",
        md_table(r.routing_rows) if len(r.routing_rows) else "_(no routing records)_\n",
        "Every sub-model of the elastic and static sweeps (selections too): mean normalised entropy over "
        "layers and tasks, mean top-25 % IoU between tasks and between modalities.",
        "",
        md_table(r.routing) if len(r.routing) else "_(no routing records)_\n",
        "## Per-task paired tests (row - elastic, Holm-adjusted)",
        "",
        md_table(r.cells) if len(r.cells) else "_(none)_\n",
        "## Units",
        "",
        md_table(pd.DataFrame([{"unit": k, "wall_s": v.get("wall_s")} for k, v in units.items()])),
    ]
    return "\n".join(lines) + "\n"
