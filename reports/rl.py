"""RL run folders -> one report: a table and curves per arm (``ernie5 rl-study`` writes it), built as a
:class:`~reports.render.document.Document` and rendered to ``report.md`` and ``report.html`` by
:mod:`reports.render`.

Reads only what ``ernie5 rl`` wrote (``metrics.jsonl``, ``config.yaml``). Each arm is one RL run; the
section shows reward and entropy over the steps (a 5-step moving mean), and a table with, per arm: the
reward and entropy over the first and last ten steps, the lowest entropy (collapse shows there), the
response length of the trained batches against the length of every rollout the engine finished
(``sync`` trains on exactly the data distribution), the learner's idle time and the engine's slot use,
the share of each task among the trained responses (overall, and of the rarest task over the
first six steps: APRIL's batches drift from the data order there), the policy-version lag of the
trained tokens, the fractions masked by IcePop and WPSM and
clipped, and the full model's no-hint success rate on the
query pool before and after RL, split into the queries that were hard, sparse (pass rate <= 0.1)
and easy at the start.

Held-out scores: where ``ernie5 rl-study`` swept a run's last checkpoint over the harness's own items of
its tasks (``RUN/heldout/results.csv``, :data:`HELDOUT_DIR`), each task's metrics become figures of the
arm (``heldout TASK METRIC``), shown in their own table beside the starting checkpoint's and tested in
*Differences* with the claims.

Seeds: an arm may be several runs (one per seed). Each figure is then the mean over seeds with its 95 %
t-interval (``mean ± half-width``), the curves are the seeds' mean, and a *Differences* section tests
every other arm against the first (the study's reference arm) on the claims' figures (final reward,
final and lowest entropy, the hard and sparse queries' final pass rates): Welch's t-test over seeds,
Holm-adjusted over the section, significant at 0.05.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from ernie5.store.runs import read_jsonl, write_atomic
from reports import paired, plots
from reports.render.document import Document, Figure, Section, Table
from reports.render.files import write_figures
from reports.render.html import to_html
from reports.render.markdown import to_markdown

COLUMNS = (
    ("reward_first", "reward (first 10)"),
    ("reward_last", "reward (last 10)"),
    ("entropy_first", "entropy (first 10)"),
    ("entropy_last", "entropy (last 10)"),
    ("entropy_min", "entropy min"),
    ("trained_len", "trained length"),
    ("task_mix", "trained task mix"),
    ("rare_share", "rarest task's share, steps 1-6"),
    ("staleness", "staleness (versions)"),
    ("idle_s", "learner idle s/step"),
    ("slot_utilisation", "slot use"),
    ("mismatch_masked_frac", "IcePop masked"),
    ("wpsm_masked_frac", "WPSM masked"),
    ("clip_frac", "clipped"),
    ("pass_hard", "hard queries: pass init → final"),
    ("pass_sparse", "sparse queries: pass init → final"),
    ("pass_easy", "easy queries: pass init → final"),
)
CLAIMS = (
    ("reward_last", "reward (last 10)"),
    ("entropy_last", "entropy (last 10)"),
    ("entropy_min", "entropy min"),
    ("pass_hard_final", "hard queries: final pass"),
    ("pass_sparse_final", "sparse queries: final pass"),
)
"""The figures the Differences section tests (the paper's claims: reward, entropy, hard-query pass)."""
ALPHA = 0.05
HELDOUT_DIR = "heldout"
"""The sweep of a run's last checkpoint over the harness's items of its tasks (inside the run folder)."""
HELDOUT_PREFIX = "heldout "


def read_heldout(run: Path) -> dict[str, float]:
    """``{"heldout TASK METRIC": value}`` of the full model in ``run/heldout/results.csv`` (empty when
    that sweep was not run)."""
    path = Path(run) / HELDOUT_DIR / "results.csv"
    if not path.is_file():
        return {}
    frame = pd.read_csv(path)
    frame = frame[frame["subnet"] == "full"]
    return {f"{HELDOUT_PREFIX}{r.task} {r.metric}": float(r.value) for r in frame.itertuples()}


def read_metrics(run: Path) -> tuple[list[dict], dict[str, dict]]:
    """The step records and the events (by name) of an RL run folder."""
    steps, events = [], {}
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run}: no metrics.jsonl (not an RL run folder)")
    for rec in read_jsonl(path):  # a line torn by a killed run is skipped
        if "event" in rec:
            events[rec["event"]] = rec
        else:
            steps.append(rec)
    return steps, events


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize(run: Path) -> dict:
    """One arm's table row (see the module docstring)."""
    return _summary_row(run, *read_metrics(run))


