"""The modality-aware parts of an elastic study's report: the seesaw per family and routing by modality.

* **Score per modality** of a row: the harness's group score (:func:`reports.seesaw.group_scores`):
  the mean chance-normalised score over the modality's tasks, with the 95 % interval propagated from
  the per-task standard errors; tasks the static full model answers at chance are left out.
* **Seesaw per family**: a family's rows are its full model (the elastic full model for the elastic
  family, the static full model for the others) and its row at each studied shape. Per row, the
  harness's seesaw index (max - min of the per-modality scores); the modality that *gives way first*
  is the first of :func:`reports.seesaw.degradation_order` (walking the rows from the most to the
  fewest active parameters, the first modality to fall below 95 % retention). A study with one
  modality groups by capability, or by task when it has one capability too.
* **Routing by modality** (the paper's Figs. 8-10, :mod:`reports.routing`) of every family row that
  has a routing record: normalised entropy per modality and layer, top-25 % expert IoU between
  modalities per layer, and the share of (layer, expert) pairs that receive any token.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §6.4 (Figs. 8-10: activation frequency, top-25 %
    IoU and normalised entropy of the routing, by modality and layer).
  * The harness's seesaw (:mod:`reports.seesaw`) and routing (:mod:`reports.routing`) definitions.

Deviations:
  1. The seesaw index's 95 % interval is the interval of the difference between the best- and the
     worst-kept group of the row, ``index +- 1.96 sqrt(se_best^2 + se_worst^2)`` with the groups'
     propagated standard errors (their tasks are disjoint, hence independent), its lower end clipped
     at 0 (a spread is not negative). It does not account for picking the pair after seeing the
     scores, so it is a little narrower than it should be.
  2. Every row's retention is against the static full model (the study's one reference), so the
     elastic family's own full model has a retention of its own (the cost of elasticity per modality)
     and can already be below 95 % before any shrinking.
"""

from __future__ import annotations

import math

import pandas as pd

from reports import formatting as f
from reports import routing, scores, seesaw
from reports.html import MODALITY_COLORS
from reports.study_folder import ELASTIC, FAMILIES, STATIC, Study

THRESHOLD = seesaw.RETENTION_THRESHOLD


def group_key(name: str) -> tuple[int, str]:
    """Sort key of a modality (text, image, video, audio, then any other group by name)."""
    order = list(MODALITY_COLORS)
    return (order.index(name) if name in order else len(order), name)


def family_active(study: Study, names: dict[str, str]) -> dict[str, float] | None:
    """Active params of a family's rows (``arm/subnet`` -> label), the family's full model first
    among equals (half a parameter more), or None when a row's count is unknown."""
    active = study.active_params(names)
    if active and "full" in active:
        active["full"] = max(active.values()) + 0.5
    return active


def seesaw_group(rel: pd.DataFrame) -> str:
    """What the seesaw groups by: modality when there are several, else capability, else task."""
    kept = rel[~scores.at_chance(rel)].dropna(subset=["rel"])
    return next((c for c in ("modality", "capability") if kept[c].nunique() > 1), "task")


def _index_ci(groups: pd.DataFrame, index: pd.DataFrame) -> pd.DataFrame:
    """``index`` plus ``ci_low``/``ci_high`` of the best-minus-worst difference (Deviation 1)."""
    lows, highs = [], []
    for r in index.itertuples(index=False):
        g = groups[groups["subnet"] == r.subnet].set_index("group")
        if not r.best or math.isnan(r.seesaw_index):
            lows.append(math.nan), highs.append(math.nan)
            continue
        se = [(g.loc[x, "ci_high"] - g.loc[x, "rel"]) / seesaw.Z95 for x in (r.best, r.worst)]
        half = seesaw.Z95 * math.hypot(*se)
        lows.append(max(0.0, r.seesaw_index - half)), highs.append(r.seesaw_index + half)
    return index.assign(ci_low=lows, ci_high=highs)


