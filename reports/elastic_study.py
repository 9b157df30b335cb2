"""An elastic study folder -> ``report.md``, ``summary.json`` and ``loss.png`` (``ernie5 study elastic``).

Reads only what the study wrote (``study.json``, ``loss/<arm>.json``, the sweep run folders under
``sweeps/``). For each studied shape it puts four rows side by side:

* **elastic**: the elastic model's sub-model (``sweeps/elastic``, subnet = the shape);
* **static**: a model of that exact shape trained from scratch on the same tokens
  (``sweeps/static-<shape>``, its full model);
* **pruned**: the static full model sliced to the shape by the same deploy selection
  (``sweeps/static``, subnet = the shape; slicing is exact, so the masked sub-model is the pruned model);
* **pruned+rec**: the pruned model after the recovery fine-tune (``sweeps/recover-<shape>``).

Scores are chance-normalised against one reference for every row, the static full model and its
random twin (:func:`reports.scores.relative_scores`), so rows of different checkpoints compare on one
scale; a modality's score is the mean over its tasks (those the static full model answers above
chance). Paired statistics: the held-out loss of two rows on the same fixed batches (paired bootstrap
of the mean difference, :func:`reports.paired.paired_test`), and every task's primary metric on the
same examples (McNemar or paired bootstrap), Holm-adjusted over all task cells of the report.
The cost of elasticity is the ratio of the elastic and static full models' held-out losses with a
paired bootstrap interval, against the paper's implied goal (within 2 %).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd

from ernie5.store.runs import write_atomic, write_json
from reports import formatting as f
from reports import paired, routing, scores, seesaw
from reports.load import ReportError, Run, load_run, read_samples
from reports.markdown import md_table

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ELASTIC, STATIC = "elastic", "static"
FAMILIES = ("elastic", "static", "pruned", "pruned+rec")
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
    "k1": ("Table 11: top-1 of 8 (ours: 1 of 2)", 1.969, 2.175),
}
PAPER_EA = {"active": 0.537, "total": 0.358}
"""Table 12's EA35.8 % point: shares of the full model's activated and total parameters."""


# ---------------------------------------------------------------------------- reading
def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: unreadable ({type(e).__name__})") from None


class Study:
    """A study folder, read: its ledger, held-out losses and sweeps."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not (self.root / "study.json").is_file():
            raise ReportError(f"{self.root} is not an elastic study folder (no study.json)")
        self.meta = _read_json(self.root / "study.json")
        self.shapes: dict[str, dict[str, str]] = self.meta["shapes"]
        self.loss = {p.stem: _read_json(p) for p in sorted((self.root / "loss").glob("*.json"))}
        self.runs: dict[str, Run] = {}
        for d in sorted((self.root / "sweeps").glob("*")):
            if (d / "manifest.json").is_file():
                self.runs[d.name] = load_run(d)
        if STATIC not in self.runs:
            raise ReportError(f"{self.root}: no sweep of the static full model (sweeps/static)")

    def alias(self, arm: str, spec: str) -> str:
        """The subnet name a sweep of ``arm`` recorded ``spec`` under: the sweep keeps one name per
        concrete sub-model, so a selection identical to an earlier spec's is found under that one."""
        run = self.runs.get(arm)
        names = set(run.results["subnet"]) if run is not None else set()
        if spec in names:
            return spec
        subs = self.loss.get(arm, {}).get("subnets", {})
        ident = subs.get(spec, {}).get("identity")
        for other, rec in subs.items():
            if rec.get("identity") == ident and other in names:
                return other
        return spec

    def source(self, family: str, shape: str, selection: str = "default") -> tuple[str, str] | None:
        """``(arm, subnet)`` of a family's row for ``shape`` (None when the study has no such row)."""
        spec = self.shapes[shape].get(selection)
        if spec is None:
            return None
        if family == "elastic":
            return ELASTIC, spec
        if family == "pruned":
            return STATIC, spec
        if selection != "default":
            return None
        arm = f"static-{shape}" if family == "static" else f"recover-{shape}"
        return (arm, "full") if arm in self.runs or arm in self.loss else None

    def losses(self, arm: str, subnet: str) -> list[float] | None:
        rec = self.loss.get(arm, {}).get("subnets", {}).get(subnet)
        return rec["batches"] if rec else None


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