def _summary_row(run: Path, steps: list[dict], events: dict[str, dict]) -> dict:
    if not steps:
        raise ValueError(f"{run}: no RL steps recorded yet")

    def col(key: str, recs: list[dict]) -> list[float]:
        return [r[key] for r in recs if r.get(key) is not None]

    first, last = steps[:10], steps[-10:]
    row = {
        "steps": len(steps),
        "reward_first": _mean(col("reward", first)),
        "reward_last": _mean(col("reward", last)),
        "entropy_first": _mean(col("entropy", first)),
        "entropy_last": _mean(col("entropy", last)),
        "entropy_min": min(col("entropy", steps)),
        "trained_len": _mean(col("response_len", steps)),
    }
    for key in (
        "idle_s",
        "slot_utilisation",
        "mismatch_masked_frac",
        "wpsm_masked_frac",
        "clip_frac",
        "staleness",
    ):
        row[key] = _mean(col(key, steps))
    counts: dict[str, int] = {}
    for r in steps:
        for task, n in r.get("rows_by_task", {}).items():
            counts[task] = counts.get(task, 0) + n
    if counts:
        total = sum(counts.values())
        row["task_mix"] = " / ".join(f"{t} {n / total:.2f}" for t, n in sorted(counts.items()))
        if len(counts) > 1:
            rare = min(counts, key=counts.get)
            shares = [r["rows_by_task"].get(rare, 0) / sum(r["rows_by_task"].values()) for r in steps[:6]]
            row["rare_share"] = f"{rare}: " + " ".join(f"{x:.2f}" for x in shares)
    init, final = events.get("pass_init"), events.get("pass_final")
    for part in ("hard", "sparse", "easy"):
        if init and final and init.get(f"{part}_mean") is not None and final.get(f"{part}_mean") is not None:
            row[f"pass_{part}"] = (init[f"{part}_mean"], final[f"{part}_mean"], init[f"n_{part}"])
            row[f"pass_{part}_final"] = final[f"{part}_mean"]
    return row | read_heldout(run)


def interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t-interval over seeds (NaN with fewer than two)."""
    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if len(x) == 0:
        return math.nan, math.nan
    if len(x) < 2:
        return float(x.mean()), math.nan
    half = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return float(x.mean()), half


def aggregate(rows: list[dict]) -> dict:
    """One arm's row over its seeds: every number as ``(mean, half-width, n)``, pass rates as
    ``((init mean, half), (final mean, half), n queries)``, text cells from the first seed."""
    out: dict = {"steps": rows[0]["steps"], "seeds": len(rows)}
    for key in {k for r in rows for k in r}:
        values = [r[key] for r in rows if key in r]
        if key.startswith("pass_") and not key.endswith("_final"):
            out[key] = (interval([v[0] for v in values]), interval([v[1] for v in values]), values[0][2])
        elif all(isinstance(v, (int, float)) for v in values) and key != "steps":
            out[key] = (*interval(values), len(values))
        elif key != "steps":
            out[key] = values[0]
    return out


def _num(mean: float, half: float) -> str:
    return f"{mean:.3f}" if math.isnan(half) else f"{mean:.3f} ± {half:.3f}"


def _fmt(key: str, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if key.startswith("pass_"):
        (a, ha), (b, hb), n = v
        return f"{_num(a, ha)} → {_num(b, hb)} (n={n})"
    if isinstance(v, tuple):
        return "–" if math.isnan(v[0]) else _num(v[0], v[1])
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def differences(rows_by_arm: dict[str, list[dict]]) -> pd.DataFrame:
    """Every other arm against the first on :data:`CLAIMS`: difference of means over seeds, Welch's
    t-test, Holm-adjusted p over the table, and the verdict."""
    names = list(rows_by_arm)
    heldout = sorted(
        {k for rows in rows_by_arm.values() for r in rows for k in r if k.startswith(HELDOUT_PREFIX)}
    )
    out = []
    for arm in names[1:]:
        for key, label in (*CLAIMS, *((k, k) for k in heldout)):
            base = [r[key] for r in rows_by_arm[names[0]] if r.get(key) is not None]
            new = [r[key] for r in rows_by_arm[arm] if r.get(key) is not None]
            if not base or not new:
                continue
            delta = float(np.mean(new) - np.mean(base))
            p = math.nan
            if len(base) >= 2 and len(new) >= 2:
                if np.ptp(base) == 0 and np.ptp(new) == 0:  # no spread in either arm: exact
                    p = 1.0 if delta == 0 else 0.0
                else:
                    with warnings.catch_warnings():  # near-identical seeds: scipy warns, the p stands
                        warnings.simplefilter("ignore", RuntimeWarning)
                        p = float(stats.ttest_ind(new, base, equal_var=False).pvalue)
            out.append(
                {"arm": arm, "figure": label, "delta": delta, "p_value": p, "n": (len(new), len(base))}
            )
    frame = pd.DataFrame(out, columns=["arm", "figure", "delta", "p_value", "n"])
    frame["p_adjusted"] = paired.holm(frame["p_value"].tolist()) if len(frame) else []
    frame["verdict"] = [
        "n/a (one seed)"
        if math.isnan(p)
        else ("higher" if d > 0 else "lower")
        if p < ALPHA
        else "no difference"
        for d, p in zip(frame["delta"], frame["p_adjusted"], strict=True)
    ]
    frame["seeds"] = [f"{a} vs {b}" for a, b in frame.pop("n")]
    return frame


def _smooth(values: list[float], k: int = 5) -> list[float]:
    return [_mean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def curves_figure(steps_by_arm: dict[str, list[list[dict]]]) -> Figure:
    """Reward and entropy per step of every arm (the seeds' mean, 5-step moving mean), as ``curves.png``."""
    series = {}
    for name, seeds in steps_by_arm.items():
        by_step: dict[int, list[dict]] = {}
        for steps in seeds:
            for r in steps:
                by_step.setdefault(r["step"], []).append(r)
        order = sorted(by_step)
        series[name] = pd.DataFrame(
            {
                "step": order,
                "reward": _smooth([_mean([r["reward"] for r in by_step[s]]) for s in order]),
                "entropy": _smooth([_mean([r["entropy"] for r in by_step[s]]) for s in order]),
            }
        )
    return Figure(plots.rl_curves(series), alt="reward and entropy", file="curves.png")


def heldout_table(rows: dict[str, dict], start: dict[str, float] | None) -> Table | None:
    """The held-out scores: the starting checkpoint, then every arm (mean ± interval over seeds)."""
    keys = sorted({k for row in rows.values() for k in row if k.startswith(HELDOUT_PREFIX)})
    if not keys:
        return None
    records = []
    if start:
        records.append({"model": "start (before RL)", "seeds": 1, **{k: start.get(k) for k in keys}})
    records += [
        {"model": name, "seeds": row.get("seeds", 1), **{k: row.get(k) for k in keys}}
        for name, row in rows.items()
    ]
    headers = {k: k[len(HELDOUT_PREFIX) :] for k in keys}
    return Table(pd.DataFrame(records), formats={k: partial(_fmt, k) for k in keys}, headers=headers)


def rl_document(
    title: str,
    rows: dict[str, dict],
    curves: Figure,
    intro: str = "",
    diffs: pd.DataFrame | None = None,
    start: dict[str, float] | None = None,
) -> Document:
    """The study as a document: one row per arm (seeds aggregated), the held-out scores, the
    differences, then the curves."""
    frame = pd.DataFrame(
        [
            {
                "arm": name,
                "seeds": row.get("seeds", 1),
                "steps": row["steps"],
                **{k: row.get(k) for k, _ in COLUMNS},
            }
            for name, row in rows.items()
        ]
    )
    formats = {k: partial(_fmt, k) for k, _ in COLUMNS}
    sections = [Section("arms", "Arms", (Table(frame, formats=formats, headers=dict(COLUMNS)),))]
    heldout = heldout_table(rows, start)
    if heldout is not None:
        sections.append(Section("heldout", "Held-out harness scores after RL", (heldout,)))
    if diffs is not None and len(diffs):
        sections.append(
            Section(
                "differences",
                f"Differences from {next(iter(rows))}",
                (
                    Table(
                        diffs,
                        formats={
                            "delta": lambda v: f"{v:+.3f}",
                            "p_value": lambda v: "–" if math.isnan(v) else f"{v:.3g}",
                            "p_adjusted": lambda v: "–" if math.isnan(v) else f"{v:.3g}",
                        },
                        headers={"p_value": "p (Welch)", "p_adjusted": "p (Holm)"},
                    ),
                ),
            )
        )
    sections.append(Section("curves", "Curves", (curves,)))
    return Document(title=title, subtitle=intro, sections=tuple(sections))


def write_report(
    title: str,
    arms: dict[str, Path | Sequence[Path]],
    out_dir: Path,
    intro: str = "",
    start: Path | None = None,
) -> Path:
    """``out_dir/report.md``, ``report.html``, ``curves.png`` and ``summary.json`` of the study; the
    Markdown's path. Each arm is one run folder or a list of them (one per seed); ``start`` is the
    folder holding the starting checkpoint's held-out sweep (``start/heldout/``), if one was run."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {
        name: [Path(r)] if isinstance(r, (str, Path)) else [Path(x) for x in r] for name, r in arms.items()
    }
    metrics = {name: [read_metrics(run) for run in rs] for name, rs in runs.items()}  # each read once
    per_seed = {
        name: [_summary_row(run, *m) for run, m in zip(runs[name], ms, strict=True)]
        for name, ms in metrics.items()
    }
    rows = {name: aggregate(seed_rows) for name, seed_rows in per_seed.items()}
    diffs = differences(per_seed)
    curves = curves_figure({name: [m[0] for m in ms] for name, ms in metrics.items()})
    start_scores = read_heldout(start) if start is not None else None
    doc = rl_document(title, rows, curves, intro, diffs, start_scores)
    write_figures(doc, out_dir)
    write_atomic(out_dir / "report.html", to_html(doc))
    summary = {name: {"seeds": per_seed[name], "mean": rows[name]} for name in rows} | {
        "differences": diffs.to_dict(orient="records")
    }
    if start_scores is not None:
        summary["start_heldout"] = start_scores
    write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2, default=str))
    path = out_dir / "report.md"
    write_atomic(path, to_markdown(doc))
    return path
