"""Efficiency trade-offs: which subnets sit on the score-versus-cost Pareto frontier.

* **Aggregate score** of a subnet: the mean of its per-modality group scores (see
  :mod:`reports.seesaw`), so each modality weighs the same however many tasks it has; tasks at
  chance (not significantly above the random baseline) are not in those group scores.
* **Costs** (lower is better): active parameters, total parameters, decode latency
  (``1000 / decode_tokens_per_s`` ms per token) and FLOPs per token, from ``efficiency.csv``.
* **Pareto frontier**: the non-dominated subnets; a subnet is dominated when another has at least
  its score at no more cost, and is strictly better in one of the two.
* **Operating points** (the paper's §6.4.2 Table 12): ``ES`` is the top-k-only subnet whose top-k is
  closest to 25% of the full top-k; ``EA`` is the best-scoring subnet with depth, width and top-k
  all reduced. Speedup is measured decode throughput over the full model's.
* **Failed measurements**: a row ``efficiency.csv`` marks ``status = failed`` (see
  ``evals.efficiency``), or whose prefill or decode figure is not finite or not positive, has every
  timing set to NaN and ``timing_failed`` set: it is shown as "measurement failed", never enters a
  speedup, and sits on no decode-latency frontier (its analytic costs, parameters and FLOPs, still
  count).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from reports.load import text_column

COSTS: dict[str, tuple[str, str]] = {
    "active_params": ("Active parameters", "parameters"),
    "total_params": ("Total parameters", "parameters"),
    "decode_ms_per_token": ("Decode latency", "ms / token"),
    "flops_per_token": ("FLOPs per token", "FLOPs"),
}
"""Cost column -> (title, unit)."""
DIMS = ("depth", "width", "top_k")
_NAME_DIMS = {"depth": "d", "width": "w", "top_k": "k"}
PAPER_POINTS = {
    "ES": "ERNIE 5.0-Exp-ES25.0%: top-k cut to 25% -> 98.5% of the AVG score, > 15% faster decoding",
    "EA": "ERNIE 5.0-Exp-EA35.8%: 53.7% active / 35.8% total params -> 99.5% of the AVG score",
}


def pareto_front(score: list[float] | np.ndarray, cost: list[float] | np.ndarray) -> list[bool]:
    """For each point, whether it is non-dominated (higher score and lower cost are better).

    Points with a NaN score or cost are never on the frontier; identical points are all on it.
    """
    s, c = np.asarray(score, dtype=np.float64), np.asarray(cost, dtype=np.float64)
    valid = ~(np.isnan(s) | np.isnan(c))
    out = []
    for i in range(len(s)):
        if not valid[i]:
            out.append(False)
            continue
        dominated = valid & (s >= s[i]) & (c <= c[i]) & ((s > s[i]) | (c < c[i]))
        out.append(not dominated.any())
    return out


FAILED = "measurement failed"
"""How a failed timing is shown."""
TIMINGS = (
    "prefill_ms",
    "prefill_ms_low",
    "prefill_ms_high",
    "decode_tokens_per_s",
    "decode_tokens_per_s_low",
    "decode_tokens_per_s_high",
)
"""The measured (not analytic) columns of ``efficiency.csv`` that a failed measurement voids."""


def efficiency_table(eff: pd.DataFrame) -> pd.DataFrame:
    """``efficiency.csv`` plus ``decode_ms_per_token`` and ``timing_failed`` (failed timings voided,
    see the module docstring); ``active_params`` falls back to the measured."""
    out = eff.copy()
    status, reason = (text_column(out, c) for c in ("status", "reason"))
    failed = status == "failed"
    for col in ("prefill_ms", "decode_tokens_per_s"):
        v = pd.to_numeric(out[col], errors="coerce") if col in out else pd.Series(math.nan, index=out.index)
        bad = v.notna() & ~(np.isfinite(v) & (v > 0))
        reason = reason.where(~bad | failed, f"{col} is not a positive finite number")
        failed = failed | bad
    for col in TIMINGS:
        if col in out:
            out[col] = pd.to_numeric(out[col], errors="coerce").where(~failed)
    out["timing_failed"] = failed
    out["status"] = status.where(~failed, "failed")
    out["reason"] = reason
    tps = pd.to_numeric(out["decode_tokens_per_s"], errors="coerce")
    out["decode_ms_per_token"] = 1000.0 / tps.where(tps > 0)
    measured = pd.to_numeric(out["active_params_measured"], errors="coerce")
    out["active_params"] = pd.to_numeric(out["active_params"], errors="coerce").fillna(measured)
    return out


def aggregate_scores(groups: pd.DataFrame) -> pd.DataFrame:
    """Per subnet, the mean of its modality group scores (``score``) with a propagated 95% interval.

    Args:
        groups: :func:`reports.seesaw.group_scores` rows (per modality).

    Returns:
        Columns ``subnet``, ``score``, ``ci_low``, ``ci_high``, ``n_modalities``.
    """
    rows = []
    for subnet, g in groups.dropna(subset=["rel"]).groupby("subnet", sort=False):
        m = len(g)
        mean = float(g["rel"].mean())
        half = math.sqrt(float(((g["ci_high"] - g["rel"]) ** 2).sum(skipna=False))) / m
        rows.append(
            {
                "subnet": subnet,
                "score": mean,
                "ci_low": mean - half,
                "ci_high": mean + half,
                "n_modalities": m,
            }
        )
    return pd.DataFrame(rows, columns=["subnet", "score", "ci_low", "ci_high", "n_modalities"])


def pareto_table(agg: pd.DataFrame, eff: pd.DataFrame) -> pd.DataFrame:
    """Aggregate score and every cost per subnet, with ``front_<cost>`` frontier flags."""
    cols = ["subnet", *COSTS] + (["timing_failed"] if "timing_failed" in eff else [])
    table = agg[["subnet", "score"]].merge(eff[cols], on="subnet", how="left")
    for cost in COSTS:
        table[f"front_{cost}"] = pareto_front(table["score"], pd.to_numeric(table[cost], errors="coerce"))
    return table


def reduced_dims(row: pd.Series, full: pd.Series | None) -> set[str]:
    """Which of depth / width / top-k a subnet reduces, from its efficiency row (else its name)."""
    out = set()
    for dim in DIMS:
        value = pd.to_numeric(row.get(dim), errors="coerce")
        ref = pd.to_numeric(full.get(dim), errors="coerce") if full is not None else math.nan
        if not (pd.isna(value) or pd.isna(ref)):
            if value < ref:
                out.add(dim)
        elif re.search(rf"(?:^|-){_NAME_DIMS[dim]}\d", str(row["subnet"])):
            out.add(dim)
    return out


def operating_points(eff: pd.DataFrame, agg: pd.DataFrame, reference: str = "full") -> pd.DataFrame:
    """The paper-style operating points found in this run (``ES``: top-k only; ``EA``: all three).

    Args:
        eff: :func:`efficiency_table` rows.
        agg: :func:`aggregate_scores` rows.
        reference: the full model's subnet name.

    Returns:
        Columns ``point``, ``subnet``, ``top_k_fraction``, ``score``, ``active_pct``, ``total_pct``,
        ``speedup`` (NaN when either timing failed), ``speedup_failed``, ``paper``; no row for a point
        the run has no subnet for.
    """
    table = eff.merge(agg[["subnet", "score"]], on="subnet", how="left")
    table = table[table["score"].notna() | (table["subnet"] == reference)]
    full_rows = table[table["subnet"] == reference]
    full = full_rows.iloc[0] if len(full_rows) else None
    dims = {row["subnet"]: reduced_dims(row, full) for _, row in table.iterrows()}
    table["top_k_fraction"] = pd.to_numeric(table["top_k"], errors="coerce") / (
        float(full["top_k"]) if full is not None and not pd.isna(full["top_k"]) else math.nan
    )
    es = table[[dims[s] == {"top_k"} for s in table["subnet"]]]
    es = es.assign(dist=(es["top_k_fraction"] - 0.25).abs()).sort_values(["dist", "top_k_fraction"])
    ea = table[[dims[s] == set(DIMS) for s in table["subnet"]]]
    ea = ea.sort_values(["score", "active_params"], ascending=[False, True], na_position="last")
    rows = []
    for point, cands in (("ES", es), ("EA", ea)):
        if cands.empty:
            continue
        r = cands.iloc[0]

        def pct(col: str, r: pd.Series = r) -> float:
            ref = float(full[col]) if full is not None else math.nan
            return float(r[col]) / ref if ref and not math.isnan(ref) else math.nan

        speed_failed = bool(r.get("timing_failed", False)) or (
            full is not None and bool(full.get("timing_failed", False))
        )
        rows.append(
            {
                "point": point,
                "subnet": r["subnet"],
                "top_k_fraction": float(r["top_k_fraction"]),
                "score": float(r["score"]),
                "active_pct": pct("active_params"),
                "total_pct": pct("total_params"),
                "speedup": math.nan if speed_failed else pct("decode_tokens_per_s"),
                "speedup_failed": speed_failed,
                "paper": PAPER_POINTS[point],
            }
        )
    cols = [
        "point",
        "subnet",
        "top_k_fraction",
        "score",
        "active_pct",
        "total_pct",
        "speedup",
        "speedup_failed",
        "paper",
    ]
    return pd.DataFrame(rows, columns=cols)
