"""Contract tests over every registered task, then task-specific behaviour."""

from __future__ import annotations

import json
import math
import typing

import pytest

import evals.tasks  # noqa: F401  (registers every task)
from ernie5.data.root import DataMissing
from evals.api import (
    KIND_OF,
    GenerationRequest,
    GenerationResult,
    LoglikelihoodRequest,
    LoglikelihoodResult,
    MediaGenerationRequest,
    MediaPart,
    ReconstructionRequest,
    RefineRequest,
    RollingRequest,
    RollingResult,
    SpeechGenerationRequest,
)
from evals.random_model import RandomModel
from evals.task import TASKS, Capability, Example, Modality, Task

ALL_TASKS = TASKS.names()
REQUEST_TYPES = (
    LoglikelihoodRequest,
    RollingRequest,
    GenerationRequest,
    MediaGenerationRequest,
    ReconstructionRequest,
    RefineRequest,
    SpeechGenerationRequest,
)


def _is_procedural(cls: type[Task]) -> bool:
    return not cls.data_files


def _root_for(cls: type[Task], data_root_request: pytest.FixtureRequest):
    return None if _is_procedural(cls) else data_root_request.getfixturevalue("task_data_root")


def _answer(model: RandomModel, requests: list) -> list:
    return getattr(model, KIND_OF[type(requests[0])].method)(requests).results


def test_registry_has_the_promised_tasks():
    expected = {
        "shakespeare_bpb",
        "arc_easy",
        "arc_challenge",
        "openbookqa",
        "gsm8k",
        "svamp",
        "babi_qa1",
        "bbh_boolean_expressions",
        "bbh_date_understanding",
        "bbh_sports_understanding",
        "bbh_object_counting",
        "bbh_web_of_lies",
        "arith",
        "arith_d2",
        "arith_d4",
        "copy_reverse",
        "reverse_l8",
        "sort",
    }
    assert expected <= set(ALL_TASKS)


def test_a_metric_points_the_same_way_in_every_task():
    """Direction is declared once per task (``Task.metrics``) and travels with the results; a metric
    name means one direction everywhere, so reports and comparisons across tasks agree."""
    seen: dict[str, tuple[bool, str]] = {}
    for name in ALL_TASKS:
        for metric, higher in TASKS.get(name).metrics.items():
            first = seen.setdefault(metric, (higher, name))
            assert first[0] is higher, f"{metric}: higher={higher} in {name}, {first[0]} in {first[1]}"
        for metric, higher in TASKS.get(name).metrics.items():
            if metric.endswith("_unseen"):
                assert TASKS.get(name).metrics[metric.removesuffix("_unseen")] is higher, (name, metric)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_metadata(name):
    cls = TASKS.get(name)
    assert cls.name == name
    assert cls.__doc__ and cls.__doc__.strip()
    assert isinstance(cls.version, int) and cls.version >= 1
    assert cls.modality in typing.get_args(Modality)
    assert cls.capability in typing.get_args(Capability)
    assert cls.metrics and all(isinstance(v, bool) for v in cls.metrics.values())
    assert cls.splits and all(isinstance(s, str) for s in cls.splits)
    assert isinstance(cls.data_files, tuple)
    assert all(not f.startswith("/") and ".." not in f for f in cls.data_files)
    assert cls.how_to_get and "\n" not in cls.how_to_get
    task = cls()
    json.dumps(task.kwargs)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_available_with_real_data(name, request):
    cls = TASKS.get(name)
    ok, reason = cls().available(_root_for(cls, request))
    assert ok, reason
    assert reason == ""


@pytest.mark.parametrize("name", ALL_TASKS)
def test_unavailable_in_an_empty_root(name, tmp_path):
    cls = TASKS.get(name)
    for root in (tmp_path, None):
        ok, reason = cls().available(root)
        if _is_procedural(cls):
            assert ok and reason == ""
        else:
            assert not ok
            assert "\n" not in reason and cls.data_files[0] in reason
    if not _is_procedural(cls):
        with pytest.raises(DataMissing):
            cls().examples(tmp_path, limit=2, seed=0)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_examples_are_deterministic_subsamples(name, request):
    cls = TASKS.get(name)
    task, root = cls(), _root_for(cls, request)
    first = task.examples(root, limit=5, seed=0)
    assert len(first) == 5
    assert all(isinstance(e, Example) for e in first)
    assert first == task.examples(root, limit=5, seed=0)
    assert first[:3] == task.examples(root, limit=3, seed=0)
    ids = [e.id for e in first]
    assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids)
    assert [e.id for e in task.examples(root, limit=5, seed=1)] != ids
    assert task.examples(root, limit=0, seed=0) == []


