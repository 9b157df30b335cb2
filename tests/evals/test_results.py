"""The run-folder contract: tables from the manifest's units only, one writer at a time, leftovers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from ernie5.store.runs import LOCK_FILE, RunLock, RunLocked
from evals.results import (
    all_units,
    manifest_units,
    remove_leftovers,
    write_tables,
    write_unit,
)


def _unit(run_dir: Path, subnet: str, task: str, value: float) -> None:
    metrics = {"acc": {"value": value, "stderr": 0.1, "n": 4, "higher_is_better": True}}
    record = {
        "fingerprint": f"{subnet}-{task}",
        "subnet": subnet,
        "task": task,
        "task_version": 1,
        "modality": "text",
        "capability": "reasoning",
        "status": "ok",
        "reason": "",
        "metrics": metrics,
        "n_examples": 4,
        "wall_s": 0.0,
        "model_s": 0.0,
    }
    write_unit(run_dir, record, [])


def _manifest(run_dir: Path, units: list[tuple[str, str]] | None) -> None:
    manifest = {"suite": "x"}
    if units is not None:
        manifest["units"] = [{"subnet": s, "task": t, "fingerprint": f"{s}-{t}"} for s, t in units]
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


def test_tables_hold_only_the_units_the_manifest_names(tmp_path):
    for subnet in ("full", "k1"):
        for task in ("arith_d1", "copy_l8"):
            _unit(tmp_path, subnet, task, 0.5)
    _manifest(tmp_path, [("full", "arith_d1")])  # a later sweep with another suite
    assert manifest_units(tmp_path) == {("full", "arith_d1")}
    assert [(u["subnet"], u["task"]) for u in all_units(tmp_path)] == [("full", "arith_d1")]
    results = write_tables(tmp_path)
    assert list(zip(results["subnet"], results["task"])) == [("full", "arith_d1")]
    assert pd.read_csv(tmp_path / "results.csv")["task"].tolist() == ["arith_d1"]
    assert pd.read_parquet(tmp_path / "results.parquet")["task"].tolist() == ["arith_d1"]
    assert pd.read_csv(tmp_path / "units.csv")["task"].tolist() == ["arith_d1"]
    # the stale unit files stay on disk, outside every table
    assert (tmp_path / "units" / "k1" / "copy_l8.json").is_file()
    # explicit names (what the sweep passes before it writes its manifest) win over the manifest
    names = [("k1", "copy_l8"), ("full", "copy_l8")]
    assert [(u["subnet"], u["task"]) for u in all_units(tmp_path, names)] == sorted(names)
    assert sorted(write_tables(tmp_path, names=names)["subnet"]) == ["full", "k1"]


def test_a_manifest_without_a_unit_list_keeps_every_unit_file(tmp_path):
    """Run folders written before manifests listed their units still read as before."""
    _unit(tmp_path, "full", "arith_d1", 0.5)
    _unit(tmp_path, "k1", "arith_d1", 0.25)
    _manifest(tmp_path, None)
    assert manifest_units(tmp_path) is None
    assert len(all_units(tmp_path)) == 2
    (tmp_path / "manifest.json").unlink()
    assert len(all_units(tmp_path)) == 2


def test_the_report_reads_only_the_manifest_units(tmp_path):
    from reports.load import load_run

    _unit(tmp_path, "full", "arith_d1", 0.5)
    _unit(tmp_path, "full", "copy_l8", 0.5)
    _manifest(tmp_path, [("full", "copy_l8")])
    run = load_run(tmp_path)
    assert run.units["task"].tolist() == ["copy_l8"]


def test_one_writer_at_a_time(tmp_path):
    run_dir = tmp_path / "run"
    first = RunLock(run_dir)
    with pytest.raises(RunLocked) as info:
        RunLock(run_dir)
    message = str(info.value)
    assert str(run_dir) in message and "another process" in message and "\n" not in message
    first.release()
    with RunLock(run_dir):  # free again once released
        pass
    assert (run_dir / LOCK_FILE).is_file()


def test_the_lock_is_held_across_processes_and_freed_when_its_holder_dies(tmp_path):
    run_dir = tmp_path / "run"
    code = (
        "import sys, time; from ernie5.store.runs import RunLock; "
        f"lock = RunLock({str(run_dir)!r}); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLocked, match=f"by process {holder.pid}"):
            RunLock(run_dir)
    finally:
        holder.kill()
        holder.wait(30)
    RunLock(run_dir).release()  # the kernel dropped the dead holder's lock


def test_leftovers_of_a_killed_run_are_removed(tmp_path):
    kept = [
        tmp_path / "results.csv",
        tmp_path / "units" / "full" / "arith_d1.json",
        tmp_path / "report" / ".index.html.tmp-7",  # `ernie5 report` may be writing it right now
        tmp_path / "cache.sqlite",
    ]
    leftovers = [
        tmp_path / ".results.csv.tmp-123",
        tmp_path / ".results.parquet.tmp",
        tmp_path / "units" / "full" / ".arith_d1.json.tmp-999",
        tmp_path / "samples" / "full" / ".arith_d1.jsonl.tmp-5",
        tmp_path / "efficiency" / ".full.json.tmp-5",
        tmp_path / "routing" / ".k1.json.tmp-5",
    ]
    for p in kept + leftovers:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("{partial")
    moved_aside = tmp_path / "units" / ".full.old-42"
    (moved_aside / "inner").mkdir(parents=True)
    (moved_aside / "inner" / ".x.json.tmp-1").write_text("")
    removed = remove_leftovers(tmp_path)
    assert sorted(removed) == sorted([*leftovers, moved_aside])
    assert not any(p.exists() for p in [*leftovers, moved_aside])
    assert all(p.is_file() for p in kept)
    assert remove_leftovers(tmp_path) == []
