"""The elastic study's report on a synthetic study folder: planted loss gaps give the planted verdicts,
rows of the four families sit side by side, the seesaw and routing tables come from the sweeps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ernie5.store.runs import write_json
from reports.elastic_study import FAMILIES, Study, ratio_ci, write_report
from reports.load import ReportError
from tests.reports.conftest import write_run

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
