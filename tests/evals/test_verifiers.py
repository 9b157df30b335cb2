"""RL verifiers: training queries in the harness's prompt format, never an evaluated item, rewarded by
the task's own scorer."""

from __future__ import annotations

import numpy as np
import pytest

import evals.tasks  # noqa: F401
from evals import hints
from evals.answers import match_choice
from evals.api import GenerationResult, MediaResult
from evals.task import TASKS
from evals.verifiers import TaskVerifier, VerifierError


@pytest.mark.parametrize(
    "name", ["arith_d2", "reverse_l8", "sort_l4", "shapes_vqa_attr", "shapes_vqa_rel", "video_shapes"]
)
def test_procedural_queries_are_deterministic_and_never_evaluated(name):
    v = TaskVerifier(name)
    evaluated = {TaskVerifier._key(ex) for ex in TASKS.get(name)().all_examples(None)}
    queries = [v.query(i, seed=0) for i in range(300)]
    assert all(TaskVerifier._key(q.example) not in evaluated for q in queries)
    again = v.query(7, seed=0)
    assert (
        again.context == queries[7].context if isinstance(again.context, str) else again.id == queries[7].id
    )
    assert v.query(7, seed=1).example.prompt != queries[7].example.prompt or name.startswith("shapes")


def test_generation_reward_is_the_tasks_own_score():
    v = TaskVerifier("arith_d2")
    task = v.task
    for i in range(20):
        q = v.query(i, seed=0)
        assert q.context == q.example.prompt and q.stop == ("\n",)
        for text in (q.reference, " 0", q.reference + " ", " " + q.reference.strip() + "."):
            want = task.score(q.example, [GenerationResult(text, 1)])["exact_match"]
            assert v.reward(q, text) == want
        assert v.reward(q, q.reference) == 1.0


def test_multiple_choice_reward_parses_the_answer_against_the_gold_choice():
    v = TaskVerifier("shapes_vqa_attr")
    q = v.query(0, seed=0)
    image, question = q.context
    assert image.modality == "image" and question.endswith("Answer:")
    gold = q.example.choices[q.example.gold]
    assert v.reward(q, " " + gold) == 1.0
    assert v.reward(q, f" {gold.upper()}.\nQuestion: more") == 1.0
    other = next(c for c in q.example.choices if c != gold)
    assert v.reward(q, " " + other) == 0.0 and v.reward(q, " something else") == 0.0


def test_t2i_shapes_queries_ask_for_images_never_evaluated_and_the_judge_is_the_reward():
    v = TaskVerifier("t2i_shapes")
    task = TASKS.get("t2i_shapes")(n_examples=5000)
    evaluated = {ex.prompt for ex in task.all_examples(None)}
    queries = [v.query(i, seed=0) for i in range(300)]
    assert all(q.context not in evaluated and q.output == "image" for q in queries)
    assert all(
        q.context == f"Draw: {q.example.target}." and q.cfg_scale == task.options.cfg_scale for q in queries
    )
    assert v.query(7, seed=0).context == queries[7].context
    from ernie5.data import shapes

    for q in queries[:20]:
        scene = q.example.info["scene"]
        drawn = shapes.render(scene, 32)[None]
        assert v.reward(q, drawn) == 1.0  # the scene it was asked for
        wrong = shapes.render(shapes.Scene(scene.shapes[:1]), 32)[None]  # a shape missing
        scores = v.task.score(q.example, [MediaResult(wrong)])
        assert v.reward(q, wrong) == pytest.approx(sum(scores.values()) / 4)
        assert v.reward(q, wrong) < 1.0
        assert v.reward(q, np.zeros_like(drawn)) == pytest.approx(0.0)


def test_match_choice():
    assert match_choice(" Red.", ("blue", "red")) == 1
    assert match_choice(" red square", ("red", "square")) == -1
    assert match_choice("", ("red",)) == -1