def family_seesaw(study: Study, rel: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, str]:
    """Per family: group scores of each row, the seesaw index with its interval, and the degradation
    order (which group gives way first). Returns ``(groups, index, order, by)``."""
    by = seesaw_group(rel)
    kept = rel[~scores.at_chance(rel)]
    groups, index, orders = [], [], []
    for family in FAMILIES:
        names = study.family_rows(family)
        fam = kept[kept["subnet"].isin(names)].assign(subnet=lambda d, n=names: d["subnet"].map(n))
        if fam["subnet"].nunique() < 2:
            continue
        g = seesaw.group_scores(fam, by)
        idx = _index_ci(g, seesaw.seesaw_index(g))
        if family != ELASTIC:  # the reference itself: an index of 0 by definition
            idx = idx[idx["subnet"] != "full"]
        present = {n: s for n, s in names.items() if s in set(g["subnet"])}
        order = seesaw.degradation_order(g, family_active(study, present))
        groups.append(g.assign(family=family))
        index.append(idx.assign(family=family))
        orders.append(order.assign(family=family))

    def cat(frames: list[pd.DataFrame]) -> pd.DataFrame:
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    return cat(groups), cat(index), cat(orders), by


def seesaw_words(groups: pd.DataFrame, order: pd.DataFrame, by: str) -> list[str]:
    """One plain sentence per family: which group gives way first, where, with its interval."""
    out = []
    for family in FAMILIES:
        o = order[order["family"] == family] if len(order) else order
        if o.empty:
            continue
        g = groups[groups["family"] == family].set_index(["subnet", "group"])
        first = o.iloc[0]
        ranking = " > ".join(map(str, o["modality"]))
        if len(o) < 2:
            row = g.loc[(first["smallest"], first["modality"])]
            out.append(
                f"Seesaw, {family} family: one {by} above chance ({first['modality']}), so no seesaw; its "
                f"retention at {first['smallest']} is {f.pct(row['rel'])} (95 % CI "
                f"{f.ci(row['ci_low'], row['ci_high'])})"
            )
            continue
        if first["crosses_at"]:
            at = first["crosses_at"]
            row = g.loc[(at, first["modality"])]
            interval = f.ci(row["ci_low"], row["ci_high"])
            sure = (
                "its interval is below 95 %"
                if row["ci_high"] < THRESHOLD
                else "its interval reaches 95 %: the crossing is within noise"
            )
            where = "already at the family's full model" if at == "full" else f"at {at}"
            out.append(
                f"Seesaw, {family} family: **{first['modality']}** gives way first, below 95 % retention "
                f"{where} ({f.pct(row['rel'])}, 95 % CI {interval}; {sure}); order {ranking}"
            )
        else:
            row = g.loc[(first["smallest"], first["modality"])]
            out.append(
                f"Seesaw, {family} family: no {by} falls below 95 % retention; the lowest is "
                f"**{first['modality']}** at {first['smallest']} ({f.pct(row['rel'])}, 95 % CI "
                f"{f.ci(row['ci_low'], row['ci_high'])}); order {ranking}"
            )
    return out


# ---------------------------------------------------------------------------- routing
def _pairs(iou: pd.DataFrame) -> pd.DataFrame:
    return iou[iou["a"] < iou["b"]].dropna(subset=["iou"])


