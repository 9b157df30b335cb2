"""The elastic study's report on synthetic study folders: planted loss gaps give the planted verdicts,
rows of the four families sit side by side, the seesaw and routing tables come from the sweeps; in a
multimodal study the planted modality that gives way first in each family is named in report.md and
report.html, routing is summarised by modality, and the page is escaped, self-contained and renders."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ernie5.store.runs import write_json
from reports import seesaw, study_modality
from reports.elastic_study import FAMILIES, Study, analyze_study, ratio_ci, write_report
from reports.html import esc
from reports.load import ReportError
from reports.render.html import STATUS_CLASSES, rich
from reports.render.markdown import cell
from reports.study_views import shape_view
from tests.reports.browser import check_page, find_chromium
from tests.reports.conftest import STRENGTH, TASKS, write_run

SHAPES = {
    "d0.75": {"default": "d0.75", "importance": "d0.75-Limportance"},
    "k1": {"default": "k1"},
}


def _losses(level: float, seed: int, n: int = 16) -> list[float]:
    """Per-batch losses: a shared batch difficulty (common to every model) plus a little own noise."""
    common = np.random.default_rng(0).normal(0.0, 0.2, n)
    own = np.random.default_rng(seed).normal(0.0, 0.002, n)
    return (level + common + own).tolist()


def _loss_file(root, arm: str, subnets: dict[str, float]) -> None:
    write_json(
        root / "loss" / f"{arm}.json",
        {
            "checkpoint": f"{arm}/ckpt",
            "tokenizer": "t0",
            "subnets": {
                name: {"identity": [name], "batches": _losses(level, i + 10 * len(arm)), "mean": level}
                for i, (name, level) in enumerate(subnets.items())
            },
        },
    )


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """A study of two shapes: the elastic full model 1 % worse than the static one; for d0.75 the
    static model 0.1 nats better than the elastic sub-model and the pruned one 0.2 nats worse; no
    static or recovered model of k1 (the k1 rows are elastic and pruned only)."""
    root = tmp_path_factory.mktemp("elastic") / "study"
    sweeps = root / "sweeps"
    write_run(sweeps, "elastic", baseline=True)
    write_run(sweeps, "static", baseline=True, shift={("d0.75", "arith"): 0.5})
    write_run(sweeps, "static-d0.75")
    write_run(sweeps, "recover-d0.75")
    _loss_file(root, "elastic", {"full": 3.03, "d0.75": 3.2, "d0.75-Limportance": 3.15, "k1": 3.1})
    _loss_file(root, "static", {"full": 3.0, "d0.75": 3.4, "d0.75-Limportance": 3.3, "k1": 3.05})
    _loss_file(root, "static-d0.75", {"full": 3.1})
    _loss_file(root, "recover-d0.75", {"full": 3.2})
    write_json(
        root / "study.json",
        {
            "config": {"base": "micro", "overrides": [], "steps": 10, "recovery_steps": 2, "suite": "s"},
            "shapes": SHAPES,
            "specs": ["full", "d0.75", "d0.75-Limportance", "k1"],
            "tokens_per_step": 512,
            "recovery_tokens": 1024,
            "units": {"train/elastic": {"key": "k", "wall_s": 60.0}},
        },
    )
    write_report(root)
    return root


def test_the_report_puts_the_families_side_by_side_with_the_planted_gaps(study):
    path = study / "report.md"
    summary = json.loads((study / "summary.json").read_text())
    main = {(r["shape"], r["family"]): r for r in summary["main"]}
    assert {f for s, f in main if s == "d0.75"} == set(FAMILIES)
    assert {f for s, f in main if s == "k1"} == {"elastic", "pruned"}
    assert main[("d0.75", "static")]["d_loss_vs_elastic"] == pytest.approx(-0.1, abs=0.01)
    assert main[("d0.75", "pruned")]["d_loss_vs_elastic"] == pytest.approx(0.2, abs=0.01)
    assert main[("d0.75", "pruned+rec")]["tokens"] == 10 * 512 + 1024
    # params and decode speed come from the sweeps' efficiency rows (the synthetic d0.75: 12 of 16 layers)
    assert main[("d0.75", "elastic")]["active_params"] > 0
    cost = summary["cost_of_elasticity"]
    assert cost["ratio"] == pytest.approx(1.01, abs=1e-3)
    assert cost["ci_low"] < 1.01 < cost["ci_high"] < 1.02
    verdicts = summary["verdicts"]
    assert "**holds**" in verdicts[0]
    static = next(v for v in verdicts if v.startswith("d0.75: elastic at least as good as static"))
    pruned = next(v for v in verdicts if v.startswith("d0.75: elastic better than pruned ("))
    assert "**does not hold**" in static and "**holds**" in pruned
    text = path.read_text()
    assert "## Cost of elasticity" in text and "Table 9" in text and (study / "loss.png").is_file()


def test_selection_seesaw_and_routing_tables(study):
    summary = json.loads((study / "summary.json").read_text())
    sel = {(r["family"], r["selection"]): r for r in summary["selection"] if r["shape"] == "d0.75"}
    assert sel[("elastic", "importance")]["d_loss_vs_default"] == pytest.approx(-0.05, abs=0.01)
    assert sel[("pruned", "importance")]["d_loss_vs_default"] == pytest.approx(-0.1, abs=0.01)
    # three modalities: the seesaw is by modality; the synthetic d0.75 keeps image worst
    assert summary["seesaw_by"] == "modality"
    elastic = [r for r in summary["seesaw_index"] if r["family"] == "elastic" and r["subnet"] == "d0.75"]
    assert elastic and elastic[0]["worst"] == "image"
    # the planted arith regression of the pruned d0.75 is a significant per-task cell
    cells = [
        c
        for c in summary["task_cells"]
        if (c["shape"], c["family"], c["task"]) == ("d0.75", "pruned", "arith")
    ]
    assert cells and cells[0]["verdict"] == "regression"
    routed = {(r["arm"], r["subnet"]) for r in summary["routing"]}
    assert ("elastic", "full") in routed and ("static", "k1") in routed


def test_ratio_interval_and_a_folder_that_is_not_a_study(tmp_path):
    r, lo, hi = ratio_ci([2.0, 4.0, 6.0], [2.0, 4.0, 6.0])
    assert (r, lo, hi) == (1.0, 1.0, 1.0)
    with pytest.raises(ReportError, match="not an elastic study folder"):
        Study(tmp_path)


# ---------------------------------------------------------------------------- a multimodal study
MM_SHAPES = {
    "d0.75": {"default": "d0.75", "importance": "d0.75-Limportance", "random:1": "d0.75-Lrandom1"},
    "w0.5": {"default": "w0.5"},
}
PLANTED = {  # family -> shape -> the quality each modality keeps (1.0 = the static full model's)
    "elastic": {
        "w0.5": {"text": 0.75, "image": 1.0, "audio": 1.0},
        "d0.75": {"text": 0.7, "image": 0.97, "audio": 0.97},
    },
    "static": {
        "w0.5": {"text": 1.0, "image": 1.0, "audio": 0.75},
        "d0.75": {"text": 1.0, "image": 1.0, "audio": 0.7},
    },
    "pruned": {
        "w0.5": {"text": 1.0, "image": 0.75, "audio": 1.0},
        "d0.75": {"text": 0.98, "image": 0.7, "audio": 0.98},
    },
    "pruned+rec": {s: {"text": 1.0, "image": 1.0, "audio": 1.0} for s in MM_SHAPES},
}
"""The first modality to give way: text for the elastic family, audio for the static models, image
for the pruned ones; none for the recovered ones."""


def _planted(subnet: str, keeps: dict[str, float]) -> dict[tuple[str, str], float]:
    """``write_run`` shifts that make ``subnet`` keep ``keeps`` of each modality's quality."""
    return {(subnet, t): keeps[spec[0]] / STRENGTH[subnet][spec[0]] for t, spec in TASKS.items()}


