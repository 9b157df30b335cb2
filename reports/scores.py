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
* **Chance-normalised relative score** (used when the run has a random baseline, see
  :mod:`reports.load`): retention of the *margin above the random model*,
  ``rel = s * (sub - rand) / (s * (full - rand))`` with ``s = +1`` (higher is better) or ``-1``
  (lower is better); the signs cancel, so it is ``(sub - rand) / (full - rand)``: 1 = as good as the
  full model, 0 = no better than random. A task answered at chance by the full model would otherwise
  show ~100% "retention" at every subnet (sub ~ full ~ chance) and prop up its modality. Undefined
  (NaN) when the full model is not above random at all (``s * (full - rand) <= 0``). Its stderr uses
  the delta method with the three stderrs treated as independent (conservative, as above):
  ``se^2 = (se_sub / D)^2 + ((sub - rand) se_full / D^2)^2 + ((sub - full) se_rand / D^2)^2``,
  ``D = full - rand``. Where the random model has no score on a task (old runs, or a unit it
  skipped) the plain ratio above is used and the row says ``normalised = False``.
* **Above chance**: the full model is significantly better than random on a task when its margin
  ``s * (full - rand) > 1.96 * sqrt(se_full^2 + se_rand^2)`` (a one-sided z-test at 2.5%, errors
  treated as independent). A NaN stderr (a metric that reports none, or one example) cannot establish
  the margin, so the task counts as *not* above chance; a stderr of 0 (a deterministic metric) is used
  as is. Tasks not above chance are flagged in the report and left out of every modality and
  capability average, the seesaw index and the degradation order; tasks without a random score
  (``above_chance`` NaN, unknown) are kept, as before.
* **Mean win rate** (HELM): per task, the share of the other subnets a subnet beats on the primary
  metric (ties count one half), averaged over the tasks the subnet has a score on (the report
  leaves tasks at chance out: ranking sub-models on noise says nothing).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

REFERENCE = "full"
"""The subnet every relative score is taken against."""
Z95 = 1.959964
"""Two-sided 95% normal quantile (the one-sided 2.5% test of :func:`above_chance`)."""
RETENTION_NORMALISED = "chance-normalised: (sub \u2212 random) / (full \u2212 random)"
RETENTION_RATIO = "plain ratio sub/full (no random baseline in this run)"

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


def _sign(higher_is_better: bool) -> float:
    return 1.0 if higher_is_better else -1.0


def chance_normalised_score(value: float, full: float, rand: float, higher_is_better: bool) -> float:
    """Retention of the margin above the random model: ``s (value - rand) / s (full - rand)``.

    Args:
        value: the subnet's metric value.
        full: the full model's value.
        rand: the random baseline's value.
        higher_is_better: the metric's direction (``s = +1`` or ``-1``).

    Returns:
        1 = the full model's margin kept, 0 = no better than random, < 0 = worse than random; NaN when
        a value is NaN or the full model is not above random (``s (full - rand) <= 0``).
    """
    s = _sign(higher_is_better)
    den = s * (full - rand)
    if any(math.isnan(x) for x in (value, full, rand)) or not den > 0:
        return math.nan
    return s * (value - rand) / den


def chance_normalised_stderr(
    value: float,
    stderr: float,
    full: float,
    full_stderr: float,
    rand: float,
    rand_stderr: float,
    higher_is_better: bool,
) -> float:
    """Delta-method stderr of :func:`chance_normalised_score`, the three stderrs independent.

    With ``D = full - rand``: ``sqrt((se / D)^2 + ((value - rand) se_full / D^2)^2 +
    ((value - full) se_rand / D^2)^2)``; NaN where the score is or a stderr is NaN.
    """
    if math.isnan(chance_normalised_score(value, full, rand, higher_is_better)):
        return math.nan
    d = full - rand
    return math.sqrt(
        (stderr / d) ** 2
        + ((value - rand) * full_stderr / d**2) ** 2
        + ((value - full) * rand_stderr / d**2) ** 2
    )


def chance_margin(
    full: float, full_stderr: float, rand: float, rand_stderr: float, higher_is_better: bool
) -> tuple[float, float]:
    """The full model's margin over random, ``s (full - rand)``, and its stderr (independent errors)."""
    return _sign(higher_is_better) * (full - rand), math.sqrt(full_stderr**2 + rand_stderr**2)


def above_chance(
    full: float, full_stderr: float, rand: float, rand_stderr: float, higher_is_better: bool
) -> bool:
    """Whether the full model is significantly above random: ``margin > 1.96 * se(margin)``.

    A NaN stderr cannot establish the margin: False (see the module docstring). Callers pass only
    tasks with both values; a NaN value is False too.
    """
    margin, se = chance_margin(full, full_stderr, rand, rand_stderr, higher_is_better)
    return bool(margin > Z95 * se)  # any NaN -> False


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


