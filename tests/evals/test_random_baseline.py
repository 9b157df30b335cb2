"""The random baseline: ``subnets.random_baseline`` evaluates every task on a random-initialised twin."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from ernie5.config import ConfigError
from ernie5.fast import is_fast
from ernie5.model.elastic import Subnet
from ernie5.store.checkpoint import load_checkpoint
from evals.results import MANIFEST_KEYS, RANDOM_BASELINE, read_unit, unit_path
from evals.suite import load_suite
from evals.sweep import plan_units, random_twin, run_sweep


@pytest.fixture(scope="module")
def no_data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("no-data")  # an empty data root: shakespeare_bpb is skipped


def _suite(folder: Path, body: str, name: str = "suite.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(body)
    return path


def _body(random_baseline: str | None = "true", seed: int = 0) -> str:
    key = "" if random_baseline is None else f", random_baseline: {random_baseline}"
    # per-task seeds: the suite seed then only seeds the random twin
    return f"""
name: rb
seed: {seed}
batch_size: 8
tasks:
  - {{task: arith_d1, limit: 4, seed: 0}}
  - {{task: copy_l8, limit: 4, seed: 0}}
  - {{task: shakespeare_bpb, limit: 1, seed: 0}}
subnets: {{specs: [full, k1]{key}}}
efficiency: {{enabled: true, prompt_len: 8, decode_tokens: 4, repeats: 1}}
"""


TASK_NAMES = ["arith_d1", "copy_l8", "shakespeare_bpb"]


@pytest.fixture(scope="module")
def swept(micro_ckpt, no_data, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("swept")
    summary = run_sweep(micro_ckpt, _suite(root, _body()), root / "run", data_dir=no_data, quiet=True)
    assert summary.n_units == 9 and summary.errors == 0  # (full, k1, random) x 3 tasks
    assert summary.computed == 6 and summary.skipped == 3
    return root / "run"


def test_the_random_baseline_is_written_like_a_subnet_but_is_none(swept):
    for task in TASK_NAMES:
        rec = read_unit(unit_path(swept, RANDOM_BASELINE, task))
        assert rec is not None and rec["subnet"] == "random"
        assert rec["fingerprint"] != read_unit(unit_path(swept, "full", task))["fingerprint"]
        assert "routing" not in rec
    skipped = read_unit(unit_path(swept, "random", "shakespeare_bpb"))
    assert skipped["status"] == "skipped"  # unavailable for the checkpoint: skipped for random too
    assert skipped["reason"] == read_unit(unit_path(swept, "full", "shakespeare_bpb"))["reason"]
    results = pd.read_csv(swept / "results.csv")
    assert set(results.loc[results["subnet"] == "random", "task"]) == {"arith_d1", "copy_l8"}
    units = pd.read_csv(swept / "units.csv")
    assert sorted(units.loc[units["subnet"] == "random", "task"]) == TASK_NAMES
    assert (swept / "samples" / "random" / "arith_d1.jsonl").read_text().count("\n") == 4
    manifest = json.loads((swept / "manifest.json").read_text())
    assert "baseline" in MANIFEST_KEYS and manifest["baseline"] == "random"
    assert [s["name"] for s in manifest["subnets"]] == ["full", "k1"]
    assert [t["name"] for t in manifest["tasks"]] == TASK_NAMES
    assert {(u["subnet"], u["task"]) for u in manifest["units"]} == {
        (s, t) for s in ("full", "k1", "random") for t in TASK_NAMES
    }
    assert pd.read_csv(swept / "efficiency.csv")["subnet"].tolist() == ["full", "k1"]
    assert sorted(p.name for p in (swept / "routing").iterdir()) == ["full.json", "k1.json"]


def _answers(run: Path, subnet: str, task: str) -> list:
    lines = (run / "samples" / subnet / f"{task}.jsonl").read_text().splitlines()
    return [json.loads(line)["sample"] for line in lines]


def test_the_random_model_answers_otherwise_and_deterministically(swept, micro_ckpt, no_data, tmp_path):
    for task in ("arith_d1", "copy_l8"):
        assert _answers(swept, "random", task) != _answers(swept, "full", task)
    again = tmp_path / "again"
    run_sweep(micro_ckpt, _suite(tmp_path, _body()), again, data_dir=no_data, quiet=True)
    a, b = pd.read_csv(swept / "results.csv"), pd.read_csv(again / "results.csv")
    pd.testing.assert_frame_equal(a[a["subnet"] == "random"], b[b["subnet"] == "random"])
    for task in ("arith_d1", "copy_l8"):
        assert _answers(again, "random", task) == _answers(swept, "random", task)


def test_resume_reuses_the_random_units_and_another_seed_recomputes_them(micro_ckpt, no_data, tmp_path):
    out = tmp_path / "run"
    run_sweep(micro_ckpt, _suite(tmp_path, _body()), out, data_dir=no_data, quiet=True)
    before = {t: read_unit(unit_path(out, "random", t))["fingerprint"] for t in TASK_NAMES}
    again = run_sweep(micro_ckpt, _suite(tmp_path, _body()), out, data_dir=no_data, quiet=True)
    assert again.reused == again.n_units == 9 and again.computed == 0
    seeded = run_sweep(micro_ckpt, _suite(tmp_path, _body(seed=1)), out, data_dir=no_data, quiet=True)
    assert seeded.computed == 2 and seeded.skipped == 1 and seeded.reused == 6  # only random's units
    after = {t: read_unit(unit_path(out, "random", t))["fingerprint"] for t in TASK_NAMES}
    assert all(after[t] != before[t] for t in TASK_NAMES)
    assert json.loads((out / "manifest.json").read_text())["seeds"] == [0]


@pytest.mark.parametrize(
    ("subnets", "fragment"),
    [
        ('{specs: [full], random_baseline: "yes"}', "not a bool"),
        ("{specs: [full], random_baseline: 1}", "not a bool"),
        ("{specs: [full], random_baselines: true}", "unknown key 'subnets.random_baselines'"),
    ],
)
def test_a_bad_random_baseline_is_a_one_line_error(tmp_path, subnets, fragment):
    path = _suite(tmp_path, f"name: x\ntasks: [{{task: arith_d1}}]\nsubnets: {subnets}\n")
    with pytest.raises(ConfigError) as e:
        load_suite(path)
    assert fragment in str(e.value) and "random_baseline" in str(e.value) and "\n" not in str(e.value)


def test_off_by_default_and_the_sub_models_fingerprints_do_not_move(micro_ckpt, no_data, tmp_path):
    ckpt = load_checkpoint(micro_ckpt)
    full = Subnet.full(ckpt.cfg)
    default, off, on = (load_suite(_suite(tmp_path, _body(v), f"{v}.yaml")) for v in (None, "false", "true"))
    assert default.cfg.subnets.random_baseline is False and on.cfg.subnets.random_baseline is True
    plans = {
        k: plan_units(s, "h", [full], no_data, None, random_baseline=full if k == "on" else None)
        for k, s in {"default": default, "off": off, "on": on}.items()
    }
    fps = {k: [(p.name, p.task.name, p.fingerprint) for p in v] for k, v in plans.items()}
    assert fps["default"] == fps["off"] == fps["on"][:3]  # turning it on recomputes no sub-model
    assert [n for n, _, _ in fps["on"][3:]] == ["random"] * 3
    assert not {f for *_, f in fps["on"][3:]} & {f for *_, f in fps["on"][:3]}
    out = tmp_path / "run"
    run_sweep(micro_ckpt, default.path, out, data_dir=no_data, quiet=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["baseline"] is None and {u["subnet"] for u in manifest["units"]} == {"full", "k1"}
    assert not (out / "units" / "random").exists() and not (out / "samples" / "random").exists()
    assert "random" not in set(pd.read_csv(out / "units.csv")["subnet"])


def test_the_random_twin(micro_ckpt):
    ckpt = load_checkpoint(micro_ckpt)
    state = torch.random.get_rng_state()
    a, b, c = random_twin(ckpt, 0), random_twin(ckpt, 0), random_twin(ckpt, 1)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
    sa, sb, sc, ref = (m.model.state_dict() for m in (a, b, c, ckpt))
    assert sa.keys() == ref.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert any(not torch.equal(sa[k], ref[k]) for k in sa)
    assert all(sa[k].dtype == ref[k].dtype and sa[k].device == ref[k].device for k in sa)
    assert is_fast(a.model) == is_fast(ckpt.model) and not a.model.training
    assert a.tokenizer is ckpt.tokenizer and a.cfg is ckpt.cfg and a.path == ckpt.path
    assert (a.vision_tokenizer, a.refiner, a.audio_codec) == (
        ckpt.vision_tokenizer,
        ckpt.refiner,
        ckpt.audio_codec,
    )
