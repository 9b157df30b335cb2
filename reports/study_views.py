"""An elastic study's tables as text (:class:`reports.study_folder.StudyReport` -> display frames).

Pure views for :mod:`reports.study_report`: every cell is plain text, intervals and differences
already written out; rich cells (the claim matrix) carry ``**word**`` marks for the renderer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pandas as pd

from reports import formatting as f
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


def shape_view(rows: pd.DataFrame) -> pd.DataFrame:
    """One shape's rows of the main table (no shape column; the elastic row is the reference)."""
    view = main_view(rows).drop(columns="shape")
    delta = "Δloss vs elastic [95% CI]"
    return view.assign(**{delta: [d or "(reference)" for d in view[delta]]})


def claim_matrix(claims: pd.DataFrame) -> pd.DataFrame:
    """Shapes x claims: each cell the decision (``**word**``) over the loss difference and its interval."""
    if claims.empty:
        return claims
    cell = [
        f"**{w}**\n{f.signed(d)} {f.ci(lo, hi, f.signed)}"
        for w, d, lo, hi in zip(claims["decision"], claims["delta"], claims["ci_low"], claims["ci_high"])
    ]
    wide = claims.assign(cell=cell).pivot_table(
        index="shape", columns="claim", values="cell", aggfunc="first", sort=False
    )
    wide = wide.reindex(columns=list(dict.fromkeys(claims["claim"]))).fillna("-")
    wide.insert(0, "shape", list(wide.index))
    wide.columns.name = None
    return wide.reset_index(drop=True)


def cost_view(r: StudyReport) -> pd.DataFrame:
    """The cost of elasticity of this study beside the paper's full-size rows."""
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
    return pd.DataFrame(rows)


def dims_view(d: pd.DataFrame) -> pd.DataFrame:
    """Tables 9-12 analogues as text: each elastic sub-model's loss increase beside the paper's."""
    return pd.DataFrame(
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


def selection_view(sel: pd.DataFrame) -> pd.DataFrame:
    """The selection table with each row's paired difference from the default selection as text."""
    return sel.assign(
        **{
            "Δloss vs default [95% CI]": [
                delta_text(d, lo, hi)
                for d, lo, hi in zip(sel["d_loss_vs_default"], sel["ci_low"], sel["ci_high"])
            ]
        }
    ).drop(columns=["d_loss_vs_default", "ci_low", "ci_high"])


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


def per_layer(frame: pd.DataFrame, index: list[str], values: str) -> pd.DataFrame:
    """A long per-layer table (``layer`` column) wide: one ``layer N`` column per layer."""
    wide = frame.pivot_table(index=index, columns="layer", values=values, aggfunc="first", sort=False)
    wide.columns = [f"layer {c}" for c in wide.columns]
    return wide.reset_index()


TASK_COLUMNS = [
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
"""The per-task cells' columns the report shows."""
TASK_FORMATS = {
    **{c: f.signed for c in ("delta", "ci_low", "ci_high")},
    **{c: f.pvalue for c in ("p_value", "p_adjusted")},
}


def units_views(r: StudyReport) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every unit's wall time, and the sum per kind of unit (``train``, ``sweep``, ...)."""
    units = r.study.meta.get("units", {})
    df = pd.DataFrame([{"unit": k, "wall_s": v.get("wall_s")} for k, v in units.items()])
    if df.empty:
        return df, df
    kinds = df.assign(kind=df["unit"].str.split("/").str[0]).groupby("kind", sort=False)["wall_s"].sum()
    return df, kinds.reset_index()