@pytest.fixture(scope="module")
def mm_study(tmp_path_factory):
    """Text, image and audio tasks (video skipped, the EA sub-model's audio unit failed) and a task
    named ``<script>...``; the planted per-family modality gaps of :data:`PLANTED`; the synthetic
    routing keeps text on experts apart from image and audio, which share experts in the last layer."""
    root = tmp_path_factory.mktemp("elastic_mm") / "study"
    sweeps = root / "sweeps"
    elastic = {
        **_planted("w0.5", PLANTED["elastic"]["w0.5"]),
        **_planted("d0.75", PLANTED["elastic"]["d0.75"]),
    }
    elastic.update(_planted("full", {"text": 1.0, "image": 1.0, "audio": 1.0}))
    write_run(sweeps, "elastic", baseline=True, hostile=True, shift=elastic)
    pruned = {**_planted("w0.5", PLANTED["pruned"]["w0.5"]), **_planted("d0.75", PLANTED["pruned"]["d0.75"])}
    write_run(sweeps, "static", baseline=True, hostile=True, shift=pruned)
    for shape in MM_SHAPES:
        write_run(sweeps, f"static-{shape}", hostile=True, shift=_planted("full", PLANTED["static"][shape]))
        write_run(
            sweeps, f"recover-{shape}", hostile=True, shift=_planted("full", PLANTED["pruned+rec"][shape])
        )
        _loss_file(root, f"static-{shape}", {"full": 3.1})
        _loss_file(root, f"recover-{shape}", {"full": 3.05})
    specs = {"full": 3.0, "d0.75": 3.2, "d0.75-Limportance": 3.15, "d0.75-Lrandom1": 3.25, "w0.5": 3.1}
    _loss_file(root, "elastic", specs)
    _loss_file(root, "static", {k: v + 0.1 * (k != "full") for k, v in specs.items()})
    write_json(
        root / "study.json",
        {
            "config": {
                "base": "micro",
                "overrides": [],
                "steps": 10,
                "recovery_steps": 2,
                "suite": "mm",
                "val_batches": 16,
            },
            "shapes": MM_SHAPES,
            "specs": list(specs),
            "tokens_per_step": 512,
            "recovery_tokens": 1024,
            "provenance": {
                "argv": ["/venv/bin/ernie5", "study", "elastic", "--config", "mm.yaml", "--out", "x"]
            },
            "units": {
                "train/elastic": {"key": "k", "wall_s": 60.0},
                "sweep/elastic": {"key": "k", "wall_s": 6.0},
            },
        },
    )
    write_report(root)
    return root


