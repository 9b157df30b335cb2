"""``ernie5 trend RUN_DIR...``: every (subnet, task, metric) score across N nights, each night's change
tested against the night before.

``ernie5 compare`` (:mod:`reports.compare`) pairs two runs; a trend is the chain of those comparisons
over consecutive nights, so a drop can be traced to the night, and the commit, that brought it.

* **Order.** Nights are ordered by their manifest's ``finished`` time; where a run has no readable one,
  in the order given. The page says which.
* **Each night.** A cell's value with its 95 % interval, ``value +- 1.96 x stderr`` (the run's own
  stderr, as the run report computes it), ``n`` and the night's ``status``: ``ok``, or why the cell has no
  value (``error``, ``skipped``, ``missing``: no unit, ``not reported``: an ok unit without the metric).
* **Each change.** From the second night on, exactly what ``ernie5 compare PREVIOUS NIGHT`` finds
  (:func:`reports.compare.compare_cells`): where both nights are ok, a paired test on the examples both
  scored, Holm-adjusted over that pair's compared cells, and compare's verdict; a cell that was ok the
  night before and fails with an error is a regression, as it is there.

Outputs (default ``LAST_RUN/report/trend/``): ``index.html`` and ``summary.md`` from one document
(:func:`trend_document`: the significant drops with their night's commit first, then every cell, then the
definitions), ``trend.png`` and ``trend.csv|json`` (long: one row per cell x night, :data:`TREND_COLUMNS`).

Errors (:class:`~reports.load.ReportError`, one line naming the bad value): fewer than two runs, a run
given twice, a folder that is not a sweep run, or two consecutive nights with no cell in common (the
files are written first, to show each night's cells).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure as Canvas
from matplotlib.ticker import PercentFormatter

from ernie5.store.runs import write_atomic
from reports import compare, plots
from reports import formatting as f
from reports.definitions import COMPARE_ABOUT
from reports.load import ReportError, Run, load_run
from reports.render.document import Block, Definitions, Document, Figure, Heading, Section, Table, Text
from reports.render.files import write_figures
from reports.render.html import to_html
from reports.render.markdown import to_markdown
from reports.report import write_tables
from reports.scores import Z95

KEY = ["subnet", "task", "metric"]
CHANGE_COLUMNS = {
    "change_vs_previous": "delta",
    "change_ci_low": "ci_low",
    "change_ci_high": "ci_high",
    "n_paired": "n_paired",
    "method": "method",
    "p_value": "p_value",
    "p_adjusted": "p_adjusted",
    "verdict": "verdict",
}
"""Long-table column -> the :func:`reports.compare.compare_cells` column it takes (vs the night before)."""
CHANGE_EMPTY = {"n_paired": 0, "method": "", "verdict": "n/a"}
"""What those columns hold without a comparison (the first night, a cell neither night has); else NaN."""
TREND_COLUMNS = [
    *KEY,
    *("higher_is_better", "night", "run", "finished", "git_hash"),
    *("status", "value", "ci_low", "ci_high", "n", *CHANGE_COLUMNS, "note"),
]
"""The long table's columns: one row per (subnet, task, metric) x night; ``night`` counts from 1."""
MAX_PLOTTED = 8
"""Most cells drawn in the trend plot."""
TREND_PLOT = "trend.png"
"""The trend plot's file beside ``summary.md``."""
TREND_ABOUT: tuple[tuple[str, str], ...] = (
    (
        "Value and its 95% interval",
        "The night's score of the cell with value +- 1.96 x its stderr, the stderr the run recorded (a "
        "mean's standard error, or a bootstrap one for corpus metrics); n is the number of examples scored.",
    ),
    (
        "Order of nights",
        "By each manifest's 'finished' time; when a run has none that can be read, in the order the runs "
        "were given. The page's first section says which order was used.",
    ),
    (
        "Change vs the previous night",
        "Night k against night k-1, exactly as 'ernie5 compare' of the two runs: tested only where both "
        "nights are ok; a cell that was ok and now fails with an error counts as a regression.",
    ),
    *COMPARE_ABOUT,
    (
        "Holm across nights",
        "The Holm correction runs over the compared cells of one pair of consecutive nights, as compare "
        "does; it does not correct across pairs, so over many nights an occasional false alarm somewhere "
        "in the history is expected. A real drop persists: the nights after it stay low.",
    ),
)


