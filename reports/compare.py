"""``ernie5 compare BASE_RUN NEW_RUN``: per (subnet, task, metric) changes with paired statistics.

Every cell of either run gets a row with a ``status``:

* ``compared``: ok in both runs; tested on the examples both scored (see :mod:`reports.paired`);
* ``version changed``: ok in both but the task version differs; shown, tested, never gating;
* ``new`` / ``missing``: ok in only one run (``note`` says why the other has none);
* ``failing``: ok in the base run, an error in the new one (counts as a regression).

``verdict`` is ``regression``, ``improvement``, ``no change`` or ``n/a``. Two runs with no cell that
can gate (none ``compared``, none ``failing``) are an error, not a pass. Outputs go to
``NEW_RUN/report/compare-<base name>/`` by default: ``index.html`` and ``summary.md`` (one document,
:func:`compare_document`), ``deltas.png``, ``deltas.csv|json``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ernie5.store.runs import write_atomic
from reports import formatting as f
from reports import paired, plots
from reports.definitions import COMPARE_ABOUT
from reports.load import ReportError, Run, load_run, read_samples
from reports.render.document import Block, Definitions, Document, Figure, KeyValues, Section, Table, Text
from reports.render.files import write_figures
from reports.render.html import to_html
from reports.render.markdown import to_markdown
from reports.report import write_tables

CELL_COLUMNS = [
    "subnet",
    "task",
    "metric",
    "higher_is_better",
    "status",
    "base_value",
    "new_value",
    "delta",
    "ci_low",
    "ci_high",
    "n_paired",
    "method",
    "p_value",
    "p_adjusted",
    "verdict",
    "note",
]
GATING = ("compared", "failing")
"""Cell statuses that can decide a regression verdict."""
MAX_PLOTTED = 40
"""Most cells drawn in the change plot (those with the smallest p-values)."""
DELTA_PLOT = "deltas.png"
"""The change plot's file beside ``summary.md``."""
MANIFEST_DIFF = ("suite", "suite_hash", "checkpoint", "checkpoint_hash", "git_hash", "data_dir")


@dataclass(frozen=True)
class ComparisonResult:
    """What :func:`compare_runs` found and wrote."""

    cells: pd.DataFrame
    """One row per (subnet, task, metric) (:data:`CELL_COLUMNS`)."""
    has_regression: bool
    """Any significant regression or newly failing unit."""
    summary_markdown: str
    out_dir: Path


def _aligned(base: Run, new: Run, subnet: str, task: str, metric: str) -> tuple[list, list]:
    def values(run: Run) -> dict:
        return {r["id"]: r.get("scores", {}).get(metric) for r in read_samples(run, subnet, task)}

    b, n = values(base), values(new)
    ids = [i for i in b if i in n and b[i] is not None and n[i] is not None]
    return [n[i] for i in ids], [b[i] for i in ids]


def _status_note(run: Run, subnet: str, task: str) -> tuple[str, str]:
    unit = run.units[(run.units["subnet"] == subnet) & (run.units["task"] == task)]
    if unit.empty:
        return "absent", "not in the run"
    row = unit.iloc[0]
    if row["status"] == "ok":
        return "ok", "metric not reported"
    return str(row["status"]), f"{row['status']}: {row['reason']}"


def _same(a: object, b: object) -> bool:
    return pd.isna(a) and pd.isna(b) or a == b


