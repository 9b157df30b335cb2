"""One score per (subnet, task), its score relative to the full model, and HELM's mean win rate.

* The **primary metric** of a task is the first metric it declares (``Task.metrics`` order, kept in
  the unit records and ``results.csv``); the drill-down shows every metric.
* The **relative score** is direction-aware, so that 1 means "as good as the full model" and below 1
  means worse, for every metric: ``sub / full`` if higher is better, ``full / sub`` if lower is better
  (bits per byte, WER). It is a retention ratio, the quantity the paper's elastic tables are read
  with (ES25%: 74.43 / 75.55 = 98.5%). It is defined for non-negative metrics: 1 when both values
  are 0, undefined (NaN, shown "n/a", left out of aggregates) when only the denominator is 0.
* Its standard error uses the delta method on ``num / den`` with the two stderrs treated as
  independent; the same examples are scored by both models, so this overstates the noise (a
  conservative interval). The full model's own relative score is exactly 1 with stderr 0.
* **Mean win rate** (HELM): per task, the share of the other subnets a subnet beats on the primary
  metric (ties count one half), averaged over the tasks the subnet has a score on.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

REFERENCE = "full"
"""The subnet every relative score is taken against."""

SCORE_COLUMNS = [
    "subnet",
    "task",
    "metric",
    "value",
    "stderr",
    "n",
    "higher_is_better",
    "modality",
    "capability",
]


def relative_score(value: float, full: float, higher_is_better: bool) -> float:
    """Retention of ``value`` with respect to ``full``: 1 = equal, < 1 = worse, > 1 = better.

    Args:
        value: the subnet's metric value.
        full: the full model's value of the same metric on the same task.
        higher_is_better: the metric's direction.

    Returns:
        ``value / full`` (higher is better) or ``full / value`` (lower is better); NaN when a value
        is negative or NaN or the denominator is 0 -- except two perfect scores on a lower-is-better
        metric (both 0), which is 1.0. A task the full model scores 0 on (higher is better) carries no
        retention signal: a subnet can only tie or look infinitely better, so it is left out.
    """
    num, den = (value, full) if higher_is_better else (full, value)
    if any(math.isnan(x) or x < 0 for x in (num, den)):
        return math.nan
    if den == 0:
        return 1.0 if (num == 0 and not higher_is_better) else math.nan
    return num / den


def relative_stderr(
    value: float, stderr: float, full: float, full_stderr: float, higher_is_better: bool
) -> float:
    """Delta-method stderr of :func:`relative_score` (independent errors); NaN where undefined.

    When both values are a perfect 0 (lower is better) the ratio is 1 by definition; its stderr is 0
    if both stderrs are 0 (a deterministic tie) and NaN otherwise.
    """
    num, den = (value, full) if higher_is_better else (full, value)
    se_num, se_den = (stderr, full_stderr) if higher_is_better else (full_stderr, stderr)
    if math.isnan(relative_score(value, full, higher_is_better)):
        return math.nan
    if den == 0:
        return 0.0 if se_num == 0 and se_den == 0 else math.nan
    return math.sqrt((se_num / den) ** 2 + (num * se_den / den**2) ** 2)


def primary_metrics(results: pd.DataFrame) -> dict[str, str]:
    """``{task: metric}``: the first metric each task reports (its declared primary metric)."""
    out: dict[str, str] = {}
    for task, metric in zip(results["task"], results["metric"]):
        out.setdefault(task, metric)
    return out


def primary_scores(results: pd.DataFrame) -> pd.DataFrame:
    """The results rows of each task's primary metric (:data:`SCORE_COLUMNS`)."""
    primary = primary_metrics(results)
    keep = results["metric"] == results["task"].map(primary)
    return results.loc[keep, SCORE_COLUMNS].reset_index(drop=True)


def relative_scores(scores: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    """``scores`` plus ``full_value``, ``full_stderr``, ``rel`` and ``rel_se`` against ``reference``.

    Tasks the reference subnet has no score on get NaN relative scores.
    """
    ref = scores.loc[scores["subnet"] == reference, ["task", "value", "stderr"]]
    ref = ref.rename(columns={"value": "full_value", "stderr": "full_stderr"})
    out = scores.merge(ref, on="task", how="left")
    rel, rel_se = [], []
    for row in out.itertuples(index=False):
        r = relative_score(row.value, row.full_value, row.higher_is_better)
        if row.subnet == reference:
            se = math.nan if math.isnan(r) else 0.0
        else:
            se = relative_stderr(row.value, row.stderr, row.full_value, row.full_stderr, row.higher_is_better)
        rel.append(r)
        rel_se.append(se)
    out["rel"] = rel
    out["rel_se"] = rel_se
    return out


def win_rates(scores: pd.DataFrame) -> pd.DataFrame:
    """Mean win rate per subnet (HELM), from :func:`primary_scores` rows.

    Returns:
        Columns ``subnet``, ``mean_win_rate`` (in [0, 1]) and ``n_tasks`` (tasks with at least one
        other subnet to compare with), sorted best first.
    """
    rates: dict[str, list[float]] = {s: [] for s in scores["subnet"].unique()}
    for _, task_rows in scores.groupby("task", sort=False):
        rows = task_rows.dropna(subset=["value"])
        if len(rows) < 2:
            continue
        sign = 1.0 if bool(rows["higher_is_better"].iloc[0]) else -1.0
        values = sign * rows["value"].to_numpy(dtype=np.float64)
        for subnet, v in zip(rows["subnet"], values):
            beats = np.count_nonzero(values < v) + 0.5 * (np.count_nonzero(values == v) - 1)
            rates[subnet].append(beats / (len(values) - 1))
    table = pd.DataFrame(
        {
            "subnet": list(rates),
            "mean_win_rate": [float(np.mean(r)) if r else math.nan for r in rates.values()],
            "n_tasks": [len(r) for r in rates.values()],
        }
    )
    return table.sort_values("mean_win_rate", ascending=False, na_position="last").reset_index(drop=True)
