"""Chance-normalised retention (issue 24): the formula, the above-chance test, the random baseline
split out of the run, tasks at chance left out of the modality averages, and the report saying so."""

from __future__ import annotations

import math
import re

import pandas as pd
import pytest

from reports import build_report, compare_runs, load_run
from reports.analysis import analyze
from reports.scores import (
    RETENTION_NORMALISED,
    RETENTION_RATIO,
    above_chance,
    chance_normalised_score,
    chance_normalised_stderr,
    relative_score,
    relative_scores,
)
from reports.seesaw import group_scores
from tests.reports.browser import check_page, find_chromium

from .conftest import RANDOM

# ------------------------------------------------------------------------------------------ formula


def test_score_higher_is_better():
    assert chance_normalised_score(0.525, 0.8, 0.25, True) == pytest.approx(0.5)
    assert chance_normalised_score(0.8, 0.8, 0.25, True) == pytest.approx(1.0)
    assert chance_normalised_score(0.25, 0.8, 0.25, True) == pytest.approx(0.0)
    assert chance_normalised_score(0.2, 0.8, 0.25, True) < 0  # worse than random
    assert chance_normalised_score(0.9, 0.8, 0.25, True) > 1  # better than the full model


def test_score_lower_is_better():
    # bits per byte: full 2.0, random 8.0; halfway between them keeps half the margin
    assert chance_normalised_score(5.0, 2.0, 8.0, False) == pytest.approx(0.5)
    assert chance_normalised_score(2.0, 2.0, 8.0, False) == pytest.approx(1.0)
    assert chance_normalised_score(8.0, 2.0, 8.0, False) == pytest.approx(0.0)
    assert chance_normalised_score(1.0, 2.0, 8.0, False) > 1


@pytest.mark.parametrize("hib", [True, False])
def test_score_undefined_when_full_not_above_random(hib):
    assert math.isnan(chance_normalised_score(0.3, 0.5, 0.5, hib))  # full at chance
    worse = 0.4 if hib else 0.6  # full on the wrong side of random
    assert math.isnan(chance_normalised_score(0.3, worse, 0.5, hib))
    assert math.isnan(chance_normalised_score(math.nan, 0.8 if hib else 0.2, 0.5, hib))


@pytest.mark.parametrize(
    ("value", "full", "rand", "hib"), [(0.6, 0.8, 0.25, True), (3.1, 2.0, 8.0, False), (0.9, 0.7, 0.1, True)]
)
def test_stderr_matches_finite_difference_delta_method(value, full, rand, hib):
    ses = (0.02, 0.015, 0.03)
    point = [value, full, rand]
    h = 1e-6
    grad = []
    for i in range(3):
        up, down = list(point), list(point)
        up[i] += h
        down[i] -= h
        grad.append((chance_normalised_score(*up, hib) - chance_normalised_score(*down, hib)) / (2 * h))
    expected = math.sqrt(sum((g * s) ** 2 for g, s in zip(grad, ses)))
    got = chance_normalised_stderr(value, ses[0], full, ses[1], rand, ses[2], hib)
    assert got == pytest.approx(expected, rel=1e-5)


def test_stderr_by_hand():
    # D = 0.5; d/dsub = 2; d/dfull = -(0.5-0.25)/0.25 = -1 ... (value - rand) / D^2 = 0.25 / 0.25 = 1;
    # d/drand = (value - full) / D^2 = -0.25 / 0.25 = -1
    got = chance_normalised_stderr(0.5, 0.01, 0.75, 0.02, 0.25, 0.03, True)
    assert got == pytest.approx(math.sqrt((2 * 0.01) ** 2 + (1 * 0.02) ** 2 + (1 * 0.03) ** 2))
    assert math.isnan(chance_normalised_stderr(0.5, 0.01, 0.25, 0.02, 0.25, 0.03, True))


def test_above_chance():
    assert above_chance(0.8, 0.03, 0.25, 0.03, True)
    assert not above_chance(0.25, 0.03, 0.25, 0.03, True)  # full at chance
    assert not above_chance(0.3, 0.03, 0.25, 0.03, True)  # margin 0.05 < 1.96 * 0.042
    assert above_chance(2.0, 0.1, 8.0, 0.1, False)  # lower is better, far below random
    assert not above_chance(8.5, 0.1, 8.0, 0.1, False)  # worse than random
    # deterministic metrics (stderr 0): any margin counts; a NaN stderr cannot establish it
    assert above_chance(0.3, 0.0, 0.25, 0.0, True)
    assert not above_chance(0.8, math.nan, 0.25, 0.03, True)
    assert not above_chance(0.8, 0.03, 0.25, math.nan, True)


def _scores(rows):
    cols = ["subnet", "task", "metric", "value", "stderr", "n", "higher_is_better", "modality", "capability"]
    return pd.DataFrame([(*r[:5], 100, *r[5:]) for r in rows], columns=cols)