@dataclass(frozen=True)
class Night:
    """One run of the trend, in its place."""

    index: int
    """Its place, from 1."""
    run: Run
    finished: str
    git_hash: str
    checkpoint: str
    checkpoint_hash: str

    @property
    def label(self) -> str:
        """``3. nightly-2026-12-03``."""
        return f"{self.index}. {self.run.name}"

    @property
    def header(self) -> str:
        """The label with what traces a change: finish time, commit, checkpoint and its hash."""
        return (
            f"{self.label} | finished {self.finished} | commit {self.git_hash[:12]} | "
            f"{self.checkpoint} ({self.checkpoint_hash[:12]})"
        )


@dataclass(frozen=True)
class TrendResult:
    """What :func:`trend_runs` found and wrote."""

    out_dir: Path
    table: pd.DataFrame
    """The long table (:data:`TREND_COLUMNS`)."""
    has_regression: bool
    """Any night with a significant regression (or a newly failing unit) versus the night before."""
    last_has_regression: bool
    """The last night has one versus the night before it (what ``--fail-on-regression`` gates on)."""
    order: str
    """How the nights were ordered, in words."""
    summary_markdown: str


def _manifest_text(manifest: dict[str, Any], key: str) -> str:
    value = manifest.get(key)
    return "n/a" if value is None or value == "" else str(value)


def finished_time(manifest: dict[str, Any]) -> datetime | None:
    """The manifest's ``finished`` time (an aware one in UTC, made naive), or None when unreadable."""
    try:
        t = datetime.fromisoformat(str(manifest["finished"]))
    except (KeyError, TypeError, ValueError):
        return None
    return t.astimezone(UTC).replace(tzinfo=None) if t.tzinfo is not None else t


def order_runs(runs: Sequence[Run]) -> tuple[list[Run], str]:
    """The runs by finished time (stable), or as given when one has no readable time; and which, in words."""
    times = [finished_time(r.manifest) for r in runs]
    untimed = [r.name for r, t in zip(runs, times) if t is None]
    if untimed:
        return list(runs), f"in the order given (no readable 'finished' time in {', '.join(untimed)})"
    order = sorted(range(len(runs)), key=lambda i: times[i])  # type: ignore[arg-type, return-value]
    return [runs[i] for i in order], "by finished time (each manifest's 'finished')"


def nights(runs: Sequence[Run]) -> list[Night]:
    """Each run as a :class:`Night`, numbered from 1 in the given order."""
    return [
        Night(
            index=i,
            run=run,
            finished=_manifest_text(run.manifest, "finished"),
            git_hash=_manifest_text(run.manifest, "git_hash"),
            checkpoint=_manifest_text(run.manifest, "checkpoint"),
            checkpoint_hash=_manifest_text(run.manifest, "checkpoint_hash"),
        )
        for i, run in enumerate(runs, 1)
    ]


def night_status(run: Run, subnet: str, task: str) -> tuple[str, str]:
    """Why a cell has no value in ``run``: ``(status, note)`` (compare's reading of the unit)."""
    status, note = compare._status_note(run, subnet, task)
    return {"absent": "missing", "ok": "not reported"}.get(status, status), note


def _records(frame: pd.DataFrame) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(r["subnet"], r["task"], r["metric"]): r for r in frame.to_dict(orient="records")}


def _count(x: Any) -> Any:
    """A count as an int (NaN when missing)."""
    try:
        return int(x) if math.isfinite(float(x)) else math.nan
    except (TypeError, ValueError):
        return math.nan