def compare_cells(base: Run, new: Run, seed: int = 0) -> pd.DataFrame:
    """The comparison table of two runs (see the module docstring), Holm-adjusted and with verdicts."""
    key = ["subnet", "task", "metric"]
    cols = [*key, "value", "stderr", "higher_is_better", "task_version"]
    merged = base.results[cols].merge(
        new.results[cols], on=key, how="outer", suffixes=("_base", "_new"), indicator="origin"
    )
    rows = []
    for r in merged.itertuples(index=False):
        hib = bool(r.higher_is_better_new if r.origin == "right_only" else r.higher_is_better_base)
        row = {
            "subnet": r.subnet,
            "task": r.task,
            "metric": r.metric,
            "higher_is_better": hib,
            "base_value": r.value_base,
            "new_value": r.value_new,
            "delta": math.nan,
            "ci_low": math.nan,
            "ci_high": math.nan,
            "n_paired": 0,
            "method": "",
            "p_value": math.nan,
            "note": "",
        }
        if r.origin == "right_only":
            row.update(status="new", note=_status_note(base, r.subnet, r.task)[1] + " in base")
        elif r.origin == "left_only":
            status, note = _status_note(new, r.subnet, r.task)
            row.update(status="failing" if status == "error" else "missing", note=f"{note} in new")
        else:
            row["status"] = "compared"
            if not _same(r.task_version_base, r.task_version_new):
                row.update(
                    status="version changed",
                    note=f"task version {r.task_version_base} -> {r.task_version_new}",
                )
            new_vals, base_vals = _aligned(base, new, r.subnet, r.task, r.metric)
            if new_vals:
                test = paired.paired_test(new_vals, base_vals, r.metric, seed=seed)
            else:
                test = paired.unpaired_test(r.value_new, r.stderr_new, r.value_base, r.stderr_base)
            row.update(test, n_paired=len(new_vals))
        rows.append(row)
    cells = pd.DataFrame(rows, columns=[c for c in CELL_COLUMNS if c not in ("p_adjusted", "verdict")])
    gated = cells["status"] == "compared"
    cells["p_adjusted"] = math.nan
    if gated.any():
        cells.loc[gated, "p_adjusted"] = paired.holm(cells.loc[gated, "p_value"].tolist())
    cells["verdict"] = [
        "regression" if s == "failing" else paired.verdict(d, p, h) if s == "compared" else "n/a"
        for s, d, p, h in zip(cells["status"], cells["delta"], cells["p_adjusted"], cells["higher_is_better"])
    ]
    return cells[CELL_COLUMNS].sort_values(["subnet", "task", "metric"]).reset_index(drop=True)


def _view(cells: pd.DataFrame) -> pd.DataFrame:
    """The cells as display columns (text; ``status`` and ``verdict`` become badges on the page)."""
    arrow = ["\u2191" if h else "\u2193" for h in cells["higher_is_better"]]
    return pd.DataFrame(
        {
            "subnet": cells["subnet"].to_numpy(),
            "task": cells["task"].to_numpy(),
            "metric": [f"{m} {a}" for m, a in zip(cells["metric"], arrow)],
            "status": cells["status"].to_numpy(),
            "base": [f.num(x, 4) for x in cells["base_value"]],
            "new": [f.num(x, 4) for x in cells["new_value"]],
            "delta": [f.signed(x, 4) for x in cells["delta"]],
            "95% CI": [
                f.ci(lo, hi, lambda v: f.signed(v, 4)) for lo, hi in zip(cells["ci_low"], cells["ci_high"])
            ],
            "n": [f.text(x) for x in cells["n_paired"]],
            "method": cells["method"].to_numpy(),
            "p": [f.pvalue(x) for x in cells["p_value"]],
            "p (Holm)": [f.pvalue(x) for x in cells["p_adjusted"]],
            "verdict": cells["verdict"].to_numpy(),
            "note": cells["note"].to_numpy(),
        }
    )