def _scores(study: Study) -> pd.DataFrame:
    """Primary-metric rows of every (arm, subnet) of the study, subnet renamed ``arm/subnet``, plus
    the static full model as ``full`` (the one reference)."""
    frames = []
    for arm, run in study.runs.items():
        p = scores.primary_scores(run.results).copy()
        p["subnet"] = arm + "/" + p["subnet"].astype(str)
        frames.append(p)
    static = scores.primary_scores(study.runs[STATIC].results)
    frames.append(static[static["subnet"] == "full"])
    return pd.concat(frames, ignore_index=True)


def relative(study: Study) -> pd.DataFrame:
    """Chance-normalised score of every row against the static full model and its random twin."""
    return scores.relative_scores(_scores(study), "full", study.runs[STATIC].baseline_results)


def _efficiency(study: Study, arm: str, subnet: str) -> dict:
    run = study.runs.get(arm)
    if run is None or run.efficiency is None:
        return {}
    eff = run.efficiency[run.efficiency["subnet"] == subnet]
    if eff.empty:
        return {}
    row = eff.iloc[0]
    return {
        k: float(pd.to_numeric(row.get(k), errors="coerce"))
        for k in ("active_params", "total_params", "decode_tokens_per_s")
    }


def main_table(study: Study, rel: pd.DataFrame) -> pd.DataFrame:
    """Per shape and family: loss (and its paired difference from the elastic row), modality scores,
    params and decode speed."""
    modalities = sorted(rel.loc[~scores.at_chance(rel), "modality"].dropna().unique())
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
            mine = rel[(rel["subnet"] == f"{arm}/{subnet}") & ~scores.at_chance(rel)]
            for m in modalities:
                row[f"score_{m}"] = float(mine.loc[mine["modality"] == m, "rel"].mean())
            row.update(_efficiency(study, arm, subnet))
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


