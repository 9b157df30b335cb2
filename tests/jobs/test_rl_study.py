"""``ernie5 rl-study``: every arm is an RL run, a finished arm is kept on a rerun, the section is written."""

from __future__ import annotations

import json

import pytest

from ernie5.config import load
from ernie5.presets import resolve_config_path
from ernie5.store.checkpoint import checkpoint_dirs
from evals.hints import Skeleton
from jobs.rl_study import STUDIES, run_study
from train.common.run_folder import RunError
from train.pretrain.config import RunConfig
from train.pretrain.loop import pretrain


class _Query:
    def __init__(self, index: int) -> None:
        self.context, self.max_new_tokens, self.stop = f"Q: {index % 5}\nA:", 3, ("\n",)
        self.skeleton = Skeleton(("two e", "ee"))


class _Verifier:
    name, modality = "toy", "text"

    def query(self, index: int, seed: int) -> _Query:
        return _Query(index)

    def reward(self, query, text: str) -> float:
        return float("e" in text)


@pytest.fixture(scope="module")
def micro_ckpt(tmp_path_factory):
    run = tmp_path_factory.mktemp("study") / "base"
    cfg = load(RunConfig, resolve_config_path("micro"), ["train.steps=4", "data.tokenizer_chars=20000"])
    pretrain(cfg, run, quiet=True)
    return checkpoint_dirs(run)[-1]


def test_the_ahrl_study_runs_its_arms_and_writes_its_section(micro_ckpt, tmp_path):
    overrides = [
        "tasks={toy: 1.0}", "rl.steps=2", "rl.dtype=fp32", "rollout.queries_per_step=2",
        "rollout.group_size=2", "rollout.pool_size=4",
    ]  # fmt: skip
    calls = []
    seeds = []

    def verifiers(cfg):
        calls.append(cfg.objective.ahrl)
        seeds.append(cfg.rl.seed)
        return {"toy": _Verifier()}

    report = run_study("ahrl", str(micro_ckpt), tmp_path, verifiers, overrides=overrides, seeds=2, quiet=True)
    assert calls == [True, True, False, False] and seeds == [0, 1, 0, 1]  # the same seeds for every arm
    text = report.read_text()
    assert "| ahrl | 2 | 2 |" in text and "| no-hints | 2 | 2 |" in text and "→" in text and " ± " in text
    assert "## Differences from ahrl" in text and "p (Holm)" in text
    events = [
        json.loads(x) for x in (tmp_path / "ahrl" / "seed_1" / "metrics.jsonl").read_text().splitlines()
    ]
    assert {e.get("event") for e in events} >= {"pass_init", "pass_final"}
    # a rerun keeps the finished runs (no verifier is built again)
    run_study("ahrl", str(micro_ckpt), tmp_path, verifiers, overrides=overrides, seeds=2, quiet=True)
    assert len(calls) == 4


def test_studies_name_their_arms_and_unknown_studies_are_refused(micro_ckpt, tmp_path):
    assert set(STUDIES) == {"objective", "ahrl", "scheduler"}
    assert set(STUDIES["scheduler"]["arms"]) == {"urb", "april", "sync"}
    with pytest.raises(RunError, match="unknown rl study 'kl'"):
        run_study("kl", str(micro_ckpt), tmp_path, lambda cfg: {})


def test_each_run_and_the_start_are_scored_on_the_harness_items_after_rl(micro_ckpt, tmp_path):
    """A harness task's verifier: every finished run's last checkpoint and the starting checkpoint are
    swept over the task's own evaluation items, and the report sets them side by side and tests them."""
    import pandas as pd

    from evals.verifiers import TaskVerifier

    overrides = [
        "tasks={reverse_l8: 1.0}", "rl.steps=2", "rl.dtype=fp32", "rollout.queries_per_step=2",
        "rollout.group_size=2", "rollout.pool_size=4",
    ]  # fmt: skip

    def verifiers(cfg):
        return {name: TaskVerifier(name, None) for name in cfg.tasks}

    report = run_study(
        "ahrl",
        str(micro_ckpt),
        tmp_path,
        verifiers,
        overrides=overrides,
        seeds=2,
        quiet=True,
        heldout_limit=6,
    )
    for run in ("start", "ahrl/seed_0", "ahrl/seed_1", "no-hints/seed_0", "no-hints/seed_1"):
        results = pd.read_csv(tmp_path / run / "heldout" / "results.csv")
        assert set(results["task"]) == {"reverse_l8"} and set(results["subnet"]) == {"full"}
        assert (results["n"] == 6).all()
    manifest = json.loads((tmp_path / "ahrl" / "seed_1" / "heldout" / "manifest.json").read_text())
    assert manifest["checkpoint"] == str(checkpoint_dirs(tmp_path / "ahrl" / "seed_1")[-1])
    text = report.read_text()
    assert "## Held-out harness scores after RL" in text and "| start (before RL) | 1 |" in text
    assert "heldout reverse_l8 exact_match" in text  # tested in Differences
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "heldout reverse_l8 exact_match" in summary["start_heldout"]


def test_a_negative_heldout_limit_is_refused(micro_ckpt, tmp_path):
    with pytest.raises(RunError, match="--heldout-limit -1"):
        run_study("ahrl", str(micro_ckpt), tmp_path, lambda cfg: {}, heldout_limit=-1)
