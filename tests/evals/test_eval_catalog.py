"""The task catalog and the random baseline model."""

from __future__ import annotations

import json

import pytest

from evals.api import EvalModel, GenerationRequest, LoglikelihoodRequest, MediaPart, RollingRequest
from evals.catalog import format_table, list_tasks
from evals.random_model import RandomModel
from evals.task import TASKS

KEYS = {"name", "version", "modality", "capability", "metrics", "available"}


def test_list_tasks_with_real_data(task_data_root):
    rows = list_tasks(task_data_root)
    assert [r["name"] for r in rows] == TASKS.names()
    assert all(set(r) == KEYS and r["available"] for r in rows)
    json.dumps(rows)
    table = format_table(rows)
    assert table.splitlines()[0].split() == [
        "name",
        "version",
        "modality",
        "capability",
        "metrics",
        "available",
    ]
    assert "arc_easy" in table and len(table.splitlines()) == len(rows) + 1


def test_list_tasks_without_data(tmp_path, monkeypatch):
    monkeypatch.delenv("ERNIE5_DATA_DIR", raising=False)
    for root in (tmp_path, None):
        rows = {r["name"]: r for r in list_tasks(root)}
        assert rows["arith_d2"]["available"] and "how_to_get" not in rows["arith_d2"]
        gsm = rows["gsm8k"]
        assert (
            not gsm["available"] and "gsm8k/test.jsonl" in gsm["how_to_get"] and "\n" not in gsm["how_to_get"]
        )
    assert "gsm8k: missing gsm8k/test.jsonl" in format_table(list_tasks(tmp_path))


def test_list_tasks_reads_the_environment(task_data_root, monkeypatch):
    monkeypatch.setenv("ERNIE5_DATA_DIR", str(task_data_root))
    assert all(r["available"] for r in list_tasks(None))


def test_random_model_is_a_deterministic_eval_model():
    model = RandomModel(seed=1)
    assert isinstance(model, EvalModel)
    ll = [LoglikelihoodRequest("Question: q\nAnswer:", " yes"), LoglikelihoodRequest("Q", " no")]
    gen = [
        GenerationRequest("Q: 1+1=\nA:", max_new_tokens=4, stop=("\n",)),
        GenerationRequest("x", max_new_tokens=1),
    ]
    roll = [RollingRequest("some text")]
    assert model.loglikelihood(ll) == RandomModel(seed=1).loglikelihood(ll)
    # batching does not matter
    assert model.loglikelihood(ll).results == [model.loglikelihood([r])[0] for r in ll]
    assert model.loglikelihood(ll) != RandomModel(seed=2).loglikelihood(ll)
    assert model.generate(gen) == RandomModel(seed=1).generate(gen)
    assert all(
        len(r.text) <= g.max_new_tokens and "\n" not in r.text for r, g in zip(model.generate(gen), gen)
    )
    (rolled,) = model.loglikelihood_rolling(roll)
    assert rolled.n_tokens == len("some text") and -4.5 * 9 <= rolled.logprob <= -0.5 * 9
    assert "seed=1" in model.fingerprint and model.fingerprint != RandomModel(seed=2).fingerprint


def test_random_model_hashes_media_parts():
    np = pytest.importorskip("numpy")
    model = RandomModel()
    image = MediaPart("image", np.zeros((4, 4), dtype=np.uint8))
    other = MediaPart("image", np.ones((4, 4), dtype=np.uint8))
    a = model.generate([GenerationRequest(("Describe:", image), max_new_tokens=8)])
    assert a == model.generate([GenerationRequest(("Describe:", image), max_new_tokens=8)])
    ll = [LoglikelihoodRequest(("x", image), " 0"), LoglikelihoodRequest(("x", other), " 0")]
    first, second = model.loglikelihood(ll)
    assert first.logprob != second.logprob