SCORES = _scores(
    [
        ("full", "qa", "acc", 0.8, 0.02, True, "text", "understanding"),
        ("small", "qa", "acc", 0.525, 0.02, True, "text", "understanding"),
        ("full", "bpb", "bits_per_byte", 2.0, 0.05, False, "text", "generation"),
        ("small", "bpb", "bits_per_byte", 5.0, 0.05, False, "text", "generation"),
        ("full", "vqa", "acc", 0.26, 0.04, True, "video", "understanding"),
        ("small", "vqa", "acc", 0.25, 0.04, True, "video", "understanding"),
        ("full", "asr", "wer", 0.3, 0.01, False, "audio", "understanding"),
        ("small", "asr", "wer", 0.4, 0.01, False, "audio", "understanding"),
    ]
)
BASELINE = _scores(
    [
        ("random", "qa", "acc", 0.25, 0.02, True, "text", "understanding"),
        ("random", "qa", "acc_norm", 0.9, 0.02, True, "text", "understanding"),  # not the primary metric
        ("random", "bpb", "bits_per_byte", 8.0, 0.05, False, "text", "generation"),
        ("random", "vqa", "acc", 0.25, 0.04, True, "video", "understanding"),
    ]
)  # no asr: the baseline skipped it


def test_relative_scores_with_baseline():
    rel = relative_scores(SCORES, baseline=BASELINE).set_index(["subnet", "task"])
    assert rel.loc[("small", "qa"), "rel"] == pytest.approx(0.5)
    assert rel.loc[("small", "bpb"), "rel"] == pytest.approx(0.5)
    assert rel.loc[("small", "qa"), "rand_value"] == 0.25 and rel.loc[("small", "qa"), "rand_stderr"] == 0.02
    assert rel.loc[("full", "qa"), "rel"] == 1.0 and rel.loc[("full", "qa"), "rel_se"] == 0.0
    assert rel.loc[("small", "qa"), "above_chance"] is True and bool(rel.loc[("small", "qa"), "normalised"])
    assert rel.loc[("small", "vqa"), "above_chance"] is False  # 0.26 vs 0.25: not significant
    # no random score: today's ratio, marked not normalised, above_chance unknown
    asr = rel.loc[("small", "asr")]
    assert not asr["normalised"] and pd.isna(asr["above_chance"]) and pd.isna(asr["rand_value"])
    assert asr["rel"] == pytest.approx(relative_score(0.4, 0.3, False))


def test_relative_scores_without_baseline_unchanged():
    rel = relative_scores(SCORES)
    for row in rel.itertuples():
        assert row.rel == pytest.approx(relative_score(row.value, row.full_value, row.higher_is_better))
    assert not rel["normalised"].any() and rel["above_chance"].isna().all() and rel["rand_value"].isna().all()


def test_group_scores_leave_out_tasks_at_chance():
    rel = relative_scores(SCORES, baseline=BASELINE)
    groups = group_scores(rel, "modality").set_index(["subnet", "group"])
    assert ("small", "video") not in groups.index  # its only task is at chance
    assert groups.loc[("small", "text"), "n_tasks"] == 2
    assert groups.loc[("small", "audio"), "n_tasks"] == 1  # unknown (no random score): kept
    caps = group_scores(rel, "capability").set_index(["subnet", "group"])
    assert caps.loc[("small", "understanding"), "n_tasks"] == 2  # qa and asr, not vqa


# ------------------------------------------------------------------------------------- synthetic runs

IMAGE_TASKS = ["image_gen", "image_qa"]


@pytest.fixture(scope="module")
def chance_run(tmp_path_factory):
    """A run with the random baseline where every image task is at chance."""
    from .conftest import write_run

    return write_run(tmp_path_factory.mktemp("chance"), "chance", baseline=True, chance=("image",))


@pytest.fixture(scope="module")
def chance_report(chance_run, tmp_path_factory):
    return build_report(chance_run, tmp_path_factory.mktemp("chance-report") / "report")


def test_load_splits_the_baseline_out(chance_run):
    run = load_run(chance_run)
    assert run.baseline == RANDOM
    assert RANDOM not in set(run.results["subnet"]) and RANDOM not in set(run.units["subnet"])
    assert set(run.baseline_results["subnet"]) == {RANDOM} and set(run.baseline_units["subnet"]) == {RANDOM}
    assert len(run.baseline_units) == 7  # six tasks and the skipped video task
    assert RANDOM not in set(run.efficiency["subnet"]) and RANDOM not in run.routing
    assert run.notes == []


def test_manifest_baseline_without_rows_is_a_note(make_run):
    run = load_run(make_run("norows", baseline=True, baseline_rows=False))
    assert run.baseline is None and run.baseline_results is None
    assert any("random baseline" in n and "no unit records" in n for n in run.notes)
    a = analyze(run)
    assert a.retention == RETENTION_RATIO and len(a.chance) == 0


