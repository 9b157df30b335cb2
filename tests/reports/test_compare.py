"""``compare_runs`` on synthetic run pairs: itself, pure noise, planted regressions, new/missing/failing."""

from __future__ import annotations

import json
import shutil

import pytest

from evals.results import write_unit
from reports import ComparisonResult, ReportError, compare_runs


def _flagged(result: ComparisonResult, verdict: str) -> set[tuple[str, str, str]]:
    cells = result.cells[result.cells["verdict"] == verdict]
    return set(zip(cells["subnet"], cells["task"], cells["metric"]))


def test_a_run_against_itself_shows_no_change(make_run):
    run_dir = make_run("nightly")
    result = compare_runs(run_dir, run_dir)
    compared = result.cells[result.cells["status"] == "compared"]
    assert not result.has_regression
    assert (compared["delta"] == 0).all() and (compared["verdict"] == "no change").all()
    assert set(result.cells["status"]) == {"compared"}
    assert (result.out_dir / "index.html").is_file() and (result.out_dir / "summary.md").is_file()
    assert result.out_dir == run_dir / "report" / f"compare-{run_dir.name}"


def test_pure_noise_is_not_flagged(make_run, base_run):
    rerun = make_run("rerun", seed=7)  # same quality, fresh example draws
    result = compare_runs(base_run, rerun)
    assert not result.has_regression
    assert _flagged(result, "regression") == set() and _flagged(result, "improvement") == set()
    assert (result.cells["n_paired"] > 0).all()


PLANTED = {
    ("full", "image_qa"): 0.5,  # accuracy halves: McNemar
    ("k1", "asr"): 0.7,  # WER up (lower is better): paired bootstrap
    ("w0.5", "shakespeare"): 0.8,  # bits per byte up: corpus bootstrap
}


def test_planted_regressions_are_flagged(make_run, base_run, tmp_path):
    new = make_run("new", shift=PLANTED)
    result = compare_runs(base_run, new, out_dir=tmp_path / "cmp")
    assert result.has_regression
    assert _flagged(result, "regression") == {
        ("full", "image_qa", "acc"),
        ("k1", "asr", "wer"),
        ("w0.5", "shakespeare", "bits_per_byte"),
    }
    methods = result.cells.set_index(["subnet", "task", "metric"])["method"]
    assert methods[("full", "image_qa", "acc")] == "mcnemar"
    assert methods[("k1", "asr", "wer")] == "bootstrap"
    assert methods[("w0.5", "shakespeare", "bits_per_byte")] == "corpus-bootstrap"
    assert "REGRESSION" in result.summary_markdown and "image_qa" in result.summary_markdown
    table = json.loads((tmp_path / "cmp" / "deltas.json").read_text())
    assert sum(r["verdict"] == "regression" for r in table) == 3


def test_an_improvement_does_not_gate(make_run, base_run):
    worse = make_run("worse", shift={("full", "image_qa"): 0.5})
    result = compare_runs(worse, base_run, out_dir=worse / "cmp")
    assert _flagged(result, "improvement") == {("full", "image_qa", "acc")}
    assert not result.has_regression


def test_new_missing_and_failing_tasks(make_run):
    base, new = make_run("base"), make_run("new")
    shutil.rmtree(new / "units" / "k1")  # k1 absent from the new run: missing
    unit = json.loads((new / "units" / "full" / "arith.json").read_text())
    write_unit(new, {**unit, "status": "error", "reason": "boom", "metrics": {}}, [])  # ok -> error
    unit = json.loads((base / "units" / "w0.5" / "image_qa.json").read_text())
    write_unit(base, {**unit, "status": "skipped", "reason": "no data", "metrics": {}}, [])  # new in new run
    (base / "results.csv").unlink()  # rebuilt from the units
    (new / "results.csv").unlink()
    result = compare_runs(base, new)
    status = result.cells.set_index(["subnet", "task", "metric"])["status"]
    assert status[("k1", "arith", "exact_match")] == "missing"
    assert status[("full", "arith", "exact_match")] == "failing"
    assert status[("w0.5", "image_qa", "acc")] == "new"
    assert result.has_regression  # a unit that now fails is a regression
    assert ("full", "arith", "exact_match") in _flagged(result, "regression")


def test_unpaired_cells_fall_back_to_a_z_test(make_run, base_run):
    new = make_run("new")
    shutil.rmtree(new / "samples")
    result = compare_runs(base_run, new)
    assert set(result.cells["method"]) == {"z (unpaired)"}
    assert not result.has_regression


def test_not_a_run_folder(tmp_path, base_run):
    with pytest.raises(ReportError, match="no manifest.json"):
        compare_runs(tmp_path, base_run)


def _only_subnets(run, keep: set[str]) -> None:
    for d in (run / "units").iterdir():
        if d.name not in keep:
            shutil.rmtree(d)
    (run / "results.csv").unlink()  # rebuilt from the units


def test_runs_with_no_cell_in_common_are_an_error_not_a_pass(make_run, capsys):
    from jobs.cli import main

    base, new = make_run("base"), make_run("new")
    _only_subnets(base, {"full"})
    _only_subnets(new, {"k1"})
    with pytest.raises(ReportError, match="no \\(subnet, task, metric\\) cell in common") as info:
        compare_runs(base, new)
    assert str(base) in str(info.value) and str(new) in str(info.value) and "\n" not in str(info.value)
    assert (new / "report" / "compare-base" / "index.html").is_file()  # the cells of each run, shown
    assert main(["compare", str(base), str(new), "--fail-on-regression"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing to compare" in err[0] and "no significant regression" not in err[0]


def test_runs_sharing_only_version_changed_cells_are_an_error(make_run):
    base, new = make_run("base"), make_run("new")
    for path in (new / "units").glob("*/*.json"):
        unit = json.loads(path.read_text())
        write_unit(new, {**unit, "task_version": 2}, [])
    (new / "results.csv").unlink()
    with pytest.raises(ReportError, match="every one changed task version"):
        compare_runs(base, new)


def test_a_run_whose_every_shared_cell_now_fails_is_a_regression_not_an_error(make_run):
    base, new = make_run("base"), make_run("new")
    for path in (new / "units").glob("*/*.json"):
        unit = json.loads(path.read_text())
        write_unit(new, {**unit, "status": "error", "reason": "boom", "metrics": {}}, [])
    (new / "results.csv").unlink()
    assert compare_runs(base, new).has_regression
