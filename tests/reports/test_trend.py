"""``trend_runs`` over synthetic nights: a planted drop found on its night and cell only, the order by
finished time, the long table, the pages, failing and missing cells, and the CLI's exit codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from ernie5.store.runs import write_json
from evals.results import write_unit
from jobs.cli import main
from reports import ReportError, TrendResult, compare_runs, load_run, trend_runs
from reports.trend import TREND_COLUMNS
from tests.reports.conftest import write_run

KEPT = {"full", "k1"}
"""The two sub-models of the synthetic nights."""
DROP = {("full", "image_qa"): 0.5}
"""Accuracy halves (about 0.65 -> 0.33 on 120 examples) from night 3 on: a real drop that persists."""
DROP_NIGHT = 3
COMMITS = {i: f"{i}abc{i}def{i}0123456789" for i in range(1, 6)}


def _night(root: Path, i: int, *, drop: bool, name: str | None = None) -> Path:
    """Night ``i``: a fresh draw of examples (pure noise) over two sub-models, finished on day ``i``."""
    run = write_run(root, name or f"nightly-{i}", seed=i, shift=DROP if drop else None, routing=False)
    for folder in (run / "units").iterdir():
        if folder.name not in KEPT:
            shutil.rmtree(folder)
    (run / "results.csv").unlink()  # rebuilt from the units that are left
    manifest = json.loads((run / "manifest.json").read_text())
    manifest.update(finished=f"2026-12-{i:02d}T03:00:00", git_hash=COMMITS[i], checkpoint_hash=f"ck{i}")
    write_json(run / "manifest.json", manifest)
    return run


def _regressions(result: TrendResult) -> set[tuple[str, str, str, int]]:
    t = result.table[result.table["verdict"] == "regression"]
    return set(zip(t["subnet"], t["task"], t["metric"], t["night"]))


@pytest.fixture(scope="module")
def night_dirs(tmp_path_factory) -> list[Path]:
    """Four nights, the drop planted on night 3 (and kept on night 4); read-only for tests."""
    root = tmp_path_factory.mktemp("nights")
    return [_night(root, i, drop=i >= DROP_NIGHT) for i in range(1, 5)]


@pytest.fixture(scope="module")
def trend(night_dirs, tmp_path_factory) -> TrendResult:
    """The trend of the four nights, given out of order."""
    shuffled = [night_dirs[i] for i in (2, 0, 3, 1)]
    return trend_runs(shuffled, tmp_path_factory.mktemp("trend") / "out")


def test_the_planted_drop_is_flagged_on_its_night_and_cell_only(trend):
    assert _regressions(trend) == {("full", "image_qa", "acc", DROP_NIGHT)}
    assert set(trend.table["verdict"]) <= {"regression", "no change", "n/a"}  # no improvement either
    assert trend.has_regression and not trend.last_has_regression  # night 4 stays low: no new drop
    row = trend.table[trend.table["verdict"] == "regression"].iloc[0]
    assert row["method"] == "mcnemar" and row["p_adjusted"] < 0.01 and row["n_paired"] == 120
    assert row["change_vs_previous"] < -0.25 and row["change_ci_high"] < 0
    assert row["git_hash"] == COMMITS[DROP_NIGHT] and row["run"] == f"nightly-{DROP_NIGHT}"


def test_nights_follow_their_finished_time_not_the_given_order(trend):
    nights = trend.table.drop_duplicates("night").sort_values("night")
    assert list(nights["run"]) == [f"nightly-{i}" for i in range(1, 5)]
    assert list(nights["git_hash"]) == [COMMITS[i] for i in range(1, 5)]
    assert trend.order.startswith("by finished time")
    assert trend.out_dir.name == "out"


def test_without_a_finished_time_the_given_order_is_kept(make_run, tmp_path):
    late, early = make_run("late", seed=1), make_run("early", seed=2)
    manifest = json.loads((late / "manifest.json").read_text())
    del manifest["finished"]
    write_json(late / "manifest.json", manifest)
    result = trend_runs([late, early])
    assert list(result.table.drop_duplicates("night")["run"]) == ["late", "early"]
    assert result.order.startswith("in the order given") and "late" in result.order
    assert result.out_dir == early / "report" / "trend"  # the last night's, in the order used
    assert "in the order given" in (result.out_dir / "summary.md").read_text()


def test_the_long_table_has_one_row_per_cell_and_night(trend, night_dirs):
    table = trend.table
    assert list(table.columns) == TREND_COLUMNS
    cells = table[["subnet", "task", "metric"]].drop_duplicates()
    assert set(cells["subnet"]) == KEPT and cells["task"].nunique() >= 5
    assert len(table) == 4 * len(cells) and not table.duplicated(["subnet", "task", "metric", "night"]).any()
    assert (table["status"] == "ok").all() and (table["n"] == 120).all()
    assert (table["ci_low"] < table["value"]).all() and (table["value"] < table["ci_high"]).all()
    first = table[table["night"] == 1]
    assert (first["verdict"] == "n/a").all() and first["change_vs_previous"].isna().all()
    assert table[table["night"] > 1]["p_adjusted"].notna().all()
    results = load_run(night_dirs[0]).results.set_index(["subnet", "task", "metric"])
    row = first.set_index(["subnet", "task", "metric"]).loc[("k1", "asr", "wer")]
    expected = results.loc[("k1", "asr", "wer")]
    assert row["ci_high"] == pytest.approx(expected["value"] + 1.959964 * expected["stderr"])
    csv = pd.read_csv(trend.out_dir / "trend.csv")
    assert list(csv.columns) == TREND_COLUMNS and len(csv) == len(table)
    rows = json.loads((trend.out_dir / "trend.json").read_text())
    assert len(rows) == len(table) and all(list(r) == TREND_COLUMNS for r in rows)
    assert sum(r["verdict"] == "regression" for r in rows) == 1


def test_the_changes_are_what_compare_finds(trend, night_dirs, tmp_path):
    pair = compare_runs(night_dirs[DROP_NIGHT - 2], night_dirs[DROP_NIGHT - 1], tmp_path / "cmp").cells
    night = trend.table[trend.table["night"] == DROP_NIGHT]
    key = ["subnet", "task", "metric"]
    merged = pair.merge(night, on=key, suffixes=("_compare", "_trend"))
    assert len(merged) == len(pair) == len(night)
    assert (merged["verdict_compare"] == merged["verdict_trend"]).all()
    assert merged["p_adjusted_compare"].tolist() == merged["p_adjusted_trend"].tolist()
    assert merged["delta"].tolist() == merged["change_vs_previous"].tolist()


def test_the_pages_answer_first_and_name_the_commit_of_the_drop(trend):
    html = (trend.out_dir / "index.html").read_text()
    summary = (trend.out_dir / "summary.md").read_text()
    drop_line = next(line for line in summary.splitlines() if "| image_qa |" in line)
    assert COMMITS[DROP_NIGHT] in drop_line and f"{DROP_NIGHT}. nightly-{DROP_NIGHT}" in drop_line
    assert "REGRESSION: 1 significant drop" in summary and "by finished time" in summary
    assert COMMITS[DROP_NIGHT] in html and "ck3" in html
    assert html.index('id="drops"') < html.index('id="cells"') < html.index('id="about"')
    assert "Holm" in html[html.index('id="about"') :] and "1.96" in html
    assert "Every cell" not in summary  # the full table is the page's
    assert (trend.out_dir / "trend.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "](trend.png)" in summary


def test_failing_and_missing_cells_show_their_status(make_run):
    nights = [make_run(f"n{i}", seed=i) for i in (1, 2, 3)]
    unit = json.loads((nights[1] / "units" / "full" / "arith.json").read_text())
    write_unit(nights[1], {**unit, "status": "error", "reason": "boom", "metrics": {}}, [])
    shutil.rmtree(nights[2] / "units" / "k1")
    for run in nights[1:]:
        (run / "results.csv").unlink()
    result = trend_runs(nights)
    rows = result.table.set_index(["subnet", "task", "metric", "night"])
    assert rows.loc[("full", "arith", "exact_match", 2), "status"] == "error"
    assert "boom" in rows.loc[("full", "arith", "exact_match", 2), "note"]
    assert (
        rows.loc[("full", "arith", "exact_match", 2), "verdict"] == "regression"
    )  # newly failing, as compare
    assert rows.loc[("full", "arith", "exact_match", 3), "verdict"] == "n/a"  # back, but nothing to test
    assert (rows.xs(3, level="night").loc["k1", "status"] == "missing").all()
    assert _regressions(result) == {("full", "arith", "exact_match", 2)} and not result.last_has_regression
    assert "newly failing" in (result.out_dir / "summary.md").read_text()


def test_bad_input_is_a_one_line_error(make_run, tmp_path):
    run = make_run("only")
    with pytest.raises(ReportError, match="at least 2 run folders, got 1") as info:
        trend_runs([run])
    assert str(run) in str(info.value)
    with pytest.raises(ReportError, match="given twice"):
        trend_runs([run, run])
    with pytest.raises(ReportError, match="no manifest.json") as info:
        trend_runs([run, tmp_path / "only" / "units"])
    assert "units" in str(info.value)


def test_nights_with_no_cell_in_common_are_an_error(make_run):
    a, b, c = make_run("a"), make_run("b"), make_run("c")
    for run, keep in ((a, "full"), (b, "full"), (c, "k1")):
        for folder in (run / "units").iterdir():
            if folder.name != keep:
                shutil.rmtree(folder)
        (run / "results.csv").unlink()
    with pytest.raises(ReportError, match="no \\(subnet, task, metric\\) cell in common") as info:
        trend_runs([a, b, c])
    message = str(info.value)
    assert str(b) in message and str(c) in message and str(a) not in message.split("listed in")[0]
    assert "\n" not in message and (c / "report" / "trend" / "index.html").is_file()


def test_the_cli_exit_codes(night_dirs, tmp_path, capsys):
    out = str(tmp_path / "cli")
    assert main(["trend", *map(str, night_dirs), "--out", out, "--fail-on-regression"]) == 0
    assert "REGRESSION" in capsys.readouterr().out  # a past drop is reported, but the last night gates
    assert main(["trend", *map(str, night_dirs[:DROP_NIGHT]), "--out", out]) == 0
    assert main(["trend", *map(str, night_dirs[:DROP_NIGHT]), "--out", out, "--fail-on-regression"]) == 1
    capsys.readouterr()
    for argv, expected in (
        ([str(night_dirs[0])], "at least 2 run folders"),
        ([str(night_dirs[0]), str(tmp_path)], f"{tmp_path} is not a sweep run"),
    ):
        assert main(["trend", *argv, "--out", out]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("ernie5 trend: error: ") and expected in err[0], err