def test_the_seesaw_per_family_finds_the_planted_modality_that_gives_way_first(mm_study):
    summary = json.loads((mm_study / "summary.json").read_text())
    assert summary["seesaw_by"] == "modality"
    order = {}
    for r in summary["seesaw_order"]:
        order.setdefault(r["family"], []).append(r)
    first = {family: rows[0] for family, rows in order.items()}
    assert {f: r["modality"] for f, r in first.items() if r["crosses_at"]} == {
        "elastic": "text",
        "static": "audio",
        "pruned": "image",
    }
    assert first["static"]["crosses_at"] == first["pruned"]["crosses_at"] == "w0.5"  # the most active shape
    assert first["pruned+rec"]["crosses_at"] == ""
    # the seesaw index of the static d0.75 model: audio worst, well apart from the best (interval above 0)
    idx = {(r["family"], r["subnet"]): r for r in summary["seesaw_index"]}
    static = idx[("static", "d0.75")]
    assert static["worst"] == "audio" and 0 < static["ci_low"] < static["seesaw_index"] < static["ci_high"]
    assert idx[("pruned", "w0.5")]["worst"] == "image"
    # the main table has every modality's score with its interval; the video task was skipped everywhere
    main = {(r["shape"], r["family"]): r for r in summary["main"]}
    row = main[("d0.75", "static")]
    assert row["score_audio_ci_high"] < 0.95 < row["score_text_ci_high"]
    assert row["score_text"] == pytest.approx(1.0) and "score_video" not in row
    for path, bold in ((mm_study / "report.md", "**{}**"), (mm_study / "report.html", "<strong>{}</strong>")):
        text = path.read_text()
        for family, modality in (("elastic", "text"), ("static", "audio"), ("pruned", "image")):
            assert f"Seesaw, {family} family: {bold.format(modality)} gives way first" in text, (path, family)
        assert "Seesaw, pruned+rec family: no modality falls below 95 % retention" in text


def test_routing_by_modality_names_the_planted_separation(mm_study):
    summary = json.loads((mm_study / "summary.json").read_text())
    rows = {(r["family"], r["row"]): r for r in summary["routing_rows"]}
    full = rows[("elastic", "full")]
    assert full["most_shared"] == "audio / image" and "text" in full["most_separated"]
    assert full["most_separated_iou"] < full["most_shared_iou"]
    assert {"entropy_text", "entropy_image", "entropy_audio"} <= set(full)
    assert ("static", "d0.75") in rows and ("pruned+rec", "w0.5") in rows  # the other families' models
    html = (mm_study / "report.html").read_text()
    assert "Routing, elastic full model: in the last MoE layer <strong>" in html
    assert "Top-25 % IoU between modalities per layer" in html