def test_data_tasks_read_train_splits(data_root):
    babi = TaskVerifier("babi_qa1", data_root)
    q = babi.query(0, seed=0)
    assert q.context.startswith(q.example.fewshot) and q.context.endswith("Answer:")
    assert babi.reward(q, q.reference) == 1.0
    gsm = TaskVerifier("gsm8k", data_root)
    q = gsm.query(0, seed=0)
    assert "####" in q.reference and gsm.reward(q, q.reference) == 1.0
    digits = TaskVerifier("digit_vqa", data_root)
    q = digits.query(0, seed=0)
    assert digits.reward(q, q.reference) == 1.0
    clips = TaskVerifier("video_digits", data_root)
    q = clips.query(1, seed=0)
    clip, question = q.context
    assert clip.modality == "video" and clip.data.ndim == 4 and question.endswith("Answer:")
    assert clips.reward(q, q.reference) == 1.0
    asr = TaskVerifier("asr_fsdd", data_root)
    q = asr.query(0, seed=0)
    wave, prefix = q.context
    assert wave.modality == "audio" and prefix == "Transcript:" and q.example.info["group"] == "seen"
    words = q.reference.split()
    assert asr.reward(q, q.reference) == 1.0 and asr.reward(q, "") == 0.0
    assert asr.reward(q, " " + " ".join(words[:-1])) == pytest.approx(1 - 1 / len(words))  # 1 - WER


def test_unsupported_and_unknown_tasks_are_one_line_errors():
    with pytest.raises(VerifierError, match="not a registered task"):
        TaskVerifier("no_such_task")
    with pytest.raises(VerifierError, match="has no verifier"):
        TaskVerifier("t2v_shapes")
    with pytest.raises(VerifierError, match="t2i_digits' has no verifier: its ten prompts"):
        TaskVerifier("t2i_digits")


@pytest.mark.parametrize(
    "name", ["arith_d2", "arith_d3", "reverse_l8", "sort_l4", "copy_l8", "shapes_vqa_attr"]
)
def test_skeletons_are_partial_reasoning_never_the_answer(name):
    """AHRL's hints: every query of these tasks has steps, and no prefix of them gives the answer away
    (a prefix of the answer was the hint before; for one-word answers it was empty)."""
    v = TaskVerifier(name)
    with_steps = 0
    for i in range(200):
        q = v.query(i, seed=0)
        hints.check_not_answer(q.skeleton, q.example.target)
        for k in range(1, len(q.skeleton.steps) + 1):
            hint = q.skeleton.text(k)
            assert not hint.strip(" [").startswith(q.example.target.strip()) and "\n" not in hint
        with_steps += bool(q.skeleton.steps)
    assert with_steps >= (150 if name == "shapes_vqa_attr" else 195), with_steps


def test_data_task_skeletons(data_root):
    gsm = TaskVerifier("gsm8k", data_root)
    q = gsm.query(0, seed=0)
    solution = q.reference.rpartition("####")[0].strip().splitlines()
    assert list(q.skeleton.steps) == [line.strip() for line in solution[:-1]]  # all but the last line
    assert "####" not in q.skeleton.text(99) and q.skeleton.text(99).endswith("\n")
    svamp = TaskVerifier("svamp", data_root)
    for i in range(30):
        q = svamp.query(i, seed=0)
        assert q.skeleton.steps and q.skeleton.steps[0].startswith("the numbers: ")
        hints.check_not_answer(q.skeleton, q.example.target)
    babi = TaskVerifier("babi_qa1", data_root)
    q = babi.query(0, seed=0)
    assert q.skeleton.steps[0].startswith("the question is about ")
    assert q.example.target not in q.skeleton.text(9)


def test_skeleton_steps_by_family():
    assert hints.procedural("Q: 623+597=\nA:").steps == (
        "3+7=10, write 0 carry 1",
        "2+9+1=12, write 2 carry 1",
    )
    assert hints.procedural("Q: 84-37=\nA:").steps == ("14-7=7, borrow 1",)
    assert hints.procedural("Q: 42*78=\nA:").steps == ("42*8=336", "42*70=2940")
    assert hints.procedural("Q: reverse oqib\nA:").steps[1] == "halves oq and ib"
    assert hints.svamp("( ( 3.0 + 4.0 ) * 2.0 )").steps == ("the numbers: 3, 4, 2", "3 + 4 = 7")
    assert hints.svamp("( 76.0 - 25.0 )").steps == ("the numbers: 76, 25",)
    assert hints.svamp("not an equation (").steps == ()
    sorted_input = hints.procedural("Q: sort 1 11\nA:")
    assert hints.safe(sorted_input, " 1 11").steps == ("2 numbers", "the largest is 11")  # buckets spell it
    assert hints.Skeleton(("a", "b")).text(1) == " [a]" and hints.Skeleton(("a",)).text(0) == ""