def relative_scores(
    scores: pd.DataFrame, reference: str = REFERENCE, baseline: pd.DataFrame | None = None
) -> pd.DataFrame:
    """``scores`` plus ``full_value``, ``full_stderr``, ``rel`` and ``rel_se`` against ``reference``.

    Args:
        scores: :func:`primary_scores` rows of the real subnets.
        reference: the full model's subnet name.
        baseline: the random baseline's results rows (any metrics; matched on task and metric), or
            None for a run without one.

    Returns:
        Also ``rand_value`` and ``rand_stderr`` (NaN without a random score), ``above_chance``
        (True/False where the task has a full and a random score, NaN otherwise) and ``normalised``
        (True where ``rel`` is :func:`chance_normalised_score`, False where it is
        :func:`relative_score`). Tasks the reference subnet has no score on get NaN relative scores.
    """
    ref = scores.loc[scores["subnet"] == reference, ["task", "value", "stderr"]]
    ref = ref.rename(columns={"value": "full_value", "stderr": "full_stderr"})
    out = scores.merge(ref, on="task", how="left")
    if baseline is not None and len(baseline):
        rand = baseline[["task", "metric", "value", "stderr"]].drop_duplicates(["task", "metric"])
        rand = rand.rename(columns={"value": "rand_value", "stderr": "rand_stderr"})
        out = out.merge(rand, on=["task", "metric"], how="left")
    else:
        out["rand_value"] = math.nan
        out["rand_stderr"] = math.nan
    rel, rel_se, above, normalised = [], [], [], []
    for row in out.itertuples(index=False):
        hib = bool(row.higher_is_better)
        norm = not math.isnan(row.rand_value)
        if norm:
            r = chance_normalised_score(row.value, row.full_value, row.rand_value, hib)
            se = chance_normalised_stderr(
                row.value, row.stderr, row.full_value, row.full_stderr, row.rand_value, row.rand_stderr, hib
            )
            known = not math.isnan(row.full_value)
            above.append(
                above_chance(row.full_value, row.full_stderr, row.rand_value, row.rand_stderr, hib)
                if known
                else math.nan
            )
        else:
            r = relative_score(row.value, row.full_value, hib)
            se = relative_stderr(row.value, row.stderr, row.full_value, row.full_stderr, hib)
            above.append(math.nan)
        if row.subnet == reference:
            se = math.nan if math.isnan(r) else 0.0
        rel.append(r)
        rel_se.append(se)
        normalised.append(norm)
    out["rel"] = rel
    out["rel_se"] = rel_se
    out["above_chance"] = pd.Series(above, index=out.index, dtype=object)
    out["normalised"] = pd.Series(normalised, index=out.index, dtype=bool)
    return out


def at_chance(rel: pd.DataFrame) -> pd.Series:
    """Rows whose task the full model does not answer significantly above random (``above_chance``
    False); all False for frames without the column (no baseline)."""
    if "above_chance" not in rel:
        return pd.Series(False, index=rel.index)
    return rel["above_chance"].map(lambda v: v is not None and not pd.isna(v) and not bool(v)).astype(bool)


def chance_table(rel: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    """One row per task with a random score: ``task``, ``modality``, ``capability``, ``metric``,
    ``higher_is_better``, ``full_value``, ``rand_value``, ``margin`` (``s (full - rand)``),
    ``margin_ci_low``/``margin_ci_high`` (95%) and ``above_chance``."""
    cols = [
        "task",
        "modality",
        "capability",
        "metric",
        "higher_is_better",
        "full_value",
        "rand_value",
        "margin",
        "margin_ci_low",
        "margin_ci_high",
        "above_chance",
    ]
    if "rand_value" not in rel:
        return pd.DataFrame(columns=cols)
    rows = []
    ref = rel[(rel["subnet"] == reference) & rel["rand_value"].notna()]
    for row in ref.itertuples(index=False):
        margin, se = chance_margin(
            row.full_value, row.full_stderr, row.rand_value, row.rand_stderr, bool(row.higher_is_better)
        )
        rows.append(
            {
                "task": row.task,
                "modality": row.modality,
                "capability": row.capability,
                "metric": row.metric,
                "higher_is_better": bool(row.higher_is_better),
                "full_value": row.full_value,
                "rand_value": row.rand_value,
                "margin": margin,
                "margin_ci_low": margin - Z95 * se,
                "margin_ci_high": margin + Z95 * se,
                "above_chance": bool(row.above_chance) if not pd.isna(row.above_chance) else False,
            }
        )
    return pd.DataFrame(rows, columns=cols)


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
