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
query pool before and after RL, split into the queries that were hard and easy at the start.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import pandas as pd

from ernie5.store.runs import read_jsonl, write_atomic
from reports import plots
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
    ("pass_easy", "easy queries: pass init → final"),
)


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
    for part in ("hard", "easy"):
        if init and final and init.get(f"{part}_mean") is not None:
            row[f"pass_{part}"] = (init[f"{part}_mean"], final[f"{part}_mean"], init[f"n_{part}"])
    return row


def _fmt(key: str, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if key.startswith("pass_"):
        a, b, n = v
        return f"{a:.3f} → {b:.3f} (n={n})"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _smooth(values: list[float], k: int = 5) -> list[float]:
    return [_mean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def curves_figure(steps_by_arm: dict[str, list[dict]]) -> Figure:
    """Reward and entropy per step of every arm (5-step moving mean), as ``curves.png``."""
    series = {
        name: pd.DataFrame(
            {
                "step": [r["step"] for r in steps],
                "reward": _smooth([r["reward"] for r in steps]),
                "entropy": _smooth([r["entropy"] for r in steps]),
            }
        )
        for name, steps in steps_by_arm.items()
    }
    return Figure(plots.rl_curves(series), alt="reward and entropy", file="curves.png")


def rl_document(title: str, rows: dict[str, dict], curves: Figure, intro: str = "") -> Document:
    """The study as a document: one row per arm (see the module docstring), then the curves."""
    frame = pd.DataFrame(
        [
            {"arm": name, "steps": row["steps"], **{k: row.get(k) for k, _ in COLUMNS}}
            for name, row in rows.items()
        ]
    )
    formats = {k: partial(_fmt, k) for k, _ in COLUMNS}
    return Document(
        title=title,
        subtitle=intro,
        sections=(
            Section("arms", "Arms", (Table(frame, formats=formats, headers=dict(COLUMNS)),)),
            Section("curves", "Curves", (curves,)),
        ),
    )


def write_report(title: str, arms: dict[str, Path], out_dir: Path, intro: str = "") -> Path:
    """``out_dir/report.md``, ``report.html``, ``curves.png`` and ``summary.json`` of the study; the
    Markdown's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = {name: read_metrics(run) for name, run in arms.items()}  # each metrics.jsonl read once
    rows = {name: _summary_row(arms[name], *m) for name, m in metrics.items()}
    doc = rl_document(title, rows, curves_figure({name: m[0] for name, m in metrics.items()}), intro)
    write_figures(doc, out_dir)
    write_atomic(out_dir / "report.html", to_html(doc))
    write_atomic(out_dir / "summary.json", json.dumps(rows, indent=2, default=str))
    path = out_dir / "report.md"
    write_atomic(path, to_markdown(doc))
    return path