def trend_table(ns: Sequence[Night], pairs: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """The long table: every cell any night has, at every night (:data:`TREND_COLUMNS`).

    Args:
        ns: the nights in order.
        pairs: ``compare_cells(night k-1, night k)`` for k = 2..N.
    """
    direction: dict[tuple[str, str, str], bool] = {}
    for night in ns:
        direction.update({k: bool(r["higher_is_better"]) for k, r in _records(night.run.results).items()})
    rows = []
    for night, pair in zip(ns, [None, *pairs]):
        results = _records(night.run.results)
        changes = _records(pair) if pair is not None else {}
        for key in sorted(direction):
            res, change = results.get(key), changes.get(key, {})
            status, note = ("ok", "") if res is not None else night_status(night.run, *key[:2])
            value = res["value"] if res is not None else math.nan
            half = Z95 * res["stderr"] if res is not None else math.nan
            rows.append(
                {
                    **dict(zip(KEY, key)),
                    "higher_is_better": direction[key],
                    "night": night.index,
                    "run": night.run.name,
                    "finished": night.finished,
                    "git_hash": night.git_hash,
                    "status": status,
                    "value": value,
                    "ci_low": value - half,
                    "ci_high": value + half,
                    "n": _count(res["n"]) if res is not None else math.nan,
                    **{
                        c: change.get(src, CHANGE_EMPTY.get(c, math.nan)) for c, src in CHANGE_COLUMNS.items()
                    },
                    "note": note or change.get("note", ""),
                }
            )
    table = pd.DataFrame(rows, columns=TREND_COLUMNS)
    return table.sort_values([*KEY, "night"], kind="stable").reset_index(drop=True)


def _arrow(higher_is_better: bool) -> str:
    return "\u2191" if higher_is_better else "\u2193"


def _drops(table: pd.DataFrame, ns: Sequence[Night]) -> pd.DataFrame:
    """The regressions, one row each, with the night's commit and checkpoint and the value before."""
    previous = table.groupby(KEY, sort=False)["value"].shift(1)
    hit = table.assign(previous=previous)[table["verdict"] == "regression"]
    by_index = {n.index: n for n in ns}
    return pd.DataFrame(
        {
            "subnet": hit["subnet"].to_numpy(),
            "task": hit["task"].to_numpy(),
            "metric": [f"{m} {_arrow(h)}" for m, h in zip(hit["metric"], hit["higher_is_better"])],
            "night": [by_index[i].label for i in hit["night"]],
            "finished": hit["finished"].to_numpy(),
            "commit": hit["git_hash"].to_numpy(),
            "checkpoint": [f"{by_index[i].checkpoint} ({by_index[i].checkpoint_hash})" for i in hit["night"]],
            "before": [f.num(x, 4) for x in hit["previous"]],
            "after": [f.num(x, 4) if s == "ok" else s for x, s in zip(hit["value"], hit["status"])],
            "change": [f.signed(x, 4) for x in hit["change_vs_previous"]],
            "95% CI": [
                f.ci(lo, hi, lambda v: f.signed(v, 4))
                for lo, hi in zip(hit["change_ci_low"], hit["change_ci_high"])
            ],
            "p (Holm)": [f.pvalue(x) for x in hit["p_adjusted"]],
            "method": [m or "newly failing" for m in hit["method"]],
        }
    )


def _night_rows(ns: Sequence[Night]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "night": [n.label for n in ns],
            "finished": [n.finished for n in ns],
            "commit": [n.git_hash for n in ns],
            "checkpoint": [n.checkpoint for n in ns],
            "checkpoint hash": [n.checkpoint_hash for n in ns],
        }
    )


def _cell_text(r: Any) -> str:
    """One cell at one night as rich text: the value, its interval and n, then the change."""
    if r.status != "ok":
        text = f"**{r.status}**" + (f"\n{r.note}" if r.note and r.note != r.status else "")
    else:
        text = f"{f.num(r.value, 4)} [{f.num(r.ci_low, 4)}, {f.num(r.ci_high, 4)}] n={f.text(_count(r.n))}"
        if not math.isnan(r.change_vs_previous):
            text += f"\nchange {f.signed(r.change_vs_previous, 4)}, p (Holm) {f.pvalue(r.p_adjusted)}"
    if r.verdict in ("regression", "improvement"):
        text += f" **{r.verdict}**"
    return text


def _wide(table: pd.DataFrame, ns: Sequence[Night]) -> tuple[pd.DataFrame, dict[str, str]]:
    """One row per cell, one column per night (and the nights' headers)."""
    rows = []
    for key, g in table.groupby(KEY, sort=True):
        row = dict(zip(KEY, key))
        row["metric"] = f"{row['metric']} {_arrow(bool(g['higher_is_better'].iloc[0]))}"
        row.update({f"night {r.night}": _cell_text(r) for r in g.itertuples(index=False)})
        rows.append(row)
    columns = [*KEY, *(f"night {n.index}" for n in ns)]
    return pd.DataFrame(rows, columns=columns), {f"night {n.index}": n.header for n in ns}