@pytest.mark.parametrize("name", ALL_TASKS)
def test_ids_are_unique_over_the_whole_split(name, request):
    cls = TASKS.get(name)
    ids = [e.id for e in cls().all_examples(_root_for(cls, request))]
    assert ids and len(set(ids)) == len(ids)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_requests_are_valid(name, request):
    cls = TASKS.get(name)
    task = cls()
    for example in task.examples(_root_for(cls, request), limit=5, seed=0):
        reqs = task.requests(example)
        assert reqs and all(isinstance(r, REQUEST_TYPES) for r in reqs)
        assert len({type(r) for r in reqs}) == 1
        for r in reqs:
            if isinstance(r, GenerationRequest):
                assert r.max_new_tokens > 0 and r.context and all(r.stop)
            elif isinstance(r, LoglikelihoodRequest):
                assert r.context and r.continuation.startswith(" ")
            elif isinstance(r, MediaGenerationRequest):
                assert r.prompt and r.n_frames >= 1
            elif isinstance(r, SpeechGenerationRequest):
                assert r.prompt and r.max_frames >= 1
            elif isinstance(r, ReconstructionRequest | RefineRequest):
                assert isinstance(r.media, MediaPart)
                want = "float32" if r.media.modality == "audio" else "uint8"
                assert r.media.data.dtype.name == want
            else:
                assert r.text
        if example.choices:
            assert len(reqs) == len(example.choices) and 0 <= example.gold < len(example.choices)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_random_model_end_to_end(name, request):
    cls = TASKS.get(name)
    task, model = cls(), RandomModel(seed=3)
    scored = []
    for example in task.examples(_root_for(cls, request), limit=5, seed=0):
        responses = _answer(model, task.requests(example))
        assert responses == _answer(model, task.requests(example))
        scores = task.score(example, responses)
        assert set(scores) == set(cls.metrics)
        json.dumps(task.describe_sample(example, responses, scores), allow_nan=False)
        scored.append(scores)
    for metric in cls.metrics:
        value, stderr = task.aggregate(metric, [s[metric] for s in scored])
        assert math.isfinite(value) and math.isfinite(stderr) and stderr >= 0


@pytest.mark.parametrize("name", ALL_TASKS)
def test_a_perfect_answer_gets_full_marks(name, request):
    cls = TASKS.get(name)
    if cls.capability != "understanding":
        pytest.skip("no single right answer")
    task = cls()
    for example in task.examples(_root_for(cls, request), limit=5, seed=0):
        reqs = task.requests(example)
        if isinstance(reqs[0], GenerationRequest):
            responses = [GenerationResult(example.target, len(example.target))]
        else:
            responses = [
                LoglikelihoodResult(0.0 if i == example.gold else -50.0, i == example.gold, 1)
                for i in range(len(reqs))
            ]
        for metric, v in task.score(example, responses).items():
            if v is None:  # a metric of the other speaker group (asr_fsdd, spoken_digit_qa)
                continue
            if isinstance(v, tuple):  # corpus error components (edits, reference units)
                assert v[0] == 0 and v[1] > 0, (example.id, metric)
            else:
                assert v == (1.0 if cls.metrics[metric] else 0.0), (example.id, metric)


@pytest.mark.parametrize("name", ALL_TASKS)
def test_fingerprint_data(name, request, tmp_path):
    cls = TASKS.get(name)
    task = cls()
    if _is_procedural(cls):
        assert task.fingerprint_data(None) == ""
        return
    root = request.getfixturevalue("task_data_root")
    digest = task.fingerprint_data(root)
    assert len(digest) == 64 and digest == task.fingerprint_data(root)
    with pytest.raises(DataMissing):
        task.fingerprint_data(tmp_path)