def compare_document(base: Run, new: Run, cells: pd.DataFrame, has_regression: bool) -> Document:
    """The comparison as one document: the page (``index.html``) and the summary (``summary.md``).

    The summary carries the verdict, the runs and what differs between their manifests, the change plot
    (``deltas.png``) and the flagged cells; the page adds every cell and the glossary."""
    head = "REGRESSION: a significant regression" if has_regression else "No significant regression"
    verdicts, statuses = cells["verdict"].value_counts(), cells["status"].value_counts()
    counts = (
        f"{head}: {verdicts.get('regression', 0)} regressions, "
        f"{verdicts.get('improvement', 0)} improvements, "
        f"{statuses.get('failing', 0)} newly failing, {statuses.get('new', 0)} new and "
        f"{statuses.get('missing', 0)} missing over {len(cells)} cells (Holm-adjusted p < 0.05)."
    )
    diff = [
        (k, f"{base.manifest.get(k, 'n/a')} -> {new.manifest.get(k, 'n/a')}")
        for k in MANIFEST_DIFF
        if base.manifest.get(k) != new.manifest.get(k)
    ]
    overview: list[Block] = [
        Text(counts, "callout", "regression" if has_regression else "no change"),
        KeyValues((("base run", base.path), ("new run", new.path), *(diff or [("manifest", "same")]))),
    ]
    shown = cells[cells["status"].isin(["compared", "version changed"]) & cells["delta"].notna()]
    if len(shown) > MAX_PLOTTED:
        shown = shown.sort_values("p_value").head(MAX_PLOTTED).sort_values(["subnet", "task", "metric"])
    caption = "Change of each metric in the new run vs the base run, with the 95% paired interval"
    caption += f" ({MAX_PLOTTED} cells with the smallest p-values)." if len(shown) == MAX_PLOTTED else "."
    if len(shown):
        overview.append(
            Figure(plots.delta_plot(shown), "Per-cell change with intervals", caption, DELTA_PLOT)
        )
    else:
        overview.append(Text("No cell was compared."))
    view = _view(cells)
    flagged = view[
        (cells["verdict"].isin(["regression", "improvement"]) | (cells["status"] != "compared")).to_numpy()
    ]
    badges = ("status", "verdict")
    return Document(
        f"ERNIE 5 compare: {new.name} vs {base.name}",
        head,
        (
            Section("overview", "Overview", tuple(overview)),
            Section(
                "flagged",
                "Significant changes and new, missing or failing cells",
                (Table(flagged, badges=badges),),
            ),
            Section("cells", "Every cell", (Table(view, badges=badges),), markdown=False),
            Section("about", "About these numbers", (Definitions(tuple(COMPARE_ABOUT)),), markdown=False),
        ),
    )


def compare_runs(
    base_dir: str | Path, new_dir: str | Path, out_dir: str | Path | None = None
) -> ComparisonResult:
    """Compare two sweep runs and write the comparison page, summary and table.

    Args:
        base_dir: the baseline run folder (e.g. last night's).
        new_dir: the run under test.
        out_dir: where to write; default ``NEW_RUN/report/compare-<base name>``.

    Returns:
        The :class:`ComparisonResult`; gate CI on ``has_regression``.

    Raises:
        ReportError: either folder is not a sweep run, or the two runs share no cell that can gate
            (none compared and none newly failing): "no significant regression" would then be a
            verdict on nothing. The page, summary and table are written first, to show each run's cells.
    """
    base, new = load_run(base_dir), load_run(new_dir)
    out = Path(out_dir) if out_dir is not None else new.path / "report" / f"compare-{base.name}"
    cells = compare_cells(base, new)
    has_regression = bool((cells["verdict"] == "regression").any())
    write_tables({"deltas": cells}, out)
    doc = compare_document(base, new, cells, has_regression)
    write_figures(doc, out)
    write_atomic(out / "index.html", to_html(doc))
    summary = to_markdown(doc)
    write_atomic(out / "summary.md", summary)
    if not cells["status"].isin(GATING).any():
        shared = int(cells["status"].isin(["compared", "version changed"]).sum())
        why = (
            f"share {shared} (subnet, task, metric) cells but every one changed task version"
            if shared
            else "have no (subnet, task, metric) cell in common"
        )
        raise ReportError(
            f"compare: base run {base.path} and new run {new.path} {why}: nothing to compare "
            f"(their cells are listed in {out / 'index.html'})"
        )
    return ComparisonResult(cells=cells, has_regression=has_regression, summary_markdown=summary, out_dir=out)
