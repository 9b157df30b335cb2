"""The main job: ``ernie5 nightly`` on a given checkpoint (fast) and from scratch (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.cli import main
from tests.conftest import cli_env


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("nightly") / "train"
    assert (
        main(
            [
                "train",
                "--config",
                "micro",
                "--out",
                str(run),
                "--quiet",
                "--set",
                "train.steps=10",
                "--set",
                "data.tokenizer_chars=20000",
            ]
        )
        == 0
    )
    return run


def test_nightly_on_a_checkpoint_writes_sweep_and_report(micro_run, tmp_path, capsys):
    out = tmp_path / "night"
    assert (
        main(["nightly", "--checkpoint", str(micro_run), "--suite", "smoke", "--out", str(out), "--quiet"])
        == 0
    )
    summary = json.loads((out / "nightly.json").read_text())
    # (3 sub-models + the random baseline) x 4 tasks
    assert summary["units"] == 16 and summary["errors"] == 0 and summary["failed_units"] == []
    assert (out / "results.csv").is_file() and (out / "manifest.json").is_file()
    assert (out / "report" / "index.html").is_file() and (out / "report" / "summary.md").is_file()
    # a second night against the first as baseline: no change, comparison written
    out2 = tmp_path / "night2"
    assert (
        main(
            [
                "nightly",
                "--checkpoint",
                str(micro_run),
                "--suite",
                "smoke",
                "--out",
                str(out2),
                "--quiet",
                "--baseline",
                str(out),
            ]
        )
        == 0
    )
    second = json.loads((out2 / "nightly.json").read_text())
    assert second["regression"] is False and Path(second["comparison"]).is_dir()


def test_nightly_bad_input(tmp_path, capsys):
    assert main(["nightly", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert main(["nightly", "--suite", "no-such-suite", "--checkpoint", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "unknown suite" in err
    # a data root that is not a folder is refused before any model is trained
    assert main(["nightly", "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--data-dir {str(tmp_path / 'nowhere')!r} does not exist" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_nightly_passes_the_unsafe_code_flag_and_the_failed_units_on(tmp_path, monkeypatch):
    import evals.sweep
    from jobs.nightly import run_nightly

    seen = []

    def sweep(*args, **kwargs):
        seen.append(kwargs["confirm_run_unsafe_code"])
        raise KeyboardInterrupt  # stop before the report

    monkeypatch.setattr(evals.sweep, "run_sweep", sweep)
    for flag in (False, True):
        with pytest.raises(KeyboardInterrupt):
            run_nightly(checkpoint=tmp_path, out=tmp_path / "o", quiet=True, confirm_run_unsafe_code=flag)
    assert seen == [False, True]


def test_nightly_sweeps_the_shipped_reference_by_default(tmp_path, monkeypatch):
    """No --checkpoint: the shipped reference model is swept; nothing is trained."""
    import evals.sweep
    import train.pretrain.loop
    from jobs.nightly import run_nightly

    seen = []

    def sweep(checkpoint, *args, **kwargs):
        seen.append(checkpoint)
        raise KeyboardInterrupt

    def no_training(*args, **kwargs):
        raise AssertionError("the nightly must not train")

    monkeypatch.setattr(evals.sweep, "run_sweep", sweep)
    monkeypatch.setattr(train.pretrain.loop, "pretrain", no_training)
    with pytest.raises(KeyboardInterrupt):
        run_nightly(out=tmp_path / "o", quiet=True)
    assert seen == ["reference"]


@pytest.mark.slow
def test_nightly_on_a_fresh_machine_within_10_minutes(tmp_path):
    """No arguments, no data root, empty cache: sweeps the shipped reference and reports, with every
    task that needs no data computed in all four modalities."""
    import pandas as pd

    env = cli_env(HOME=str(tmp_path / "home"), ERNIE5_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("ERNIE5_DATA_DIR", None)
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "nightly", "--quiet"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    runs = list((tmp_path / "runs").glob("nightly-*"))
    assert len(runs) == 1
    summary = json.loads((runs[0] / "nightly.json").read_text())
    assert summary["errors"] == 0 and summary["computed"] > 0
    assert summary["checkpoint"] == "reference"
    units = pd.read_csv(runs[0] / "units.csv")
    skipped = units[units["status"] == "skipped"]
    # only tasks that need the data root are skipped, and every modality has computed tasks
    assert skipped["reason"].str.contains("data", case=False).all(), skipped.to_string()
    results = pd.read_csv(runs[0] / "results.csv")
    assert {"text", "image", "video", "audio"} <= set(results["modality"]), set(results["modality"])
    assert (runs[0] / "report" / "index.html").is_file()
    assert elapsed < 600, f"nightly took {elapsed:.0f}s"
