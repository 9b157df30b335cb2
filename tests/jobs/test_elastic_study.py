"""``ernie5 study elastic``: the study config, its arms' shapes, a micro study end to end, and a study
killed (``kill -9``) mid-training that continues to the same results as an uninterrupted one."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import yaml

from ernie5.config import ConfigError
from ernie5.subnets.extract import subnet_config
from ernie5.subnets.spec import resolve
from jobs.cli import main
from jobs.elastic_study import all_specs, arm_configs, load_study_config, recovery_config, variants
from tests.conftest import ROOT, cli_env

TEST_SUITE = """\
name: elastic_study_test
seed: 0
batch_size: 16
tasks:
  - {task: arith_d1, limit: 8}
  - {task: copy_l8, limit: 8}
subnets: {specs: [full], random_baseline: true}
efficiency: {enabled: true, prompt_len: 8, decode_tokens: 4, repeats: 1}
routing: true
"""


def _study_files(tmp_path, steps: int = 9):
    suite = tmp_path / "suite.yaml"
    suite.write_text(TEST_SUITE)
    cfg = tmp_path / "study.yaml"
    cfg.write_text(
        "base: micro\n"
        "overrides: [data.tokenizer_chars=20000, train.ckpt_every=3, data.batch_size=2, data.seq_len=64]\n"
        f"steps: {steps}\nshapes: [d0.75, k1]\nsuite: {suite}\nrecovery_steps: 2\nrandom_seeds: [1]\n"
        "val_batches: 3\n"
    )
    return cfg


def test_the_study_presets_load_and_their_static_arms_have_the_sub_models_shapes():
    cfg = load_study_config("study_micro")
    assert cfg.shapes == ("d0.75", "w0.5", "k1", "d0.75-w0.5-k0.5")
    assert load_study_config("study_small").base == "mini"
    arms = arm_configs(cfg)
    assert arms["elastic"].elastic.enabled and not arms["static"].elastic.enabled
    full = arms["static"].model
    shapes = {s: (a.model.n_layers, a.model.moe.n_experts, a.model.moe.top_k) for s, a in arms.items()}
    assert shapes["static-d0.75"] == (3, 8, 2)
    assert shapes["static-w0.5"] == (4, 4, 2)
    assert shapes["static-k1"] == (4, 8, 1)
    assert shapes["static-d0.75-w0.5-k0.5"] == (3, 4, 1)
    assert all(a.train.steps == cfg.steps for a in arms.values())
    rec = recovery_config(cfg, "d0.75-w0.5-k0.5", ROOT / "x")
    assert (
        rec.model
        == subnet_config(full, resolve("d0.75-w0.5-k0.5", full))
        == arms["static-d0.75-w0.5-k0.5"].model
    )
    assert rec.train.init_from == str(ROOT / "x") and rec.train.steps == cfg.recovery_steps


def test_the_multimodal_study_trains_the_reference_recipe_and_measures_each_modalitys_loss():
    """``study_mm``: the reference shape and mixture with the shipped tokenizer and codec; the held-out
    loss of a multimodal checkpoint carries the image (NFSP) and audio (NCP) generation losses per
    batch beside the next-token loss, paired batch by batch across arms."""
    from jobs.elastic_study import heldout_loss, run_config

    cfg = load_study_config("study_mm")
    run = run_config(cfg)
    assert run.model.vision.enabled and run.model.audio.enabled and run.train.steps == cfg.steps
    assert (run.data.vision_tokenizer, run.data.audio_codec) == ("reference", "reference")
    assert {"shapes", "dtmf", "fsdd", "procedural"} <= set(run.data.sources)
    suite = yaml.safe_load((ROOT / "suites" / f"{cfg.suite}.yaml").read_text())
    assert {"digit_vqa", "video_shapes", "speaker_id", "arith_d1"} <= {t["task"] for t in suite["tasks"]}
    small = dataclasses.replace(run, data=dataclasses.replace(run.data, batch_size=2))
    two = dataclasses.replace(cfg, val_batches=2)
    out = heldout_loss(ROOT / "ernie5" / "reference", ["full", "k1"], small, None, two)
    for spec in ("full", "k1"):
        rec = out["subnets"][spec]
        assert len(rec["batches"]) == 2 and all(math.isfinite(x) for x in rec["batches"])
        media = [x for k in ("vision_batches", "audio_batches") for x in rec.get(k, []) if x is not None]
        assert media and all(math.isfinite(x) and x > 0 for x in media)
    again = heldout_loss(ROOT / "ernie5" / "reference", ["full"], small, None, two)
    assert again["subnets"]["full"] == out["subnets"]["full"]


def test_deploy_selections_of_each_shape():
    cfg = load_study_config("study_micro")
    assert variants("d0.75", cfg) == {
        "default": "d0.75",
        "importance": "d0.75-Limportance",
        "random:1": "d0.75-Lrandom1",
    }
    assert variants("w0.5", cfg)["importance"] == "w0.5-Eimportance"
    assert variants("k1", cfg) == {"default": "k1"}  # top-k selects nothing
    specs = all_specs(cfg)
    assert specs[0] == "full" and len(specs) == len(set(specs)) == 1 + 3 + 3 + 1 + 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("steps=0", "steps=0 must be >= 1"),
        ("shapes=[full]", "is the full model"),
        ("shapes=[d0.75, d0.75]", "name one shape twice"),
        ("shapes=[d2x]", "shapes: 'd2x': d='2x' is not a number"),
        ("bogus=1", "unknown key 'bogus'"),
        ("val_batches=1", "val_batches=1 must be >= 2"),
    ],
)
def test_bad_study_configs_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_study_config("study_micro", [override])


def test_the_cli_refuses_bad_input_before_any_work(tmp_path, capsys):
    assert (
        main(
            ["study", "elastic", "--config", "study_micro", "--set", "steps=0", "--out", str(tmp_path / "a")]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == "ernie5 study: error: steps=0 must be >= 1"
    other = tmp_path / "other"
    other.mkdir()
    (other / "file.txt").write_text("x")
    assert main(["study", "elastic", "--config", "study_micro", "--out", str(other)]) == 2
    assert "is not an elastic study folder" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["file.txt"]  # nothing written


def _study(cfg, out, **popen):
    cmd = [
        sys.executable,
        "-m",
        "jobs.cli",
        "study",
        "elastic",
        "--config",
        str(cfg),
        "--out",
        str(out),
        "--quiet",
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen
    )


def _finish(proc) -> None:
    try:
        _, err = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err.decode()[-2000:]


def _results(out) -> dict:
    """Everything a study measured that does not depend on timing: held-out losses and sweep scores."""
    losses = {p.stem: json.loads(p.read_text())["subnets"] for p in sorted((out / "loss").glob("*.json"))}
    scores = {
        d.name: pd.read_csv(d / "results.csv")[["subnet", "task", "metric", "value"]].to_dict("records")
        for d in sorted((out / "sweeps").iterdir())
    }
    return {"loss": losses, "scores": scores}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """An uninterrupted micro study."""
    root = tmp_path_factory.mktemp("elastic_study")
    cfg = _study_files(root)
    _finish(_study(cfg, root / "a"))
    return cfg, root / "a"


@pytest.mark.slow
def test_a_micro_study_end_to_end(finished):
    cfg, out = finished
    summary = json.loads((out / "summary.json").read_text())
    rows = {(r["shape"], r["family"]) for r in summary["main"]}
    assert rows == {(s, f) for s in ("d0.75", "k1") for f in ("elastic", "static", "pruned", "pruned+rec")}
    assert all(r["val_loss"] > 0 and r["active_params"] > 0 for r in summary["main"])
    assert 0.5 < summary["cost_of_elasticity"]["ratio"] < 2.0
    assert {(r["family"], r["selection"]) for r in summary["selection"] if r["shape"] == "d0.75"} == {
        (f, s) for f in ("elastic", "pruned") for s in ("default", "importance", "random:1")
    }
    assert (out / "pruned" / "d0.75" / "meta.json").is_file()
    rec = yaml.safe_load((out / "train" / "recover-d0.75" / "config.yaml").read_text())
    assert rec["train"]["init_from"] == str(out / "pruned" / "d0.75") and rec["model"]["n_layers"] == 3
    assert "## Verdicts" in (out / "report.md").read_text()
    # a rerun skips every finished unit (nothing trained or evaluated again)
    ledger = json.loads((out / "study.json").read_text())["units"]
    _finish(_study(cfg, out))
    assert json.loads((out / "study.json").read_text())["units"] == ledger


@pytest.mark.slow
def test_a_study_killed_mid_training_continues_to_the_same_results(finished, tmp_path):
    cfg, reference = finished
    out = tmp_path / "b"
    proc = _study(cfg, out, start_new_session=True)
    first, last = (out / "train" / "elastic" / "checkpoints" / f"step_{s:08d}" / "meta.json" for s in (3, 9))
    deadline = time.time() + 600
    while not first.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert first.is_file() and not last.is_file(), "the study was not killed mid-training"
    _finish(_study(cfg, out))
    assert _results(out) == _results(reference)
