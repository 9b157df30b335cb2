"""The ``dataset`` task option (:mod:`evals.tasks.hub`): ARC and GSM8K read through ``datasets`` from a
local mirror or a cached hub dataset, never downloading, with content fingerprints and one-line errors."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest

import evals.tasks  # noqa: F401 - registers every task
from ernie5.config import to_dict
from ernie5.data.text import DataCorrupt
from evals.task import TASKS
from evals.tasks.math_word import MathOptions

ARC_ROWS = [
    {
        "id": f"q{i}",
        "question": f"Which number is {i}?",
        "choices": {"text": [str(i), str(i + 1), str(i + 2)], "label": ["A", "B", "C"]},
        "answerKey": "ABC"[i % 3],
    }
    for i in range(4)
]
GSM8K_TEST = [
    {"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"}
    for i in range(3)
]
GSM8K_TRAIN = [{"question": "What is 10 + 1?", "answer": "10 + 1 = 11\n#### 11"}]


@pytest.fixture(autouse=True)
def _own_datasets_cache(tmp_path, monkeypatch):
    """Every test builds into its own ``datasets`` cache, so nothing leaks between tests."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _saved(folder: Path, **splits: list[dict]) -> str:
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(folder)
    return str(folder)


def _jsonl(folder: Path, **splits: list[dict]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


# Reading ---------------------------------------------------------------------------------------------


def test_arc_reads_a_save_to_disk_mirror(tmp_path):
    path = _saved(tmp_path / "mirror", test=ARC_ROWS, train=ARC_ROWS[:1])
    task = TASKS.get("arc_easy")(dataset={"path": path})
    assert task.available(None) == (True, "")
    examples = task.all_examples(None)
    assert [e.id for e in examples] == ["q0", "q1", "q2", "q3"]
    assert examples[1].prompt == "Question: Which number is 1?\nAnswer:"
    assert examples[1].choices == ("1", "2", "3") and examples[1].gold == 1
    assert task.kwargs == {"dataset": {"path": path, "name": "", "split": "", "revision": ""}}
    assert len(TASKS.get("arc_challenge")(dataset={"path": path, "split": "train"}).all_examples(None)) == 1


def test_a_jsonl_folder_is_read_and_fingerprinted_by_content(tmp_path):
    path = _jsonl(tmp_path / "mirror", test=ARC_ROWS)
    task = TASKS.get("arc_easy")(dataset={"path": path})
    assert task.available(None) == (True, "")
    before = task.fingerprint_data(None)
    assert len(before) == 64 and before == task.fingerprint_data(None)
    assert [e.target for e in task.all_examples(None)] == ["0", "2", "4", "3"]
    edited = [dict(ARC_ROWS[0], question="Which number is zero?"), *ARC_ROWS[1:]]
    _jsonl(tmp_path / "mirror", test=edited)
    assert task.fingerprint_data(None) != before
    assert task.all_examples(None)[0].prompt == "Question: Which number is zero?\nAnswer:"  # never stale


def test_a_saved_mirror_fingerprint_follows_its_rows(tmp_path):
    path = _saved(tmp_path / "a", test=ARC_ROWS)
    same = _saved(tmp_path / "b", test=ARC_ROWS)
    changed = _saved(tmp_path / "c", test=[*ARC_ROWS[:3], dict(ARC_ROWS[3], answerKey="B")])
    fp = {p: TASKS.get("arc_easy")(dataset={"path": p}).fingerprint_data(None) for p in (path, same, changed)}
    assert fp[path] != fp[changed] and len(fp[path]) == 64
    assert fp[path] != fp[same]  # the spec (its path) is part of it
    assert TASKS.get("arc_easy")(dataset={"path": path, "split": "test"}).fingerprint_data(None) == fp[path]


def test_gsm8k_reads_its_fewshot_pool_from_the_train_split(tmp_path):
    path = _saved(tmp_path / "gsm8k", test=GSM8K_TEST, train=GSM8K_TRAIN)
    task = TASKS.get("gsm8k")(num_fewshot=1, dataset={"path": path})
    assert task.available(None) == (True, "")
    examples = task.all_examples(None)
    assert [e.id for e in examples] == ["gsm8k-test-1", "gsm8k-test-2", "gsm8k-test-3"]
    assert examples[2].target == "4" and examples[2].prompt == "Question: What is 2 + 2?\nAnswer:"
    assert examples[0].fewshot == "Question: What is 10 + 1?\nAnswer: 10 + 1 = 11\n#### 11\n\n"


def test_a_single_unnamed_split_serves_the_evaluated_split_only(tmp_path):
    datasets.Dataset.from_list(GSM8K_TEST).save_to_disk(tmp_path / "one")
    zero_shot = TASKS.get("gsm8k")(num_fewshot=0, dataset={"path": str(tmp_path / "one")})
    assert zero_shot.available(None) == (True, "") and len(zero_shot.all_examples(None)) == 3
    ok, reason = TASKS.get("gsm8k")(dataset={"path": str(tmp_path / "one")}).available(None)
    assert not ok and "'train'" in reason and "DatasetDict" in reason and "\n" not in reason


def _fake_hub_cache(cache: Path, sha: str) -> None:
    """Lay out ``allenai/ai2_arc`` (ARC-Easy, test) in a ``datasets`` cache as a download at commit
    ``sha`` leaves it (``<ns>___<name>/<config>/<version>/<sha>/``: ``dataset_info.json`` and the
    split's Arrow stream)."""
    from datasets.arrow_writer import ArrowWriter

    ds = datasets.Dataset.from_list(ARC_ROWS)
    folder = cache / "allenai___ai2_arc" / "ARC-Easy" / "0.0.0" / sha
    folder.mkdir(parents=True)
    with ArrowWriter(path=str(folder / "ai2_arc-test.arrow")) as writer:
        writer.write_table(ds.data.table)
        writer.finalize()
    split = datasets.SplitInfo("test", num_examples=len(ds), dataset_name="ai2_arc")
    info = datasets.DatasetInfo(
        features=ds.features,
        config_name="ARC-Easy",
        dataset_name="ai2_arc",
        splits=datasets.SplitDict({"test": split}),
    )
    info.write_to_directory(str(folder))


def test_a_cached_hub_dataset_loads_offline_and_checks_its_revision(tmp_path):
    _fake_hub_cache(Path(datasets.config.HF_DATASETS_CACHE), "a" * 40)
    hub = {"path": "allenai/ai2_arc", "name": "ARC-Easy"}
    task = TASKS.get("arc_easy")(dataset=hub)
    assert task.available(None) == (True, "")
    assert [e.id for e in task.all_examples(None)] == ["q0", "q1", "q2", "q3"]
    assert task.fingerprint_data(None) == TASKS.get("arc_easy")(dataset=hub).fingerprint_data(None)
    assert TASKS.get("arc_easy")(dataset={**hub, "revision": "a" * 40}).available(None) == (True, "")
    ok, reason = TASKS.get("arc_easy")(dataset={**hub, "revision": "b" * 40}).available(None)
    assert not ok and "not revision bbbb" in reason
    ok, reason = TASKS.get("arc_easy")(dataset={**hub, "split": "validation"}).available(None)
    assert not ok and "validation" in reason


# Never downloading -----------------------------------------------------------------------------------


@pytest.mark.parametrize("offline_env", [True, False])
def test_an_uncached_hub_id_is_unavailable_without_touching_the_network(monkeypatch, offline_env):
    """Offline or not by the environment, nothing is downloaded: the reason says how to get it."""
    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access in a test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1" if offline_env else "0")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", offline_env)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", offline_env)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline_env)
    task = TASKS.get("gsm8k")(dataset={"path": "openai/gsm8k", "name": "main"})
    ok, reason = task.available(None)
    assert not ok and "\n" not in reason and attempts == []
    assert "openai/gsm8k (main, test) is not in the datasets cache" in reason
    assert "datasets.load_dataset('openai/gsm8k', 'main', split='test')" in reason
    assert "local folder" in reason
    assert datasets.config.HF_HUB_OFFLINE is offline_env  # the switch is put back
    assert huggingface_hub.constants.HF_HUB_OFFLINE is offline_env


