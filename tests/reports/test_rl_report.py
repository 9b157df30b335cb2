"""The RL study report: a table row and curves per arm, from the runs' metrics.jsonl only, rendered to
Markdown and a self-contained page from one document."""

from __future__ import annotations

import json

import pytest

from reports.rl import summarize, write_report


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
    assert "| urb | 12 |" in text and "| april\\<b\\> | 12 |" in text and "5.000" in text and "3.000" in text
    assert "| arm | steps | reward (first 10) |" in text and "![reward and entropy](curves.png)" in text
    assert (tmp_path / "out" / "curves.png").stat().st_size > 1000
    assert set(json.loads((tmp_path / "out" / "summary.json").read_text())) == {"urb", "april<b>"}
    html = (tmp_path / "out" / "report.html").read_text()
    assert ">Scheduling</h1>" in html
    assert "april&lt;b&gt;" in html and "april<b>" not in html
    assert "data:image/png;base64," in html and "reward (last 10)" in html
    assert not list((tmp_path / "out").glob(".*tmp*"))


def test_a_folder_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an RL run folder"):
        summarize(tmp_path)
