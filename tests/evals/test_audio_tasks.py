"""FSDD audio tasks: the seen speakers' test split and the held-out (unseen) speaker, scored apart."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

import evals.tasks  # noqa: F401  (registers the tasks)
from ernie5.data.audio import (
    DIGIT_WORDS,
    FSDD_TRAIN_SPEAKERS,
    FSDD_UNSEEN_SPEAKER,
    fsdd_files,
    fsdd_utterances,
)
from evals.api import Answers, GenerationResult
from evals.random_model import RandomModel
from evals.task import TASKS
from evals.tasks.audio_items import UNSEEN_PER_DIGIT, unseen_eval_files, unseen_eval_indices

GROUPED = ("asr_fsdd", "spoken_digit_qa")


@pytest.fixture(scope="module")
def fsdd_root(data_root) -> Path:
    if not (data_root / "fsdd" / "recordings").is_dir():
        pytest.skip(f"no FSDD under {data_root}")
    return data_root


@pytest.fixture(scope="module")
def training_uids(fsdd_root) -> set[str]:
    return {u.uid for u in fsdd_utterances(fsdd_root, "train")}


def test_unseen_subset_is_fixed_balanced_and_in_the_data_hint():
    for d in range(10):
        idx = unseen_eval_indices(d)
        assert idx == unseen_eval_indices(d) == sorted(set(idx)) and len(idx) == UNSEEN_PER_DIGIT
        assert all(0 <= i < 50 for i in idx)
    files = unseen_eval_files()
    assert len(files) == 250 and all(f"_{FSDD_UNSEEN_SPEAKER}_" in f for f in files)
    for name in GROUPED:
        cls = TASKS.get(name)
        assert cls.version >= 2 and cls.splits == ("test", "unseen")
        assert set(files) <= set(cls.data_files)
        seen_files = [f for f in cls.data_files if f not in files]
        assert len(seen_files) == 200 and not any(f"_{FSDD_UNSEEN_SPEAKER}_" in f for f in seen_files)


@pytest.mark.parametrize("name", GROUPED)
def test_metrics_are_seen_first_then_unseen(name):
    metrics = list(TASKS.get(name).metrics)
    base = {"asr_fsdd": ["wer", "cer", "exact_match"], "spoken_digit_qa": ["acc"]}[name]
    assert metrics == base + [m + "_unseen" for m in base]
    declared = TASKS.get(name).metrics
    assert all(declared[m + "_unseen"] is declared[m] for m in base)


@pytest.mark.parametrize("name", GROUPED)
def test_unseen_examples_are_exactly_the_held_out_speaker_and_never_trained_on(
    name, fsdd_root, training_uids
):
    examples = TASKS.get(name)().all_examples(fsdd_root)
    groups = Counter(e.info["group"] for e in examples)
    assert set(groups) == {"seen", "unseen"} and groups["unseen"] >= 200
    for e in examples:
        if e.info["group"] == "unseen":
            assert e.info["speaker"] == FSDD_UNSEEN_SPEAKER
        else:
            assert e.info["speaker"] in FSDD_TRAIN_SPEAKERS
    if name == "spoken_digit_qa":  # single recordings: the ids are the recordings' uids
        unseen = {e.id for e in examples if e.info["group"] == "unseen"}
        assert unseen == {"fsdd/" + Path(f).stem for f in unseen_eval_files()}
        assert Counter(e.target for e in examples if e.info["group"] == "unseen") == {
            w: UNSEEN_PER_DIGIT for w in DIGIT_WORDS
        }
        assert not {e.id for e in examples} & training_uids
        assert groups["seen"] == 200
    else:
        assert groups["seen"] == groups["unseen"] == 200
        assert all(e.id.startswith("asr_fsdd-unseen-") == (e.info["group"] == "unseen") for e in examples)
    # the held-out speaker is nowhere in training (every training source reads the `train` split)
    assert not any(f"_{FSDD_UNSEEN_SPEAKER}_" in uid for uid in training_uids)
    assert {p.name for *_, p in fsdd_files(fsdd_root, "unseen")} >= {
        Path(f).name for f in unseen_eval_files()
    }


@pytest.mark.parametrize("name", GROUPED)
def test_a_limit_draws_both_groups_as_prefixes(name, fsdd_root):
    task = TASKS.get(name)()
    ten = task.examples(fsdd_root, limit=10, seed=0)
    assert [e.info["group"] for e in ten] == ["seen", "unseen"] * 5
    assert task.examples(fsdd_root, limit=4, seed=0) == ten[:4]
    assert task.examples(fsdd_root, limit=10, seed=1) != ten


@pytest.mark.parametrize("name", GROUPED)
def test_evaluate_reports_seen_and_unseen_with_their_n(name, fsdd_root, tmp_path):
    task = TASKS.get(name)()
    result = task.evaluate(RandomModel(seed=1), data_dir=fsdd_root, limit=9, seed=0, work_dir=tmp_path)
    assert list(result.metrics) == list(task.metrics)
    for metric, m in result.metrics.items():
        assert m["n"] == (4 if metric.endswith("_unseen") else 5)
        assert math.isfinite(m["value"]) and m["stderr"] >= 0
    for s in result.samples:
        group = s["sample"]["group"]
        assert all(k.endswith("_unseen") == (group == "unseen") for k in s["scores"])
        assert set(s["scores"]) == set(s["sample"]["scores"]) and s["scores"]
        assert (s["sample"]["speaker"] == FSDD_UNSEEN_SPEAKER) == (group == "unseen")
    json.dumps(result.samples, allow_nan=False)
    # one example: the other group has no value (and n 0) rather than a made-up one
    one = task.evaluate(RandomModel(seed=1), data_dir=fsdd_root, limit=1, seed=0, work_dir=tmp_path)
    assert all(
        (m["value"] is None and m["n"] == 0) if k.endswith("_unseen") else m["n"] == 1
        for k, m in one.metrics.items()
    )


class _Oracle:
    """Transcribes the seen speakers perfectly and says nothing for the unseen one."""

    def __init__(self, examples) -> None:
        self.by_wave = {e.wave.tobytes(): e for e in examples}

    def generate(self, requests):
        out = []
        for r in requests:
            e = self.by_wave[r.context[0].data.tobytes()]
            out.append(GenerationResult("" if e.info["group"] == "unseen" else e.target, 1))
        return Answers(out)


def test_asr_wer_is_over_the_seen_speakers_and_wer_unseen_over_the_unseen_one(fsdd_root, tmp_path):
    task = TASKS.get("asr_fsdd")(n_examples=6)
    model = _Oracle(task.all_examples(fsdd_root))
    result = task.evaluate(model, data_dir=fsdd_root, limit=None, seed=0, work_dir=tmp_path)
    m = {k: v["value"] for k, v in result.metrics.items()}
    assert (m["wer"], m["exact_match"]) == (0.0, 1.0)
    assert (m["wer_unseen"], m["cer_unseen"], m["exact_match_unseen"]) == (1.0, 1.0, 0.0)
    assert result.metrics["wer"]["n"] == result.metrics["wer_unseen"]["n"] == 6


def test_speaker_id_is_over_the_seen_speakers_only(fsdd_root):
    task = TASKS.get("speaker_id")()
    examples = task.all_examples(fsdd_root)
    assert len(examples) == 200 and task.version >= 2
    assert all(e.choices == FSDD_TRAIN_SPEAKERS and FSDD_UNSEEN_SPEAKER not in e.choices for e in examples)
    assert {e.target for e in examples} == set(FSDD_TRAIN_SPEAKERS)
    assert not any(FSDD_UNSEEN_SPEAKER in e.id for e in examples)
    assert not any(f"_{FSDD_UNSEEN_SPEAKER}_" in f for f in task.data_files)


def test_tts_digits_asks_for_seen_speakers_only(monkeypatch):
    task = TASKS.get("tts_digits")(n_examples=12)
    monkeypatch.setattr(task, "_load_judge", lambda data_dir: None)  # no recogniser needed for the prompts
    speakers = {e.info["speaker"] for e in task.all_examples(None)}
    assert speakers == set(FSDD_TRAIN_SPEAKERS)
    assert not any(f"_{FSDD_UNSEEN_SPEAKER}_" in f for f in task.data_files)