def routing_rows(study: Study) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Routing by modality of every family row with a routing record (each record once).

    Returns ``(summary, entropy, iou)``: per row the mean normalised entropy per modality, the mean
    and last-layer IoU between modalities, the most separated and most shared modality pair of the
    last layer and the share of experts used; the long per-layer entropy and modality-pair IoU.
    """
    rows, ent_rows, iou_rows, seen = [], [], [], set()
    for family in FAMILIES:
        for name, label in study.family_rows(family).items():
            arm, subnet = name.split("/", 1) if "/" in name else (STATIC, name)
            run = study.runs.get(arm)
            rec = run.routing.get(subnet) if run is not None else None
            if rec is None or (arm, subnet) in seen:
                continue
            seen.add((arm, subnet))
            key = {"family": family, "row": label, "arm": arm, "subnet": subnet}
            ent = routing.entropy_table(rec, "modality")
            pairs = _pairs(routing.iou_table(rec, "modality"))
            ent_rows.append(ent.assign(**key))
            iou_rows.append(pairs.assign(**key))
            row = dict(key)
            for m, e in sorted(ent.groupby("group", sort=False), key=lambda x: group_key(x[0])):
                row[f"entropy_{m}"] = float(e["entropy"].mean())
            row["iou_modality"] = float(pairs["iou"].mean()) if len(pairs) else math.nan
            last = pairs[pairs["layer"] == pairs["layer"].max()].sort_values(["iou", "a", "b"])
            row["iou_last_layer"] = float(last["iou"].mean()) if len(last) else math.nan
            row["most_separated"] = f"{last['a'].iloc[0]} / {last['b'].iloc[0]}" if len(last) else ""
            row["most_separated_iou"] = float(last["iou"].iloc[0]) if len(last) else math.nan
            row["most_shared"] = f"{last['a'].iloc[-1]} / {last['b'].iloc[-1]}" if len(last) else ""
            row["most_shared_iou"] = float(last["iou"].iloc[-1]) if len(last) else math.nan
            used = routing.frequency_table(rec, "task").groupby(["layer", "expert"])["frequency"].max()
            row["experts_used"] = float((used > 0).mean()) if len(used) else math.nan
            rows.append(row)

    def cat(frames: list[pd.DataFrame]) -> pd.DataFrame:
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    return pd.DataFrame(rows), cat(ent_rows), cat(iou_rows)


def routing_words(summary: pd.DataFrame) -> list[str]:
    """Plain sentences on the full models' routing and how each family's sub-models change it."""
    if summary.empty:
        return ["Routing: the sweeps recorded no routing statistics"]
    out = []
    for family in FAMILIES:
        rows = summary[summary["family"] == family]
        if rows.empty:
            continue
        full = rows[rows["row"] == "full"]
        modalities = [c.removeprefix("entropy_") for c in summary.columns if c.startswith("entropy_")]
        if not full.empty:
            r = full.iloc[0]
            entropy = ", ".join(
                f"{m} {f.num(r[f'entropy_{m}'], 2)}" for m in modalities if not pd.isna(r.get(f"entropy_{m}"))
            )
            if r["most_separated"]:
                out.append(
                    f"Routing, {r['arm']} full model: in the last MoE layer **{r['most_separated']}** "
                    f"share the fewest experts (top-25 % IoU {f.num(r['most_separated_iou'], 2)}) and "
                    f"{r['most_shared']} the most ({f.num(r['most_shared_iou'], 2)}); normalised entropy "
                    f"(mean over layers) {entropy}"
                )
            else:
                out.append(
                    f"Routing, {r['arm']} full model: one modality, no modality specialisation to measure; "
                    f"normalised entropy (mean over layers) {entropy}"
                )
        subs = rows[rows["row"] != "full"].dropna(subset=["iou_last_layer"])
        ref = summary[
            (summary["arm"] == (ELASTIC if family == ELASTIC else STATIC)) & (summary["subnet"] == "full")
        ]
        if len(subs) and len(ref) and not pd.isna(ref["iou_last_layer"].iloc[0]):
            base = float(ref["iou_last_layer"].iloc[0])
            changes = ", ".join(f"{s} {f.num(v, 2)}" for s, v in zip(subs["row"], subs["iou_last_layer"]))
            out.append(
                f"Routing, {family} family: mean last-layer IoU between modalities {changes} "
                f"against {f.num(base, 2)} for its full model (higher: modalities share more experts)"
            )
    return out


def routing_table(study: Study) -> pd.DataFrame:
    """Per (arm, sub-model) routing record of the elastic and static full models' sweeps (every
    selection): mean normalised entropy, the share of experts ever used, and the mean top-25 % IoU
    between tasks and between modalities."""
    rows = []
    for arm in (ELASTIC, STATIC):
        run = study.runs.get(arm)
        if run is None:
            continue
        for subnet, rec in run.routing.items():
            ent = routing.entropy_table(rec, "task")
            row = {"arm": arm, "subnet": subnet, "mean_entropy": float(ent["entropy"].mean())}
            for by in ("task", "modality"):
                off = _pairs(routing.iou_table(rec, by))
                row[f"iou_{by}"] = float(off["iou"].mean()) if len(off) else math.nan
            used = routing.frequency_table(rec, "task").groupby(["layer", "expert"])["frequency"].max()
            row["experts_used"] = float((used > 0).mean()) if len(used) else math.nan
            rows.append(row)
    return pd.DataFrame(rows)