def test_a_missing_local_folder_is_unavailable(tmp_path):
    ok, reason = TASKS.get("arc_easy")(dataset={"path": str(tmp_path / "nowhere")}).available(None)
    assert not ok and "not a folder" in reason and "\n" not in reason


# Errors ----------------------------------------------------------------------------------------------


def test_a_bad_row_is_a_one_line_error_naming_the_dataset_and_row(tmp_path):
    rows = [*ARC_ROWS[:2], dict(ARC_ROWS[2], answerKey="E")]
    path = _saved(tmp_path / "bad", test=rows)
    task = TASKS.get("arc_easy")(dataset={"path": path})
    with pytest.raises(DataCorrupt) as info:
        task.all_examples(None)
    assert str(info.value) == f"{path} (test):3: answerKey 'E' is not one of the labels ['A', 'B', 'C']"
    gsm = _saved(tmp_path / "gsm", test=[{"question": "q", "answer": "no marker"}])
    with pytest.raises(DataCorrupt, match=r"gsm \(test\):1: answer has no '#### <number>' line"):
        TASKS.get("gsm8k")(num_fewshot=0, dataset={"path": gsm}).all_examples(None)


def test_unreadable_files_are_corrupt_not_missing(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "test.jsonl").write_text('{"id": "q0", "question": \n')
    task = TASKS.get("arc_easy")(dataset={"path": str(tmp_path / "broken")})
    assert task.available(None) == (True, "")  # evaluating it is an error, not a skip
    with pytest.raises(DataCorrupt) as info:
        task.all_examples(None)
    assert "broken (test): the files do not load" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "kwargs", "needle"),
    [
        ("arc_easy", {"dataset": {"path": "x", "subset": "y"}}, "unknown key 'subset'"),
        ("gsm8k", {"dataset": {"path": "x", "revison": "y"}}, "unknown key 'revison'"),
        ("arc_easy", {"dataset": {"name": "ARC-Easy"}}, "with a path"),
        ("arc_easy", {"dataset": "allenai/ai2_arc"}, "with a path"),
        ("arc_easy", {"dataset": {"path": "x", "split": "test[:10]"}}, "no slicing"),
        ("arc_easy", {"dataset": {"path": "x", "revision": "main"}}, "commit sha"),
        ("arc_easy", {"dataset": {"path": ""}}, "non-empty"),
        ("arc_easy", {"num_fewshot": 1}, "takes no options other than dataset"),
        ("gsm8k", {"dataset": {"path": "x", "split": "train"}}, "few-shot pool"),
    ],
)
def test_bad_dataset_options_are_one_line_errors(name, kwargs, needle):
    with pytest.raises(ValueError) as info:
        TASKS.get(name)(**kwargs)
    message = str(info.value)
    assert needle in message and name in message and "\n" not in message