def test_old_run_has_no_baseline(base_run):
    run = load_run(base_run)
    assert run.baseline is None and run.baseline_results is None and run.baseline_units is None
    a = analyze(run)
    assert a.retention == RETENTION_RATIO and not a.scores["normalised"].any()


def test_chance_modality_left_out_of_averages(chance_run, make_run):
    a = analyze(load_run(chance_run))
    assert a.retention == RETENTION_NORMALISED
    assert sorted(a.at_chance["task"]) == IMAGE_TASKS
    assert (
        a.chance.set_index("task")
        .loc[["arith", "hellaswag_mini", "shakespeare", "asr"], "above_chance"]
        .all()
    )
    assert "image" not in set(a.by_modality["group"])
    assert set(a.by_modality["group"]) == {"text", "audio"}
    assert "image" not in set(a.degradation["modality"])
    assert (a.seesaw_index.dropna(subset=["seesaw_index"])["n_groups"] == 2).all()
    assert (a.aggregate["n_modalities"] <= 2).all()
    caps = a.by_capability[a.by_capability["subnet"] == "full"].set_index("group")["n_tasks"]
    assert caps["understanding"] == 3 and caps["generation"] == 1  # image_qa and image_gen left out
    assert RANDOM not in set(a.scores["subnet"]) and RANDOM not in a.order
    assert RANDOM not in set(a.win_rates["subnet"])
    # the same run without the baseline: image is propped up at ~100% by tasks answered at chance
    old = analyze(load_run(make_run("chance-old", chance=("image",))))
    image = old.by_modality[old.by_modality["group"] == "image"].set_index("subnet")["rel"]
    assert len(image) == 5 and (image > 0.95).all()
    # ... and the mean win rate leaves the two image tasks out too
    assert a.win_rates["n_tasks"].max() == old.win_rates["n_tasks"].max() - len(IMAGE_TASKS)


def test_baseline_skipped_task_falls_back_to_ratio(make_run):
    a = analyze(load_run(make_run("skip", baseline=True, baseline_skip=("asr",))))
    asr = a.scores[a.scores["task"] == "asr"]
    assert not asr["normalised"].any() and asr["above_chance"].isna().all()
    assert a.ratio_tasks == ["asr"] and "asr" in a.retention_text
    assert "audio" in set(a.by_modality["group"])


SECTIONS = ["overview", "seesaw", "efficiency", "units", "routing", "tasks", "about"]


def test_report_says_which_retention_and_lists_tasks_at_chance(chance_report):
    page = (chance_report / "index.html").read_text()
    assert "chance-normalised: (sub − random) / (full − random)" in page
    assert "left out of modality averages" in page
    table = page[page.index("Tasks at chance") :]
    table = table[: table.index("</table>")]
    assert all(t in table for t in IMAGE_TASKS) and "arith" not in table
    assert re.findall(r'<section id="([^"]+)"', page) == SECTIONS
    scores_table = page[page.index("Primary score per task") :]
    head = scores_table[: scores_table.index("</thead>")]
    assert re.findall(r"<th>([^<]+)</th>", head)[3:6] == ["full", RANDOM, "above chance"]
    summary = (chance_report / "summary.md").read_text()
    assert "**Retention:** chance-normalised" in summary
    assert "left out of modality averages: image_gen, image_qa." in summary
    tables = chance_report / "tables"
    chance = pd.read_csv(tables / "chance.csv")
    assert sorted(chance.loc[~chance["above_chance"], "task"]) == IMAGE_TASKS
    seesaw = pd.read_csv(tables / "seesaw_modality.csv")
    assert "image" not in set(seesaw["group"])


def test_report_without_baseline_says_plain_ratio(built_report):
    page = (built_report / "index.html").read_text()
    assert "plain ratio sub/full (no random baseline in this run)" in page
    assert "Tasks at chance:" not in page
    assert (
        "**Retention:** plain ratio sub/full (no random baseline in this run)."
        in (built_report / "summary.md").read_text()
    )


def test_compare_never_compares_the_baseline(chance_run, make_run, tmp_path):
    result = compare_runs(make_run("old"), chance_run, tmp_path / "cmp")
    assert RANDOM not in set(result.cells["subnet"])
    result = compare_runs(chance_run, make_run("new2", baseline=True), tmp_path / "cmp2")
    assert RANDOM not in set(result.cells["subnet"])


@pytest.mark.skipif(find_chromium() is None, reason="no chromium on PATH")
def test_baseline_report_renders_in_chromium(chance_report):
    check = check_page(chance_report / "index.html")
    assert check.ok, check.problems
    assert check.images_total == 8 and check.images_loaded == 8
