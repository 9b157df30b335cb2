"""``--device`` of ``sweep``, ``nightly`` and ``recipe``: where the model runs, recorded in the manifest;
a bad or absent device stops before any work (one line, exit 2). The GPU side is
``tests/evals/test_cuda.py`` (skipped without a GPU; ``launch/gpu_check.sh`` runs it)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from jobs.cli import main

SUITE = """
name: placed
batch_size: 8
tasks:
  - {task: arith_d1, limit: 8}
subnets: {specs: [full, k1]}
efficiency: {enabled: false}
"""

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")


def test_cpu_and_auto_give_the_same_tables_and_the_manifest_names_the_device(micro_ckpt, tmp_path):
    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE)
    runs = {}
    for device in ("cpu", "auto"):
        out = tmp_path / device
        args = ["sweep", "--checkpoint", str(micro_ckpt), "--suite", str(suite), "--out", str(out)]
        assert main([*args, "--quiet", "--device", device]) == 0
        runs[device] = out
    pd.testing.assert_frame_equal(
        pd.read_csv(runs["cpu"] / "results.csv"), pd.read_csv(runs["auto"] / "results.csv")
    )
    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert json.loads((runs["cpu"] / "manifest.json").read_text())["device"] == "cpu"
    assert json.loads((runs["auto"] / "manifest.json").read_text())["device"] == want


@pytest.mark.parametrize("command", ["sweep", "nightly"])
@pytest.mark.parametrize(
    ("device", "message"),
    [("gpu", "device='gpu': expected auto, cpu, cuda or cuda:N"), ("cuda:x", "expected auto, cpu, cuda")],
)
def test_a_bad_device_name_is_an_argument_error(command, device, message, tmp_path, capsys):
    args = [command, "--out", str(tmp_path / "run"), "--device", device, "--quiet"]
    if command == "sweep":
        args += ["--checkpoint", "reference", "--suite", "smoke"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@no_gpu
@pytest.mark.parametrize("command", ["sweep", "nightly"])
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_stops_before_any_work(command, device, tmp_path, capsys):
    args = [command, "--out", str(tmp_path / "run"), "--device", device, "--quiet"]
    if command == "sweep":
        args += ["--checkpoint", "reference", "--suite", "smoke"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ernie5 {command}: error: device='{device}', but no CUDA GPU is visible to this process"]
    assert not (tmp_path / "run").exists()


def test_recipe_device_reaches_the_backbone_stages_only(tmp_path, monkeypatch):
    """``recipe --device cpu`` puts ``train.device=cpu`` in the backbone's config (not in the recorded
    overrides, so a resume may move); the side stages are not asked to move."""
    import jobs.recipe as recipe

    seen = {}

    def fake_stage(folder, done, train, what, quiet):  # the side stages: nothing trained here
        return False

    def fake_train(cfg, run_dir, data_dir, quiet):
        seen[run_dir.name] = cfg.train.device
        raise SystemExit(0)  # stop after the backbone's config is built

    monkeypatch.setattr(recipe, "_stage", fake_stage)
    monkeypatch.setattr(recipe, "_train_run", fake_train)
    with pytest.raises(SystemExit):
        recipe.run_recipe(tmp_path / "r", None, device="cpu", quiet=True)
    assert seen == {"backbone": "cpu"}
    record = json.loads((tmp_path / "r" / "recipe.json").read_text())
    assert record["overrides"]["backbone"] == []
