"""``ernie5 report RUN_DIR``: a self-contained HTML report, a Markdown summary and CSV/JSON tables.

Writes ``index.html`` (figures embedded, nothing fetched when viewed), ``summary.md`` (the same
document's headlines, for a CI log or a pull request, with its seesaw figure beside it) and
``tables/<name>.csv|json`` into ``RUN_DIR/report/`` (or ``out_dir``), both from one
:class:`~reports.render.document.Document`. Rebuilding overwrites these files and leaves anything else
in the folder (such as a comparison) alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from ernie5.store.runs import write_atomic
from reports import drilldown, sections
from reports.analysis import Analysis, analyze, tables
from reports.beside import Beside, beside_section, compare
from reports.definitions import ABOUT
from reports.load import Run, load_run
from reports.render.document import Definitions, Document, Section
from reports.render.files import write_figures
from reports.render.html import to_html
from reports.render.markdown import to_markdown


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


def report_document(run: Run, analysis: Analysis, html_path: str, beside: Beside | None = None) -> Document:
    """The run report: the answer first (verdicts and the seesaw figure; with ``beside``, what this
    model and the other lose first), then the seesaw, efficiency, the units, routing, the drill-down
    and the definitions; ``html_path`` is named in the overview."""
    m = run.manifest
    first = (
        (Section("beside", f"Beside {beside.names[1]}", beside_section(beside)),)
        if beside is not None
        else ()
    )
    return Document(
        f"ERNIE 5 sweep report: {run.name}",
        f"Run {run.name} | suite {m.get('suite', '?')} | checkpoint {m.get('checkpoint', '?')} | "
        f"finished {m.get('finished', '?')}",
        (
            Section("overview", "Overview", sections.overview(run, analysis, html_path)),
            *first,
            Section("seesaw", "Capability seesaw", sections.seesaw(analysis)),
            Section("efficiency", "Efficiency trade-offs", sections.efficiency(analysis)),
            Section("units", "Units", sections.units(run, analysis)),
            Section("routing", "Routing analysis", drilldown.routing_section(run, analysis), markdown=False),
            Section("tasks", "Per-task drill-down", drilldown.drilldown(run, analysis), markdown=False),
            Section("about", "About these numbers", (Definitions(ABOUT),), markdown=False),
        ),
    )


def build_report(
    run_dir: str | Path, out_dir: str | Path | None = None, beside: str | Path | None = None
) -> Path:
    """Build the report of a sweep run.

    Args:
        run_dir: the run folder (``manifest.json``, ``units/``, ...; see :mod:`evals.results`).
        out_dir: where to write; default ``RUN_DIR/report``.
        beside: another sweep run folder (another model, e.g. a Hugging Face MoE): the report then
            opens with what each model loses first under the same cuts (:mod:`reports.beside`).

    Returns:
        The report folder (with ``index.html``, ``summary.md``, its figure, ``tables/``).

    Raises:
        ReportError: ``run_dir`` is not a sweep run folder.
    """
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path / "report"
    analysis = analyze(run)
    frames = tables(run, analysis)
    side = None
    if beside is not None:
        other = load_run(beside)
        side = compare(run, analysis, other, analyze(other))
        frames["beside"] = side.table()
    write_tables(frames, out / "tables")
    doc = report_document(run, analysis, str(out / "index.html"), beside=side)
    write_figures(doc, out)
    write_atomic(out / "index.html", to_html(doc))
    write_atomic(out / "summary.md", to_markdown(doc))
    return out
