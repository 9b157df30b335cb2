"""Skipped units are grouped by reason (one row each, with the tasks, the subnets and how to get the
data); failed units stay listed one by one; every task's data hint matches the files it reads."""

from __future__ import annotations

import re

import pandas as pd
import pytest

import evals.tasks  # noqa: F401  (registers the tasks)
from evals.results import write_tables, write_unit
from evals.task import TASKS
from reports import build_report
from reports.skips import group_skips

SUBNETS = ["full", "k1", "d0.75"]
NO_VISION = "the checkpoint has no vision (task {} needs it)"  # a reason naming its task
NO_AUDIO = (  # the reason the sweep records
    "the checkpoint has no audio module; to get it: evaluate a checkpoint trained with audio "
    "(the preset mini_all trains every modality)"
)
DATA_TASKS = ("digit_vqa", "video_digits", "t2i_digits", "t2v_digits", "asr_fsdd", "speaker_id")


def _missing(task: str) -> str:
    """The reason the sweep records for ``task`` without a data root (the real message)."""
    ok, reason = TASKS.get(task)().available(None)
    assert not ok
    return reason


def _units(rows: list[tuple[str, str, str, str]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["subnet", "task", "status", "reason"])


def test_skips_are_one_row_per_reason_with_tasks_subnets_and_how_to_get():
    rows = [(s, t, "skipped", _missing(t)) for s in SUBNETS for t in DATA_TASKS]
    rows += [(s, t, "skipped", NO_VISION.format(t)) for s in SUBNETS for t in ("t2i_shapes", "recon_shapes")]
    rows += [(s, t, "skipped", NO_AUDIO) for s in SUBNETS for t in ("tts_dtmf", "asr_dtmf")]
    rows += [("full", "arith", "ok", ""), ("k1", "arith", "error", "RuntimeError: boom")]
    groups = group_skips(_units(rows), SUBNETS).set_index("tasks")
    assert len(groups) == 4  # MNIST, FSDD, no vision, no audio: 30 skipped units
    mnist = groups.loc["digit_vqa, t2i_digits, t2v_digits, video_digits"]
    assert mnist["units"] == 12 and mnist["subnets"] == "all 3"
    assert mnist["reason"].startswith("missing data (no data root") and "mnist/t10k-images" in mnist["reason"]
    assert "<root>/mnist/" in mnist["how_to_get"] and "nothing to get" not in mnist["how_to_get"]
    assert "<root>/fsdd" in groups.loc["asr_fsdd, speaker_id", "how_to_get"]
    vision = groups.loc["recon_shapes, t2i_shapes"]
    assert vision["reason"] == NO_VISION.format("{task}") and vision["units"] == 6
    assert vision["how_to_get"] == ""
    audio = groups.loc["asr_dtmf, tts_dtmf"]
    assert audio["reason"] == "the checkpoint has no audio module" and "mini_all" in audio["how_to_get"]
    assert groups["units"].sum() == 30  # errors are not skips


def test_subnets_are_listed_when_not_all_of_them_skip():
    rows = [("k1", "digit_vqa", "skipped", "too long"), ("d0.75", "digit_vqa", "skipped", "too long")]
    rows += [("full", "digit_vqa", "ok", "")]
    (group,) = group_skips(_units(rows), SUBNETS).to_dict(orient="records")
    assert group["subnets"] == "k1, d0.75" and group["reason"] == "too long" and group["units"] == 2


def test_report_groups_skips_and_lists_failures_one_by_one(make_run):
    run = make_run("many-skips", routing=False)
    template = {
        "fingerprint": "s",
        "task_version": 1,
        "capability": "generation",
        "status": "skipped",
        "metrics": {},
        "n_examples": 0,
        "limit": None,
        "seed": 0,
        "kwargs": {},
        "wall_s": 0.0,
        "model_s": 0.0,
    }
    subnets = [d.name for d in (run / "units").iterdir()]
    for subnet in subnets:
        for task in DATA_TASKS:
            record = {
                **template,
                "subnet": subnet,
                "task": task,
                "modality": "image",
                "reason": _missing(task),
            }
            write_unit(run, record, [])
    write_tables(run)
    out = build_report(run)
    page, summary = (out / "index.html").read_text(), (out / "summary.md").read_text()
    skipped = re.search(
        r"<h3>Skipped units, by reason \((\d+) units, (\d+) reasons\)</h3>(.*?)</table>", page
    )
    assert skipped and skipped[1] == str(len(subnets) * (len(DATA_TASKS) + 1)) and skipped[2] == "3"
    assert skipped[3].count("<tr>") == 1 + 3  # header + one row per reason (MNIST, FSDD, video data)
    assert f"all {len(subnets)}" in skipped[3] and "&lt;root&gt;/mnist/" in skipped[3]
    failed = re.search(r"<h3>Failed units</h3>(.*?)</table>", page)
    assert failed and failed[1].count("<tr>") == 2 and "CUDA out of memory" in failed[1]
    assert "## Skipped units, by reason" in summary and summary.count("no data root") == 2
    assert "## Failed units" in summary and "CUDA out of memory" in summary


@pytest.mark.parametrize("name", TASKS.names())
def test_every_task_says_how_to_get_the_files_it_reads(name):
    cls = TASKS.get(name)
    if not cls.data_files:
        assert cls.how_to_get.startswith("nothing to get"), cls.how_to_get
        return
    assert cls.how_to_get and "nothing to get" not in cls.how_to_get
    for folder in sorted({f.split("/")[0] for f in cls.data_files}):
        assert f"<root>/{folder}" in cls.how_to_get, (folder, cls.how_to_get)