def _relative(g: pd.DataFrame) -> pd.DataFrame | None:
    """A cell's nights as the change from its first finite, non-zero value (a share of it)."""
    values = g["value"].to_numpy(float)
    finite = values[np.isfinite(values) & (values != 0)]
    if len(finite) == 0:
        return None
    ref = finite[0]
    return pd.DataFrame(
        {
            "night": g["night"].to_numpy(),
            "rel": (values - ref) / abs(ref),
            "low": (g["ci_low"].to_numpy(float) - ref) / abs(ref),
            "high": (g["ci_high"].to_numpy(float) - ref) / abs(ref),
            "regression": (g["verdict"] == "regression").to_numpy(),
        }
    )


def plotted_cells(table: pd.DataFrame) -> tuple[dict[str, pd.DataFrame], bool]:
    """The lines of the trend plot: every cell with a regression (at most :data:`MAX_PLOTTED`, smallest
    p first), or, when none has one, the cells whose relative change spans most; and whether flagged."""
    lines, spread, best_p = {}, {}, {}
    for key, g in table.groupby(KEY, sort=True):
        rel = _relative(g)
        if rel is None or np.isfinite(rel["rel"]).sum() < 2:
            continue
        name = " / ".join(key)
        lines[name] = rel
        spread[name] = float(np.nanmax(rel["rel"]) - np.nanmin(rel["rel"]))
        hit = g[g["verdict"] == "regression"]
        if not hit.empty:
            best_p[name] = float(hit["p_adjusted"].fillna(0.0).min())
    flagged = bool(best_p)
    chosen = sorted(best_p, key=best_p.get) if flagged else sorted(spread, key=spread.get, reverse=True)
    return {n: lines[n] for n in sorted(chosen[:MAX_PLOTTED])}, flagged


