"""The capability seesaw: how each modality (and capability) keeps its score as the model shrinks.

Inputs are :func:`reports.scores.relative_scores` rows (one per subnet and task). Tasks the full model
does not answer significantly above the random baseline (``above_chance`` False, see
:mod:`reports.scores`) are left out of every group score, hence of the seesaw index, the degradation
order and the aggregate score built on them; tasks without a random score are kept.

* **Group score** (per modality or capability): the mean relative score over the group's tasks.
  Its 95% interval is ``mean +- 1.96 * sqrt(sum se_i^2) / k`` over the ``k`` tasks, the propagated
  per-task standard errors: it measures the sampling noise of this fixed set of tasks, not the spread
  between tasks (a bootstrap over two or three tasks would say little). NaN when a stderr is.
* **Seesaw index** of a subnet: the spread, max minus min, of its per-modality group scores. 0 means
  every modality kept the same share of its full-model score; 0.10 means the best-kept modality
  kept 10 points more of its score than the worst-kept one. Defined with two or more modalities.
* **Degradation order**: walk the subnets from the most to the fewest active parameters (without
  them: the full model first, then by mean score); a modality
  *crosses* at the first subnet where its group score falls below ``threshold`` (95% retention).
  The modality that crosses at the most active parameters degrades first (ties: the lower score
  first); modalities that never cross come last, ordered by their score at the smallest subnet.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from reports.scores import at_chance

Z95 = 1.959964
REFERENCE = "full"
RETENTION_THRESHOLD = 0.95
"""Retention below which a modality counts as degraded."""


def group_scores(rel: pd.DataFrame, by: str = "modality") -> pd.DataFrame:
    """Mean relative score per (subnet, group) with a 95% interval.

    Args:
        rel: rows with ``subnet``, ``by``, ``rel`` and ``rel_se``; NaN ``rel`` rows and rows whose task
            is at chance (``above_chance`` False, when the column is there) are left out.
        by: the grouping column, ``"modality"`` or ``"capability"``.

    Returns:
        Columns ``subnet``, ``group``, ``rel``, ``ci_low``, ``ci_high``, ``n_tasks``.
    """
    rows = []
    kept = rel[~at_chance(rel)]
    for (subnet, group), g in kept.dropna(subset=["rel"]).groupby(["subnet", by], sort=False):
        k = len(g)
        mean = float(g["rel"].mean())
        half = Z95 * math.sqrt(float((g["rel_se"] ** 2).sum(skipna=False))) / k
        rows.append(
            {
                "subnet": subnet,
                "group": group,
                "rel": mean,
                "ci_low": mean - half,
                "ci_high": mean + half,
                "n_tasks": k,
            }
        )
    return pd.DataFrame(rows, columns=["subnet", "group", "rel", "ci_low", "ci_high", "n_tasks"])


def seesaw_index(groups: pd.DataFrame) -> pd.DataFrame:
    """Per subnet: ``seesaw_index`` (max - min group score), ``best`` and ``worst`` group.

    Args:
        groups: :func:`group_scores` rows (per modality).

    Returns:
        Columns ``subnet``, ``seesaw_index``, ``best``, ``worst``, ``n_groups``; the index is NaN
        (and best/worst empty) for a subnet with fewer than two groups.
    """
    rows = []
    for subnet, g in groups.dropna(subset=["rel"]).groupby("subnet", sort=False):
        g = g.sort_values(["rel", "group"])
        if len(g) < 2:
            rows.append(
                {"subnet": subnet, "seesaw_index": math.nan, "best": "", "worst": "", "n_groups": len(g)}
            )
            continue
        rows.append(
            {
                "subnet": subnet,
                "seesaw_index": float(g["rel"].iloc[-1] - g["rel"].iloc[0]),
                "best": g["group"].iloc[-1],
                "worst": g["group"].iloc[0],
                "n_groups": len(g),
            }
        )
    return pd.DataFrame(rows, columns=["subnet", "seesaw_index", "best", "worst", "n_groups"])


def subnet_order(groups: pd.DataFrame, active_params: dict[str, float] | None) -> list[str]:
    """Subnets from largest to smallest: by active params, else the full model then by mean group score."""
    subnets = list(dict.fromkeys(groups["subnet"]))
    mean = groups.groupby("subnet")["rel"].mean()
    if active_params and all(s in active_params and not math.isnan(active_params[s]) for s in subnets):
        return sorted(subnets, key=lambda s: (-active_params[s], -mean.get(s, 0.0), s))
    return sorted(subnets, key=lambda s: (s != REFERENCE, -mean.get(s, -np.inf), s))


def degradation_order(
    groups: pd.DataFrame, active_params: dict[str, float] | None, threshold: float = RETENTION_THRESHOLD
) -> pd.DataFrame:
    """Which modality loses first as the model shrinks (see the module docstring).

    Args:
        groups: :func:`group_scores` rows (per modality).
        active_params: active parameters per subnet; without them subnets are ordered by mean score.
        threshold: the retention a modality must fall below to count as degraded.

    Returns:
        One row per modality, first-degrading first: ``rank``, ``modality``, ``crosses_at`` (the
        subnet), ``crosses_at_active_params`` (NaN if never), ``rel_at_crossing``, ``smallest``
        (the smallest subnet with a score for the modality) and ``rel_at_smallest``.
    """
    order = subnet_order(groups, active_params)
    if len(order) < 2:  # nothing shrinks
        order = []
    position = {s: i for i, s in enumerate(order)}
    rows = []
    for modality, g in (
        groups[groups["subnet"].isin(position)].dropna(subset=["rel"]).groupby("group", sort=False)
    ):
        g = g.assign(pos=g["subnet"].map(position)).sort_values("pos")
        below = g[g["rel"] < threshold]
        crossing = below.iloc[0] if len(below) else None
        rows.append(
            {
                "modality": modality,
                "crosses_at": crossing["subnet"] if crossing is not None else "",
                "crosses_at_active_params": (
                    float(active_params.get(crossing["subnet"], math.nan))
                    if crossing is not None and active_params
                    else math.nan
                ),
                "rel_at_crossing": float(crossing["rel"]) if crossing is not None else math.nan,
                "pos": int(crossing["pos"]) if crossing is not None else len(order),
                "smallest": g["subnet"].iloc[-1],
                "rel_at_smallest": float(g["rel"].iloc[-1]),
            }
        )
    table = pd.DataFrame(rows)
    if table.empty:
        return pd.DataFrame(
            columns=["rank", "modality", "crosses_at", "crosses_at_active_params", "rel_at_crossing"]
            + ["smallest", "rel_at_smallest"]
        )
    tiebreak = table["rel_at_crossing"].fillna(table["rel_at_smallest"])
    table = (
        table.assign(tiebreak=tiebreak).sort_values(["pos", "tiebreak", "modality"]).reset_index(drop=True)
    )
    table.insert(0, "rank", range(1, len(table) + 1))
    return table.drop(columns=["pos", "tiebreak"])