def test_the_html_page_is_self_contained_escaped_and_complete(mm_study):
    html = (mm_study / "report.html").read_text()
    md = (mm_study / "report.md").read_text()
    assert "Content-Security-Policy" in html and 'src="http' not in html
    # loss plot, family retention, then the elastic full model's frequency, IoU and entropy figures
    assert html.count('<img src="data:image/png;base64,') == 2 + 3
    assert "&lt;script&gt;alert(1)" in html and "<script>alert" not in html
    assert "<script>" not in md.replace("\\<script\\>", "")
    for anchor in (
        "overview",
        "cost",
        "shapes",
        "tables",
        "selection",
        "seesaw",
        "routing",
        "tasks",
        "units",
    ):
        assert f'<section id="{anchor}">' in html
    assert "ernie5 study elastic --config mm.yaml --out x" in html and "ernie5 study elastic" in md
    assert "audio score [95% CI]" in html and "decode tok/s [IQR]" in html
    assert '<span class="badge b-ok">holds</span>' in html  # the verdict matrix


def test_the_page_and_the_markdown_come_from_one_document(mm_study):
    """report.md and report.html state the same verdicts and the same main-table cells; the Markdown
    leaves out the page's long parts and shows its figures from files beside it."""
    summary = json.loads((mm_study / "summary.json").read_text())
    md, html = (mm_study / "report.md").read_text(), (mm_study / "report.html").read_text()
    assert len(summary["verdicts"]) > 10
    for verdict in summary["verdicts"]:
        assert cell(verdict) in md, verdict
        assert rich(verdict) in html, verdict
    for shape, rows in analyze_study(mm_study).main.groupby("shape", sort=False):
        view = shape_view(rows)
        assert f"### {shape}" in md and f"<h3>{shape}</h3>" in html
        for values in view.itertuples(index=False):
            assert "| " + " | ".join(cell(v) for v in values) + " |" in md, values
            assert "<tr>" + "".join(f"<td>{esc(v)}</td>" for v in values) + "</tr>" in html, values
    # the claim matrix: the same decision words, labels on the page and bold in the Markdown
    for word in ("holds", "does not hold", "importance better"):
        assert f"**{word}**" in md and f'<span class="badge {STATUS_CLASSES[word]}">{word}</span>' in html
    assert "## Verdicts" in md and "## Cost of elasticity" in md  # what CI greps for
    for page_only in ("About these numbers", "Every cell", "Every verdict in words", "per layer"):
        assert page_only in html and page_only not in md, page_only
    for png in ("loss.png", "retention.png"):
        assert f"]({png})" in md and (mm_study / png).is_file()


def test_the_study_modules_build_no_markup():
    """Every piece of markup is the renderer's: the study modules build data, not HTML strings."""
    for name in ("elastic_study", "study_report", "study_views"):
        src = (Path(__file__).resolve().parents[2] / "reports" / f"{name}.py").read_text()
        for markup in ("esc(", "<h3>", "<div", "<br>", "<p>", "<td"):
            assert markup not in src, (name, markup)


def test_the_page_renders_in_chromium(mm_study):
    if find_chromium() is None:
        if os.environ.get("ERNIE5_REQUIRE_BROWSER") == "1":
            pytest.fail("ERNIE5_REQUIRE_BROWSER=1 but no chromium on PATH (apt-get install -y chromium)")
        pytest.skip("no chromium on PATH: .ci/run installs it as root (apt-get install -y chromium)")
    check = check_page(mm_study / "report.html")
    assert check.ok, check.problems
    assert check.images_total == check.images_loaded == 5 and check.broken_links == []
    assert all(not s["blank"] for s in check.sections) and not check.screenshot_blank


def test_a_family_with_one_group_above_chance_has_no_seesaw():
    rel = pd.DataFrame(
        {
            "subnet": ["full", "d0.75"],
            "task": "shakespeare_bpb",
            "modality": "text",
            "capability": "generation",
            "rel": [1.0, 0.9],
            "rel_se": [0.0, 0.02],
        }
    )
    groups = seesaw.group_scores(rel, "task")
    order = seesaw.degradation_order(groups, None)
    (words,) = study_modality.seesaw_words(
        groups.assign(family="static"), order.assign(family="static"), "task"
    )
    assert words.startswith("Seesaw, static family: one task above chance (shakespeare_bpb), so no seesaw")
    assert "retention at d0.75 is 90.0%" in words