def trend_plot(lines: dict[str, pd.DataFrame], labels: Sequence[str]) -> str:
    """One line per cell: its change from its first night (% of that value) with the 95% interval at
    every night, a red triangle at each night with a significant regression versus the night before."""
    fig = Canvas(figsize=(plots.WIDTH, 4.8))
    ax = fig.add_subplot()
    marked = False
    for j, (name, g) in enumerate(lines.items()):
        x = g["night"].to_numpy(float) + (j - (len(lines) - 1) / 2) * 0.03
        rel = g["rel"].to_numpy(float)
        err = np.vstack([rel - g["low"].to_numpy(float), g["high"].to_numpy(float) - rel])
        ax.errorbar(x, rel, yerr=np.nan_to_num(err), marker="o", capsize=3, lw=1.8, label=name)
        hit = g["regression"].to_numpy(bool) & np.isfinite(rel)
        if hit.any():
            label = None if marked else "significant regression vs the previous night"
            ax.scatter(
                x[hit],
                rel[hit],
                marker="v",
                s=150,
                color=plots.VERDICT_COLORS["regression"],
                zorder=4,
                label=label,
            )
            marked = True
    ax.axhline(0, color="#444", lw=0.8)
    ax.set_xticks(range(1, len(labels) + 1), list(labels), fontsize=8)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("Night (run, commit)")
    ax.set_ylabel("Change vs the cell's first night (% of its value; raw metric direction)")
    ax.set_title("Scores across nights with 95% intervals (red triangle: significant regression)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return plots._png(fig)


def trend_document(
    ns: Sequence[Night], table: pd.DataFrame, order: str, last_has_regression: bool
) -> Document:
    """The trend as one document: the page (``index.html``) and the summary (``summary.md``).

    First the answer (which cells dropped significantly, on which night, by how much, with that night's
    commit), the nights and the plot; then, on the page only, every cell night by night and the glossary."""
    verdicts = table["verdict"].value_counts()
    n_reg, n_cells = int(verdicts.get("regression", 0)), len(table.groupby(KEY))
    failing = int(((table["verdict"] == "regression") & (table["status"] != "ok")).sum())
    head = f"REGRESSION: {n_reg} significant drop{'s' * (n_reg != 1)}" if n_reg else "No significant drop"
    last = ns[-1]
    lead = (
        f"{head} ({failing} of them newly failing units) and {verdicts.get('improvement', 0)} significant "
        f"improvements between consecutive nights, over {len(ns)} nights and {n_cells} cells (Holm-adjusted "
        f"p < 0.05 per pair of nights). Last night ({last.run.name}) vs the night before: "
        f"{'a' if last_has_regression else 'no'} significant regression. Nights are ordered {order}."
    )
    drops: list[Block] = [
        Text(lead, "callout", "regression" if n_reg else "no change"),
        Table(_drops(table, ns), empty="No cell dropped significantly between consecutive nights."),
        Heading("Nights"),
        Table(_night_rows(ns)),
    ]
    lines, flagged = plotted_cells(table)
    if lines:
        caption = "Each cell's change from its first night, with 95% intervals: "
        caption += (
            "the cells with a significant regression."
            if flagged
            else f"no cell regressed; the {len(lines)} cells that moved most."
        )
        labels = [f"{n.label}\n{n.git_hash[:10]}" for n in ns]
        drops.append(Figure(trend_plot(lines, labels), "Scores across nights", caption, TREND_PLOT))
    else:
        drops.append(Text("No cell has a value on two nights to plot."))
    wide, headers = _wide(table, ns)
    night_cols = tuple(c for c in wide.columns if c.startswith("night "))
    return Document(
        f"ERNIE 5 trend: {ns[0].run.name} .. {last.run.name} ({len(ns)} nights)",
        head,
        (
            Section("drops", "Significant drops", tuple(drops)),
            Section(
                "cells",
                "Every cell, night by night",
                (Table(wide, headers=headers, rich=night_cols),),
                markdown=False,
            ),
            Section("about", "About these numbers", (Definitions(TREND_ABOUT),), markdown=False),
        ),
    )


def trend_runs(run_dirs: Sequence[str | Path], out_dir: str | Path | None = None) -> TrendResult:
    """Read N sweep runs, order them, test each night against the one before, and write the trend.

    Args:
        run_dirs: two or more run folders (e.g. one per night), in any order.
        out_dir: where to write; default the last night's ``report/trend``.

    Returns:
        The :class:`TrendResult`; gate CI on ``last_has_regression``.

    Raises:
        ReportError: fewer than two folders, one given twice, one that is not a sweep run, or two
            consecutive nights that share no cell that can gate (none compared, none newly failing).
    """
    if len(run_dirs) < 2:
        given = ", ".join(str(d) for d in run_dirs) or "none"
        raise ReportError(f"trend needs at least 2 run folders, got {len(run_dirs)}: {given}")
    seen: set[Path] = set()
    for d in run_dirs:
        if Path(d).resolve() in seen:
            raise ReportError(f"run folder {d} is given twice")
        seen.add(Path(d).resolve())
    ordered, order = order_runs([load_run(d) for d in run_dirs])
    ns = nights(ordered)
    pairs = [compare.compare_cells(a.run, b.run) for a, b in zip(ns, ns[1:])]
    table = trend_table(ns, pairs)
    out = Path(out_dir) if out_dir is not None else ns[-1].run.path / "report" / "trend"
    regression = table["verdict"] == "regression"
    last_has_regression = bool((regression & (table["night"] == len(ns))).any())
    write_tables({"trend": table}, out)
    doc = trend_document(ns, table, order, last_has_regression)
    write_figures(doc, out)
    write_atomic(out / "index.html", to_html(doc))
    summary = to_markdown(doc)
    write_atomic(out / "summary.md", summary)
    for a, b, pair in zip(ns, ns[1:], pairs):
        if not pair["status"].isin(compare.GATING).any():
            raise ReportError(
                f"runs {a.run.path} (night {a.index}) and {b.run.path} (night {b.index}) have no (subnet, "
                f"task, metric) cell in common: nothing to compare (their cells are listed in "
                f"{out / 'index.html'})"
            )
    return TrendResult(
        out_dir=out,
        table=table,
        has_regression=bool(regression.any()),
        last_has_regression=last_has_regression,
        order=order,
        summary_markdown=summary,
    )
