"""``ernie5 report RUN_DIR``: a self-contained HTML report, a Markdown summary and CSV/JSON tables.

Writes ``index.html`` (figures embedded, nothing fetched when viewed), ``summary.md`` and
``tables/<name>.csv|json`` into ``RUN_DIR/report/`` (or ``out_dir``). Rebuilding overwrites these
files and leaves anything else in the folder (such as a comparison) alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from ernie5.store.runs import write_atomic
from reports import sections
from reports.analysis import analyze, tables
from reports.html import page
from reports.load import load_run
from reports.markdown import report_summary


def _jsonable(df: pd.DataFrame) -> list[dict]:
    records = df.to_dict(orient="records")
    return [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in records
    ]


def write_tables(frames: dict[str, pd.DataFrame], folder: Path) -> None:
    """Each frame as ``<name>.csv`` and ``<name>.json`` (records; NaN as null) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, df in frames.items():
        write_atomic(folder / f"{name}.csv", df.to_csv(index=False))
        write_atomic(folder / f"{name}.json", json.dumps(_jsonable(df), indent=1, default=str) + "\n")


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Build the report of a sweep run.

    Args:
        run_dir: the run folder (``manifest.json``, ``units/``, ...; see :mod:`evals.results`).
        out_dir: where to write; default ``RUN_DIR/report``.

    Returns:
        The report folder (with ``index.html``, ``summary.md``, ``tables/``).

    Raises:
        ReportError: ``run_dir`` is not a sweep run folder.
    """
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path / "report"
    analysis = analyze(run)
    write_tables(tables(run, analysis), out / "tables")
    m = run.manifest
    subtitle = (
        f"Run {run.name} | suite {m.get('suite', '?')} | checkpoint {m.get('checkpoint', '?')} | "
        f"finished {m.get('finished', '?')}"
    )
    body = [
        ("overview", "Overview", sections.overview(run, analysis)),
        ("seesaw", "Capability seesaw", sections.seesaw(analysis)),
        ("efficiency", "Efficiency trade-offs", sections.efficiency(analysis)),
        ("routing", "Routing analysis", sections.routing_section(run, analysis)),
        ("tasks", "Per-task drill-down", sections.drilldown(run, analysis)),
        ("about", "About these numbers", sections.about()),
    ]
    write_atomic(out / "index.html", page(f"ERNIE 5 sweep report: {run.name}", subtitle, body))
    write_atomic(out / "summary.md", report_summary(run, analysis, str(out / "index.html")))
    return out
