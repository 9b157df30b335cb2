"""RL verifiers: training queries in the harness's prompt format, never an evaluated item, rewarded by
the task's own scorer."""

from __future__ import annotations

import numpy as np
import pytest

import evals.tasks  # noqa: F401
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
        for text in (q.hint, " 0", q.hint + " ", " " + q.hint.strip() + "."):
            want = task.score(q.example, [GenerationResult(text, 1)])["exact_match"]
            assert v.reward(q, text) == want
        assert v.reward(q, q.hint) == 1.0


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
    assert babi.reward(q, q.hint) == 1.0
    gsm = TaskVerifier("gsm8k", data_root)
    q = gsm.query(0, seed=0)
    assert "####" in q.hint and gsm.reward(q, q.hint) == 1.0
    digits = TaskVerifier("digit_vqa", data_root)
    q = digits.query(0, seed=0)
    assert digits.reward(q, q.hint) == 1.0
    clips = TaskVerifier("video_digits", data_root)
    q = clips.query(1, seed=0)
    clip, question = q.context
    assert clip.modality == "video" and clip.data.ndim == 4 and question.endswith("Answer:")
    assert clips.reward(q, q.hint) == 1.0
    asr = TaskVerifier("asr_fsdd", data_root)
    q = asr.query(0, seed=0)
    wave, prefix = q.context
    assert wave.modality == "audio" and prefix == "Transcript:" and q.example.info["group"] == "seen"
    words = q.hint.split()
    assert asr.reward(q, q.hint) == 1.0 and asr.reward(q, "") == 0.0
    assert asr.reward(q, " " + " ".join(words[:-1])) == pytest.approx(1 - 1 / len(words))  # 1 - WER


def test_unsupported_and_unknown_tasks_are_one_line_errors():
    with pytest.raises(VerifierError, match="not a registered task"):
        TaskVerifier("no_such_task")
    with pytest.raises(VerifierError, match="has no verifier"):
        TaskVerifier("t2v_shapes")
    with pytest.raises(VerifierError, match="t2i_digits' has no verifier: its ten prompts"):
        TaskVerifier("t2i_digits")