# Fingerprints and sweeps -----------------------------------------------------------------------------


def test_without_the_option_kwargs_and_unit_fingerprints_are_unchanged(tmp_path):
    from ernie5.subnets.spec import resolve
    from evals.adapter import ADAPTER_VERSION
    from evals.suite import load_suite
    from evals.sweep import _hash, plan_units, subnet_identity
    from tests.conftest import tiny_config

    assert TASKS.get("arc_easy")().kwargs == {}  # ARC took no options before
    assert TASKS.get("arc_challenge")().kwargs == {}
    assert TASKS.get("gsm8k")().kwargs == to_dict(MathOptions())
    assert TASKS.get("gsm8k")(dataset=None, num_fewshot=3).kwargs == to_dict(MathOptions(num_fewshot=3))
    suite = tmp_path / "suite.yaml"
    suite.write_text("name: s\ntasks: [{task: arc_easy, limit: 2}, {task: gsm8k, limit: 2}]\n")
    sub = resolve("full", tiny_config())
    plans = plan_units(load_suite(suite), "ckpt", [sub], tmp_path, None)  # no data: both unavailable
    old_kwargs = {"arc_easy": {}, "gsm8k": to_dict(MathOptions())}
    for plan in plans:
        old = {
            "checkpoint": "ckpt",
            "subnet": subnet_identity(sub),
            "task": plan.task.name,
            "version": plan.task.version,
            "kwargs": old_kwargs[plan.task.name],
            "data": "",
            "available": False,
            "limit": 2,
            "seed": 0,
            "batch_size": load_suite(suite).cfg.batch_size,
            "adapter": ADAPTER_VERSION,
        }
        assert plan.fingerprint == _hash(old)


def test_a_sweep_unit_reads_the_mirror_and_reruns_when_it_changes(micro_ckpt, tmp_path):
    from evals.results import read_unit, unit_path
    from evals.sweep import run_sweep

    mirror = _jsonl(tmp_path / "mirror", test=ARC_ROWS)
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        "name: mirror\nbatch_size: 8\n"
        f"tasks:\n  - {{task: arc_easy, limit: 3, kwargs: {{dataset: {{path: {mirror}, split: test}}}}}}\n"
        "subnets: {specs: [full]}\nefficiency: {enabled: false}\n"
    )
    out, no_root = tmp_path / "run", tmp_path / "no-data"
    no_root.mkdir()
    first = run_sweep(micro_ckpt, suite, out, data_dir=no_root, quiet=True)
    unit = read_unit(unit_path(out, "full", "arc_easy"))
    assert first.computed == 1 and unit["status"] == "ok" and unit["n_examples"] == 3
    assert unit["kwargs"]["dataset"]["path"] == mirror
    assert run_sweep(micro_ckpt, suite, out, data_dir=no_root, quiet=True).reused == 1
    _jsonl(tmp_path / "mirror", test=[dict(r, question=r["question"] + " ") for r in ARC_ROWS])
    assert run_sweep(micro_ckpt, suite, out, data_dir=no_root, quiet=True).computed == 1
