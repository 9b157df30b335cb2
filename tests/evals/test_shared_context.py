"""Context-shared scoring (evals.shared_context) against a naive per-request forward.

The naive reference packs each request's whole document (its context, then its continuation) alone in
one row and sums the continuation's log-probs from one forward without a cache: how the adapter scored
every request before contexts were shared. Every task family that asks for log-likelihoods is checked:
text multiple choice with one-token and multi-token choices (and contexts cut to the window), images,
clips and utterances.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import evals.tasks  # noqa: F401  (registers the tasks)
from ernie5.model.kv_cache import KVCache
from ernie5.sequence.context import media_segments
from ernie5.sequence.segments import pack, text_segment
from ernie5.store.checkpoint import load_checkpoint, save_checkpoint
from evals.adapter import Ernie5EvalModel
from evals.api import LoglikelihoodRequest, MediaPart
from evals.shared_context import Choice, group_by_context
from evals.task import TASKS
from tests.conftest import micro_multimodal_parts

ATOL = 2e-4
"""Summed log-probs over a few tokens in fp32; the two differ only in reduction order."""


@pytest.fixture(scope="module")
def mm_ckpt(tmp_path_factory) -> Path:
    model, tok, vtok, codec = micro_multimodal_parts()
    path = tmp_path_factory.mktemp("shared") / "ckpt"
    save_checkpoint(path, model, tokenizer=tok, vision_tokenizer=vtok, audio_codec=codec)
    return path


@pytest.fixture(scope="module")
def eval_model(mm_ckpt) -> Ernie5EvalModel:
    return Ernie5EvalModel(load_checkpoint(mm_ckpt), batch_size=3)


def naive(m: Ernie5EvalModel, requests: list[LoglikelihoodRequest]) -> list[tuple[float, bool, int]]:
    """Each request alone: its media encoded on its own, its whole document in one row, one forward,
    no cache."""
    encoded = {
        id(p.data): media_segments(p, **m._media_models())
        for r in requests
        if not isinstance(r.context, str)
        for p in r.context
        if isinstance(p, MediaPart)
    }
    out = []
    for i, r in enumerate(requests):
        c = m._choice(i, r, encoded)
        n = len(c.cont)
        if n == 0:
            out.append((0.0, True, 0))
            continue
        doc = [*c.context, text_segment(c.cont)]
        length = sum(len(s) for s in doc)
        inputs = pack([doc], length, n_rows=1, one_per_row=True).inputs
        with torch.inference_mode():
            logp = m.model(inputs, subnet=m.subnet).logits_BTV[0].float().log_softmax(-1)
        tgt = inputs.ids_BT[0, length - n :]
        lp = logp[length - n - 1 : length - 1]
        out.append((float(lp.gather(-1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all()), n))
    return out


def assert_parity(m: Ernie5EvalModel, requests: list[LoglikelihoodRequest]) -> None:
    """Shared scoring, and the unshared baseline the bench compares it with, equal the naive figures."""
    want = naive(m, requests)
    each = Ernie5EvalModel(m.ckpt, m.subnet, m.batch_size, ckpt_hash=m.ckpt_hash, share_context=False)
    for model in (m, each):
        got = model.loglikelihood(requests).results
        assert len(got) == len(want) == len(requests)
        for i, (g, (lp, greedy, n)) in enumerate(zip(got, want, strict=True)):
            assert g.n_tokens == n, i
            assert g.logprob == pytest.approx(lp, abs=ATOL), (
                model.share_context,
                i,
                requests[i].continuation,
            )
            assert g.is_greedy == greedy, i


def task_requests(name: str, data_dir, n: int = 3) -> list[LoglikelihoodRequest]:
    task = TASKS.get(name)()
    try:
        examples = task.examples(data_dir, limit=n, seed=0)
    except Exception as e:  # the task's data is not in this data root
        pytest.skip(f"{name}: {e}")
    return [r for ex in examples for r in task.requests(ex)]


def test_text_choices_of_one_and_several_tokens(eval_model):
    digits = [LoglikelihoodRequest("Question: what is two plus two? Answer:", f" {d}") for d in range(10)]
    words = [
        LoglikelihoodRequest("The colour of the sky is", c)
        for c in (" blue", " a deep shade of blue", " grey on most days of the year", "")
    ]
    other = [LoglikelihoodRequest("A different question entirely, with", c) for c in (" one", " two words")]
    assert_parity(eval_model, [*digits, *words, *other, LoglikelihoodRequest("", "hello there")])


def test_contexts_longer_than_the_window_are_cut_the_same_way(eval_model):
    long = " ".join(["word"] * (2 * eval_model.max_len))
    choices = [LoglikelihoodRequest(long, c) for c in (" a", " bb cc", " the end of a very long story")]
    assert_parity(eval_model, choices)


@pytest.mark.parametrize("task", ["digit_vqa_strokes", "shapes_vqa_attr", "shapes_vqa_rel", "video_shapes"])
def test_procedural_media_tasks(eval_model, task):
    assert_parity(eval_model, task_requests(task, None))


@pytest.mark.parametrize(
    "task", ["arc_easy", "openbookqa", "digit_vqa", "video_digits", "speaker_id", "spoken_digit_qa"]
)
def test_tasks_on_real_data(eval_model, data_root, task):
    assert_parity(eval_model, task_requests(task, data_root, n=2))


def test_one_forward_answers_a_ten_way_one_token_item(eval_model, monkeypatch):
    calls = []
    run = eval_model._run

    def counted(inputs, real_BT, tally, cache=None):
        calls.append((tuple(inputs.ids_BT.shape), cache is not None))
        return run(inputs, real_BT, tally, cache)

    monkeypatch.setattr(eval_model, "_run", counted)
    item = task_requests("digit_vqa_strokes", None, n=1)
    context = item[0].context
    # the micro tokenizer spells " 7" in two tokens: ask with choices that are one token in it
    one_token = [c for c in "0123456789abcdefghij" if len(eval_model._split("", c)[1]) == 1][:10]
    assert len(one_token) == 10
    eval_model.loglikelihood([LoglikelihoodRequest(context, c) for c in one_token])
    assert calls == [((1, calls[0][0][1]), False)]  # one row, no cache
    calls.clear()
    # four multi-token choices: the context once (into a cache), then the four continuations
    eval_model.loglikelihood(
        [LoglikelihoodRequest("Pick one:", c) for c in (" aa bb", " cc", " dd ee ff", " g h")]
    )
    assert [c[1] for c in calls] == [True, True, True]  # the context, then 3 + 1 continuation rows
    assert calls[0][0][0] == 1 and [c[0][0] for c in calls[1:]] == [3, 1]


def test_groups_keep_first_appearance_order():
    seg = [text_segment([1])]
    choices = [Choice(i, k, seg, [2]) for i, k in enumerate("abab")]
    assert [[c.index for c in g] for g in group_by_context(choices)] == [[0, 2], [1, 3]]


def test_a_selected_cache_copies_rows_with_their_length():
    cache = KVCache(2, 2, 1, 4, 8, torch.float32)
    cache.begin(torch.zeros(2, 3, dtype=torch.long), torch.arange(3).expand(2, 3))
    for layer in range(2):
        cache.update(layer, torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))
    cache.commit()
    picked = cache.select(torch.tensor([1, 1, 0]))
    assert picked.length == 3 and picked.max_len == 8
    assert torch.equal(picked.k[1][0], cache.k[1][1]) and torch.equal(picked.v[0][2], cache.v[0][0])
    picked.k[0].zero_()
    assert cache.k[0].abs().sum() > 0  # a copy, not a view
    cache.begin(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="uncommitted"):
        cache.select(torch.tensor([0]))