def seesaw_tables(study: Study, rel: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """Per family: group scores of each shape and the seesaw index with the group that gives way
    first (:func:`reports.seesaw.degradation_order`). Groups are modalities; a one-modality study
    groups by capability, or by task when it has one capability too."""
    kept = rel[~scores.at_chance(rel)]
    by = next((c for c in ("modality", "capability") if kept[c].nunique() > 1), "task")
    groups, index = [], []
    for family in FAMILIES:
        names = {"full": "full"}
        for shape in study.shapes:
            src = study.source(family, shape)
            if src is not None:
                names[f"{src[0]}/{study.alias(*src)}"] = shape
        fam = kept[kept["subnet"].isin(names)].assign(subnet=lambda d, n=names: d["subnet"].map(n))
        if fam["subnet"].nunique() < 2:
            continue
        g = seesaw.group_scores(fam, by)
        idx = seesaw.seesaw_index(g)
        idx = idx[idx["subnet"] != "full"]
        order = seesaw.degradation_order(g, None)
        first = order["modality"].iloc[0] if len(order) else ""
        groups.append(g.assign(family=family))
        index.append(idx.assign(family=family, gives_way_first=first))
    return (
        pd.concat(groups, ignore_index=True) if groups else pd.DataFrame(),
        pd.concat(index, ignore_index=True) if index else pd.DataFrame(),
        by,
    )


def routing_table(study: Study) -> pd.DataFrame:
    """Per (arm, sub-model) routing record: mean normalised entropy, the share of experts ever used,
    and the mean top-25 % IoU between tasks (and between modalities when there are several)."""
    rows = []
    for arm in (ELASTIC, STATIC):
        run = study.runs.get(arm)
        if run is None:
            continue
        for subnet, rec in run.routing.items():
            ent = routing.entropy_table(rec, "task")
            row = {"arm": arm, "subnet": subnet, "mean_entropy": float(ent["entropy"].mean())}
            for by in ("task", "modality"):
                iou = routing.iou_table(rec, by)
                off = iou[iou["a"] < iou["b"]]
                row[f"iou_{by}"] = float(off["iou"].mean()) if len(off) else math.nan
            freq = routing.frequency_table(rec, "task")
            used = freq.groupby(["layer", "expert"])["frequency"].max()
            row["experts_used"] = float((used > 0).mean()) if len(used) else math.nan
            rows.append(row)
    return pd.DataFrame(rows)


def dimension_table(study: Study, main: pd.DataFrame) -> pd.DataFrame:
    """Tables 9-11 analogues: each elastic sub-model's loss against the elastic full model's, and the
    paper's."""
    full = study.losses(ELASTIC, "full")
    rows = []
    for shape in study.shapes:
        mine = study.losses(ELASTIC, study.shapes[shape]["default"])
        paper = PAPER_SUBMODELS.get(shape)
        eff = _efficiency(study, ELASTIC, study.alias(ELASTIC, study.shapes[shape]["default"]))
        eff_full = _efficiency(study, ELASTIC, "full")
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
                "paper_row": paper[0] if paper else ("Table 12 EA35.8%" if shape.count("-") == 2 else ""),
                "paper_increase": paper[2] / paper[1] - 1 if paper else math.nan,
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


def verdicts(study: Study, cost: dict, main: pd.DataFrame) -> list[str]:
    out = [
        _interval_verdict(
            cost["ci_low"],
            cost["ci_high"],
            LOSS_GOAL,
            f"Elastic full loss within 2 % of the static full model (ratio {f.num(cost['ratio'], 4)}, "
            f"95 % CI {f.ci(cost['ci_low'], cost['ci_high'], lambda x: f.num(x, 4))})",
        )
    ]
    for shape in study.shapes:
        for family, claim in (
            ("static", "at least as good as static"),
            ("pruned", "better than pruned"),
            ("pruned+rec", "better than pruned + recovery"),
        ):
            r = main[(main["shape"] == shape) & (main["family"] == family)]
            if r.empty:
                continue
            lo, hi = float(r["d_loss_ci_low"].iloc[0]), float(r["d_loss_ci_high"].iloc[0])
            d = float(r["d_loss_vs_elastic"].iloc[0])
            ci = f.ci(lo, hi, f.signed)
            text = f"{shape}: elastic {claim} (loss {family} - elastic = {f.signed(d)}, CI {ci})"
            if math.isnan(lo):
                out.append(f"{text}: not measured")
            elif family == "static":  # at least as good: the family row is not significantly better
                out.append(
                    f"{text}: **{'does not hold' if hi < 0 else 'holds'}** at this scale"
                    + (
                        " (elastic significantly better)"
                        if lo > 0
                        else " (no significant difference)"
                        if hi >= 0
                        else ""
                    )
                )
            else:  # better: the family row is significantly worse
                word = "holds" if lo > 0 else "does not hold" if hi < 0 else "inconclusive"
                out.append(f"{text}: **{word}** at this scale")
    for shape, sels in study.shapes.items():
        randoms = [s for s in sels if s.startswith("random:")]
        if "importance" not in sels or not randoms:
            continue
        for family in ("elastic", "pruned"):
            imp = study.source(family, shape, "importance")
            for sel in randoms:
                d = loss_delta(study, imp, study.source(family, shape, sel))
                if math.isnan(d["ci_low"]):
                    continue
                ci = f.ci(d["ci_low"], d["ci_high"], f.signed)
                word = (
                    "importance better"
                    if d["ci_high"] < 0
                    else "random better"
                    if d["ci_low"] > 0
                    else "no difference"
                )
                out.append(
                    f"{shape} {family}: importance against {sel} selection (loss difference "
                    f"{f.signed(d['delta'])}, CI {ci}): **{word}**"
                )
    return out


# ---------------------------------------------------------------------------- writing
def _loss_plot(main: pd.DataFrame, path: Path) -> None:
    shapes = list(dict.fromkeys(main["shape"]))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(shapes), 3.2))
    width = 0.8 / len(FAMILIES)
    for i, family in enumerate(FAMILIES):
        sub = main[main["family"] == family].set_index("shape")
        xs = [j + (i - 1.5) * width for j in range(len(shapes))]
        ax.bar(xs, [sub["val_loss"].get(s, np.nan) for s in shapes], width, label=family)
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_ylabel("held-out loss (nats/token)")
    lo = np.nanmin(main["val_loss"]) if main["val_loss"].notna().any() else 0
    ax.set_ylim(bottom=max(0.0, lo * 0.9))
    ax.legend(fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt_main(main: pd.DataFrame) -> pd.DataFrame:
    view = main.copy()
    view["Δloss vs elastic [95% CI]"] = [
        "" if math.isnan(d) else f"{f.signed(d)} {f.ci(lo, hi, f.signed)}"
        for d, lo, hi in zip(view["d_loss_vs_elastic"], view["d_loss_ci_low"], view["d_loss_ci_high"])
    ]
    view = view.drop(columns=["d_loss_vs_elastic", "d_loss_ci_low", "d_loss_ci_high"])
    for c in ("active_params", "total_params", "tokens"):
        if c in view:
            view[c] = view[c].map(f.si)
    return view


def write_report(root: str | Path) -> Path:
    """Write ``report.md``, ``summary.json`` and ``loss.png`` of a study folder; returns ``report.md``."""
    study = Study(root)
    root = study.root
    rel = relative(study)
    main = main_table(study, rel)
    e_full, s_full = study.losses(ELASTIC, "full"), study.losses(STATIC, "full")
    if e_full and s_full:
        r, lo, hi = ratio_ci(e_full, s_full)
        cost = {
            "elastic_loss": float(np.mean(e_full)),
            "static_loss": float(np.mean(s_full)),
            "ratio": r,
            "ci_low": lo,
            "ci_high": hi,
            "goal": LOSS_GOAL,
        }
    else:
        cost = {"ratio": math.nan, "ci_low": math.nan, "ci_high": math.nan, "goal": LOSS_GOAL}
    cells = task_cells(study)
    sel = selection_table(study, rel)
    groups, index, by = seesaw_tables(study, rel)
    rtable = routing_table(study)
    dims = dimension_table(study, main)
    claims = verdicts(study, cost, main)
    if len(main):
        _loss_plot(main, root / "loss.png")
    cfg = study.meta.get("config", {})
    units = study.meta.get("units", {})
    wall = sum(u.get("wall_s", 0.0) for u in units.values())
    paper_cost = PAPER_COST.assign(ratio=PAPER_COST["elastic_loss"] / PAPER_COST["static_loss"])
    toks = study.meta.get("tokens_per_step", 0) * cfg.get("steps", 0)
    lines = [
        "# Elastic study: one elastic run against static, pruned and recovered models",
        "",
        f"Base config `{cfg.get('base')}` (overrides: {', '.join(cfg.get('overrides', [])) or 'none'}); "
        f"{cfg.get('steps')} steps = {toks:,} tokens per from-scratch model; recovery "
        f"{cfg.get('recovery_steps')} steps = {study.meta.get('recovery_tokens', 0):,} more tokens; "
        f"suite `{cfg.get('suite')}`; held-out loss on {cfg.get('val_batches')} fixed batches. "
        f"Units' wall time: {wall / 60:.1f} min.",
        "",
        "## Verdicts",
        "",
        *[f"- {c}" for c in claims],
        "",
        "## Cost of elasticity (full size)",
        "",
        md_table(pd.DataFrame([cost])),
        "The paper's full-size rows (§6.4.2, validation loss):",
        "",
        md_table(paper_cost, {"ratio": lambda x: f.num(x, 4)}),
        "## Each shape: elastic, static, pruned and pruned + recovery",
        "",
        "Scores: chance-normalised against the static full model (1 = its score, 0 = its random twin's), "
        "mean per modality. Δloss: paired over the same held-out batches.",
        "",
        md_table(_fmt_main(main)),
        "![held-out loss](loss.png)",
        "",
        "## Tables 9-12 analogues: the elastic sub-models against the elastic full model",
        "",
        md_table(
            dims,
            {
                "increase": f.signed_pct,
                "paper_increase": f.signed_pct,
                "active_share": f.pct,
                "total_share": f.pct,
            },
        ),
        f"Table 12's EA35.8% point keeps {f.pct(PAPER_EA['active'])} of the activated and "
        f"{f.pct(PAPER_EA['total'])} of the total parameters.",
        "",
        "## Deploy-time selection (random against importance)",
        "",
        md_table(sel),
        f"## Seesaw per family (by {by})",
        "",
        md_table(index) if len(index) else "_(fewer than two groups)_\n",
        md_table(groups) if len(groups) else "",
        "## Routing",
        "",
        "Mean normalised routing entropy over layers and tasks, share of (layer, expert) pairs used, "
        "mean top-25 % IoU between tasks and between modalities.",
        "",
        md_table(rtable),
        "## Per-task paired tests (row - elastic, Holm-adjusted)",
        "",
        md_table(cells) if len(cells) else "_(none)_\n",
        "## Units",
        "",
        md_table(pd.DataFrame([{"unit": k, "wall_s": v.get("wall_s")} for k, v in units.items()])),
    ]
    write_atomic(root / "report.md", "\n".join(lines) + "\n")

    def records(df: pd.DataFrame) -> list:
        return json.loads(df.to_json(orient="records")) if len(df) else []

    write_json(
        root / "summary.json",
        {
            "cost_of_elasticity": cost,
            "main": records(main),
            "dimensions": records(dims),
            "selection": records(sel),
            "seesaw_by": by,
            "seesaw_index": records(index),
            "seesaw_groups": records(groups),
            "routing": records(rtable),
            "task_cells": records(cells),
            "verdicts": claims,
            "wall_s": wall,
        },
    )
    return root / "report.md"