# Options -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kwargs", "needle"),
    [
        ("gsm8k", {"num_fewshot": -1}, "num_fewshot=-1"),
        ("gsm8k", {"num_fewshots": 3}, "valid keys"),
        ("gsm8k", {"num_fewshot": "5"}, "not an int"),
        ("arith", {"difficulty": 99}, "difficulty=99"),
        ("arith_d2", {"difficulty": 3}, "fixed"),
        ("reverse_l8", {"op": "copy"}, "fixed"),
        ("bbh_web_of_lies", {"num_fewshot": 4}, "num_fewshot=4"),
        ("arc_easy", {"num_fewshot": 1}, "takes no options"),
    ],
)
def test_bad_options_give_one_line_errors(name, kwargs, needle):
    with pytest.raises(ValueError) as info:
        TASKS.get(name)(**kwargs)
    message = str(info.value)
    assert name in message and needle in message and "\n" not in message


def test_variants_pin_their_options():
    assert TASKS.get("arith_d4")().kwargs["difficulty"] == 4
    assert TASKS.get("reverse_l16")().kwargs == {"difficulty": 16, "op": "reverse", "n_examples": 500}
    arith = TASKS.get("arith")(difficulty=2)
    assert arith.examples(None, limit=4, seed=7) == TASKS.get("arith_d2")().examples(None, limit=4, seed=7)


# Task-specific behaviour -----------------------------------------------------------------------------


def test_multiple_choice_acc_norm_uses_choice_bytes():
    task = TASKS.get("arc_easy")()
    example = Example(
        id="x", prompt="Question: q\nAnswer:", target="bbbbbbbb", choices=("a", "bbbbbbbb"), gold=1
    )
    responses = [LoglikelihoodResult(-2.0, False, 1), LoglikelihoodResult(-8.0, False, 8)]
    assert task.score(example, responses) == {"acc": 0.0, "acc_norm": 1.0}
    assert [r.continuation for r in task.requests(example)] == [" a", " bbbbbbbb"]


def test_shakespeare_documents_cover_the_heldout_tail(data_root):
    from ernie5.data.text import read_shakespeare, shakespeare_split

    task = TASKS.get("shakespeare_bpb")()
    docs = task.all_examples(data_root)
    _, heldout = shakespeare_split(read_shakespeare(data_root))
    assert "".join(d.prompt for d in docs) == heldout
    assert all(len(d.prompt) <= 2048 for d in docs) and len(docs) > 50
    n_bytes = [len(d.prompt.encode()) for d in docs[:4]]
    scores = [
        task.score(d, [RollingResult(-math.log(2) * 2 * n, n)])["bits_per_byte"]
        for d, n in zip(docs[:4], n_bytes)
    ]
    value, stderr = task.aggregate("bits_per_byte", scores)
    assert value == pytest.approx(2.0) and stderr == pytest.approx(0.0, abs=1e-9)


def test_bbh_reserves_its_fewshot_pool(data_root):
    with_shots = TASKS.get("bbh_boolean_expressions")()
    without = TASKS.get("bbh_boolean_expressions")(num_fewshot=0)
    shots = with_shots.all_examples(data_root)
    plain = without.all_examples(data_root)
    assert len(shots) == len(plain) == 247
    assert [e.id for e in shots] == [e.id for e in plain]
    assert shots[0].fewshot.count("Q: ") == 3 and plain[0].fewshot == ""
    assert not any(
        e.id in {"boolean_expressions-0", "boolean_expressions-1", "boolean_expressions-2"} for e in shots
    )


def test_gsm8k_fewshot_is_clean_and_seed_independent(data_root):
    task = TASKS.get("gsm8k")(num_fewshot=2)
    a, b = task.examples(data_root, limit=3, seed=0), task.examples(data_root, limit=3, seed=1)
    assert a[0].fewshot == b[0].fewshot
    assert (
        a[0].fewshot.count("Question:") == 2 and a[0].fewshot.count("####") == 2 and "<<" not in a[0].fewshot
    )
    assert a[0].context.endswith("\nAnswer:") and a[0].context.startswith("Question:")


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (" Janet makes 9 * 2 = 18 dollars.\n#### 18", 1.0),
        (" The answer is $18.00.", 1.0),
        (" 17", 0.0),
        ("", 0.0),
    ],
)
def test_gsm8k_scores_the_final_number(output, expected):
    task = TASKS.get("gsm8k")()
    example = Example(id="g", prompt="Question: q\nAnswer:", target="18")
    assert task.score(example, [GenerationResult(output, 1)]) == {"exact_match": expected}


def test_babi_prompt_shape(data_root):
    (example,) = TASKS.get("babi_qa1")(num_fewshot=0).examples(data_root, limit=1, seed=0)
    assert example.prompt.endswith("?\nAnswer:") and "Question: Where is" in example.prompt
    assert example.target.isalpha()
