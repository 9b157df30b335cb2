"""``build_report`` on a synthetic, contract-conforming sweep run folder."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from evals.results import write_tables, write_unit
from reports import ReportError, build_report, load_run

SECTIONS = (
    "Overview",
    "Capability seesaw",
    "Efficiency trade-offs",
    "Units",
    "Routing analysis",
    "Per-task drill-down",
    "About these numbers",
)


def test_report_files_and_sections(built_report):
    out = built_report
    assert out.name == "report" and (out.parent / "manifest.json").is_file()
    page = (out / "index.html").read_text()
    for title in SECTIONS:
        assert f">{title}</h2>" in page
    assert page.count("<img ") == 8 and "data:image/png;base64," in page
    assert "http://" not in page and "https://" not in page  # nothing to fetch
    for term in ("Seesaw index", "Mean win rate", "Pareto frontier", "Normalised routing entropy", "IoU"):
        assert term in page
    assert "CUDA out of memory" in page and "data missing" in page  # why units failed or were skipped
    summary = (out / "summary.md").read_text()
    assert "Degrades first" in summary and "Operating points" in summary


def test_report_tables(built_report):
    tables = built_report / "tables"
    for name in (
        "scores",
        "seesaw_modality",
        "seesaw_capability",
        "seesaw_index",
        "degradation_order",
        "win_rates",
        "pareto",
        "operating_points",
        "routing_entropy",
        "routing_iou_modality",
    ):
        assert (tables / f"{name}.csv").is_file() and (tables / f"{name}.json").is_file()
    scores = pd.read_csv(tables / "scores.csv")
    full = scores[scores["subnet"] == "full"]
    assert (full["rel"] == 1.0).all()
    seesaw = pd.read_csv(tables / "seesaw_modality.csv")
    image = seesaw[(seesaw["group"] == "image")].set_index("subnet")["rel"]
    assert image["d0.75-w0.5-k1"] < image["k1"] < 1.0  # the planted degradation, recovered
    order = pd.read_csv(tables / "degradation_order.csv")
    assert set(order["modality"]) == {"text", "image", "audio"}
    points = json.loads((tables / "operating_points.json").read_text())
    assert {p["point"]: p["subnet"] for p in points} == {"ES": "k1", "EA": "d0.75-w0.5-k1"}


def test_optional_files_may_be_missing(make_run, tmp_path):
    run = make_run("bare", efficiency=False, routing=False)
    shutil.rmtree(run / "samples")
    (run / "results.csv").unlink()
    out = build_report(run, tmp_path / "elsewhere")
    assert out == tmp_path / "elsewhere"
    page = (out / "index.html").read_text()
    assert "recorded no efficiency table" in page and "recorded no routing statistics" in page
    assert "Capability seesaw" in page


def test_load_run_reads_the_contract(run_dir):
    run = load_run(run_dir)
    assert set(run.units["status"]) == {"ok", "skipped", "error"}
    assert set(run.routing) == {"full", "k1"}
    assert run.efficiency is not None and len(run.efficiency) == 5
    assert not run.notes


@pytest.mark.parametrize(
    "breakage, message",
    [("manifest", "no manifest.json"), ("units", "no units"), ("folder", "is not a folder")],
)
def test_not_a_sweep_run(run_dir, breakage, message):
    if breakage == "manifest":
        (run_dir / "manifest.json").unlink()
    elif breakage == "units":
        shutil.rmtree(run_dir / "units")
    else:
        shutil.rmtree(run_dir)
    with pytest.raises(ReportError, match=message) as info:
        build_report(run_dir)
    assert "\n" not in str(info.value)


def test_bad_optional_files_become_notes(run_dir):
    (run_dir / "routing" / "k1.json").write_text("{not json")
    run = load_run(run_dir)
    assert set(run.routing) == {"full"} and any("k1.json" in n for n in run.notes)


def _keep_only_full(run):
    for d in (run / "units").iterdir():
        if d.name != "full":
            shutil.rmtree(d)


def _fail_everything(run):
    for path in (run / "units").glob("*/*.json"):
        unit = json.loads(path.read_text())
        write_unit(run, {**unit, "status": "error", "reason": "boom", "metrics": {}}, [])


def _drop_full(run):
    shutil.rmtree(run / "units" / "full")


@pytest.mark.parametrize(
    "damage, expected",
    [
        (_keep_only_full, "Retention vs full"),  # nothing shrinks: no degradation order, no operating points
        (_fail_everything, "No unit finished ok"),
        (_drop_full, "No relative scores"),
    ],
)
def test_degenerate_runs_still_report(make_run, damage, expected):
    run = make_run("degenerate", routing=False)
    damage(run)
    write_tables(run)
    out = build_report(run)
    assert expected in (out / "index.html").read_text() + (out / "summary.md").read_text()
    assert "Degrades first" not in (out / "summary.md").read_text()
