"""The RL study report: a table row and curves per arm, from the runs' metrics.jsonl only, rendered to
Markdown and a self-contained page from one document."""

from __future__ import annotations

import json

import pytest

from reports.rl import differences, interval, summarize, write_report


def _run(path, rewards, entropies, *, length=2.0, passes=None):
    path.mkdir(parents=True)
    lines = []
    if passes:
        lines.append(
            {
                "step": 0,
                "event": "pass_init",
                "hard_mean": passes[0],
                "easy_mean": 0.8,
                "n_hard": 5,
                "n_easy": 3,
            }
        )
    for i, (r, e) in enumerate(zip(rewards, entropies, strict=True)):
        lines.append(
            {"step": i + 1, "reward": r, "entropy": e, "response_len": length, "idle_s": 0.5,
             "slot_utilisation": 0.7, "mismatch_masked_frac": 0.01, "wpsm_masked_frac": 0.1, "clip_frac": 0.2,
             "rows_by_task": {"a": 3, "b": 1}}
        )  # fmt: skip
    if passes:
        lines.append(
            {
                "step": len(rewards),
                "event": "pass_final",
                "hard_mean": passes[1],
                "easy_mean": 0.9,
                "n_hard": 5,
                "n_easy": 3,
            }
        )
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_summary_reads_first_and_last_windows_and_pass_rates(tmp_path):
    run = _run(tmp_path / "a", [0.1] * 10 + [0.5] * 10, [1.0] * 10 + [0.4] * 10, passes=(0.1, 0.3))
    row = summarize(run)
    assert (
        row["steps"] == 20
        and row["reward_first"] == pytest.approx(0.1)
        and row["reward_last"] == pytest.approx(0.5)
    )
    assert row["entropy_min"] == pytest.approx(0.4) and row["pass_hard"] == (0.1, 0.3, 5)
    assert row["task_mix"] == "a 0.75 / b 0.25"


def test_the_report_has_a_row_per_arm_and_the_curves_in_markdown_and_html(tmp_path):
    arms = {
        "urb": _run(tmp_path / "urb", [0.2] * 12, [1.0] * 12, length=5.0),
        "april<b>": _run(tmp_path / "april", [0.3] * 12, [0.9] * 12, length=3.0),
    }
    path = write_report("Scheduling", arms, tmp_path / "out", "intro text")
    text = path.read_text()
    assert text.startswith("# Scheduling") and "intro text" in text
    assert "| urb | 1 | 12 |" in text and "| april\\<b\\> | 1 | 12 |" in text and "5.000" in text
    assert (
        "| arm | seeds | steps | reward (first 10) |" in text and "![reward and entropy](curves.png)" in text
    )
    assert "n/a (one seed)" in text  # one seed per arm: no test
    assert (tmp_path / "out" / "curves.png").stat().st_size > 1000
    assert set(json.loads((tmp_path / "out" / "summary.json").read_text())) == {
        "urb",
        "april<b>",
        "differences",
    }
    html = (tmp_path / "out" / "report.html").read_text()
    assert ">Scheduling</h1>" in html
    assert "april&lt;b&gt;" in html and "april<b>" not in html
    assert "data:image/png;base64," in html and "reward (last 10)" in html
    assert not list((tmp_path / "out").glob(".*tmp*"))


def test_a_folder_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an RL run folder"):
        summarize(tmp_path)


def test_seeds_give_intervals_and_welch_tests_against_the_first_arm(tmp_path):
    """Three seeds per arm: every figure is a mean with its 95 % t-interval, and the Differences section
    tests each arm against the first with Welch's t over seeds, Holm-adjusted."""
    base = [
        _run(tmp_path / f"misc{s}", [0.5 + 0.01 * s] * 12, [1.0 + 0.01 * s] * 12, passes=(0.05, 0.3))
        for s in range(3)
    ]
    lower = [
        _run(tmp_path / f"gspo{s}", [0.5] * 12, [0.3 + 0.01 * s] * 12, passes=(0.05, 0.3)) for s in range(3)
    ]
    path = write_report("Objective", {"misc": base, "gspo": lower}, tmp_path / "out")
    text = path.read_text()
    assert "| misc | 3 | 12 |" in text and "1.010 ± 0.025" in text  # t(0.975, 2) * 0.01 / sqrt(3)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    diffs = {d["figure"]: d for d in summary["differences"]}
    assert diffs["entropy (last 10)"]["verdict"] == "lower" and diffs["entropy (last 10)"][
        "delta"
    ] == pytest.approx(-0.7)
    assert diffs["reward (last 10)"]["verdict"] == "no difference"
    assert "## Differences from misc" in text and "p (Holm)" in text
    mean, half = interval([1.0, 1.01, 1.02])
    assert mean == pytest.approx(1.01) and half == pytest.approx(4.302653 * 0.01 / 3**0.5, rel=1e-5)
    assert interval([0.4])[0] == 0.4 and interval([0.4])[1] != interval([0.4])[1]  # NaN half-width
    frame = differences({"a": [{"reward_last": 1.0}] * 2, "b": [{"reward_last": 1.0}] * 2})
    assert frame["verdict"].tolist() == ["no difference"]  # no spread and no change
