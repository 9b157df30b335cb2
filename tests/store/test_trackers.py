"""Experiment trackers (ernie5.store.trackers): names checked up front, numbers read back from each
tracker's own files, offline by default (no network, even where there is one)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ernie5.config import ConfigError
from ernie5.store import trackers as trackers_module
from ernie5.store.trackers import Trackers, parse_log_with, scalars

ROOT = Path(__file__).resolve().parents[2]


def needs(package: str) -> None:
    """Skip the calling test when a tracker's package is not installed."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install -e '.[trackers]')")


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the TensorBoard event files under ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for events in sorted({p.parent for p in folder.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def test_names_are_checked_before_any_work(monkeypatch):
    assert parse_log_with(None) == () and parse_log_with([]) == ()
    needs("tensorboard")
    assert parse_log_with(["tensorboard", "tensorboard,"]) == ("tensorboard",)
    with pytest.raises(
        ConfigError, match=r"--log-with 'neptune': expected one of tensorboard, wandb, mlflow"
    ):
        parse_log_with("tensorboard,neptune")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        trackers_module.importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
    )
    with pytest.raises(ConfigError, match=r"the wandb package is not installed \(pip install wandb\)"):
        parse_log_with("wandb")


def test_only_numbers_are_logged_nested_ones_flattened():
    record = {
        "step": 3,
        "loss": 1.5,
        "ok": True,
        "note": "x",
        "per_mod": {"text": 0.25, "ids": [1]},
        "n": None,
    }
    assert scalars(record) == {"step": 3.0, "loss": 1.5, "ok": 1.0, "per_mod/text": 0.25}
    assert scalars({"a": {"b": {"c": 2}}}, "pre/") == {"pre/a/b/c": 2.0}


def test_no_trackers_do_nothing(tmp_path):
    with Trackers((), tmp_path / "run", "run") as t:
        t.log({"loss": 1.0}, step=1)
    assert not (tmp_path / "run").exists()


def test_tensorboard_gets_every_step(tmp_path):
    needs("tensorboard")
    with Trackers(("tensorboard",), tmp_path, "demo", {"train": {"lr": 0.1, "betas": (0.9, 0.95)}}) as t:
        for step in range(1, 4):
            t.log({"loss": 1.0 / step, "per_mod": {"text": 0.5}}, step=step)
    got = tensorboard_scalars(tmp_path / "tensorboard" / "demo")
    assert got["loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert got["per_mod/text"] == [(1, 0.5), (2, 0.5), (3, 0.5)]


def test_mlflow_writes_a_store_in_the_run_folder(tmp_path, monkeypatch):
    needs("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with Trackers(("mlflow",), tmp_path / "run", "demo", {"train": {"steps": 3}}) as t:
        for step in range(3):
            t.log({"loss": 2.0 - step}, step=step)
    import mlflow

    client = mlflow.tracking.MlflowClient(trackers_module._mlflow_store(tmp_path / "run"))
    (run,) = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [
        (0, 2.0),
        (1, 1.0),
        (2, 0.0),
    ]
    assert run.data.params["train.steps"] == "3"


def test_wandb_writes_an_offline_run(tmp_path, monkeypatch):
    needs("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with Trackers(("wandb",), tmp_path, "demo") as t:
        t.log({"loss_marker_7": 0.5}, step=1)
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    (data,) = run.glob("run-*.wandb")
    assert b"loss_marker_7" in data.read_bytes()


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning(tmp_path, capsys):
    needs("tensorboard")
    t = Trackers(("tensorboard",), tmp_path, "demo")

    class Broken:
        name = "tensorboard"

        def log(self, *a, **k):
            raise OSError("disk gone")

        def finish(self):
            pass

    t._trackers = [Broken()]
    t.log({"loss": 1.0}, step=1)
    t.log({"loss": 1.0}, step=2)
    err = capsys.readouterr().err
    assert err.count("the tensorboard tracker failed (OSError: disk gone)") == 1
    t.close()


SCRIPT = """
import sys
from ernie5.store.trackers import Trackers
for name in ("tensorboard", "wandb", "mlflow"):
    with Trackers((name,), sys.argv[1] + "/" + name, "demo", {"a": 1}) as t:
        t.log({"loss": 1.0}, step=1)
print("ok")
"""


def test_all_three_run_with_no_network_at_all(tmp_path):
    """In a network namespace of its own (``unshare -n``: no interface but loopback) the three
    trackers start, log and close: by default none needs the network."""
    for package in ("tensorboard", "wandb", "mlflow"):
        needs(package)
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -n is not allowed here (needs root or user namespaces)")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [unshare, "-n", sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert json.dumps(tensorboard_scalars(tmp_path / "tensorboard")) == json.dumps({"loss": [[1, 1.0]]})
