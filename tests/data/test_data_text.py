"""Readers of the real text datasets: counts from each SOURCE.md, formats, and clear errors."""

from __future__ import annotations

import json

import pytest

from ernie5.data.root import DataMissing
from ernie5.data.text import (
    DataCorrupt,
    read_arc,
    read_babi_qa1,
    read_bbh,
    read_gsm8k,
    read_openbookqa,
    read_shakespeare,
    read_svamp,
    shakespeare_split,
    strip_calculator_annotations,
)


@pytest.mark.parametrize(
    ("subset", "split", "count"),
    [
        ("Easy", "train", 2251),
        ("Easy", "validation", 570),
        ("Easy", "test", 2376),
        ("Challenge", "train", 1119),
        ("Challenge", "validation", 299),
        ("Challenge", "test", 1172),
    ],
)
def test_arc_counts(data_root, subset, split, count):
    items = read_arc(data_root, subset, split)
    assert len(items) == count
    assert all(0 <= it.answer < len(it.choices) == len(it.labels) for it in items)


def test_arc_numeric_answer_keys(data_root):
    numeric = [it for it in read_arc(data_root, "Easy", "test") if it.labels[0] == "1"]
    assert numeric and all(it.labels[it.answer].isdigit() for it in numeric)
    assert {len(it.choices) for it in read_arc(data_root, "Easy", "test")} == {3, 4, 5}


@pytest.mark.parametrize(("split", "count"), [("train", 4957), ("dev", 500), ("test", 500)])
def test_openbookqa_counts(data_root, split, count):
    items = read_openbookqa(data_root, split)
    assert len(items) == count
    assert all(it.question and 0 <= it.answer < len(it.choices) for it in items)


def test_openbookqa_parses_choices(data_root):
    first = read_openbookqa(data_root, "test")[0]
    assert first.id == "8-343" and first.answer == 1
    assert first.choices == (
        "make more phone calls",
        "quit eating lunch out",
        "buy less with monopoly money",
        "have lunch with friends",
    )
    (odd,) = [it for it in read_openbookqa(data_root, "train") if it.id == "12-1145"]
    assert len(odd.choices) == 5 and odd.answer == 1


def test_gsm8k(data_root):
    test, train = read_gsm8k(data_root, "test"), read_gsm8k(data_root, "train")
    assert (len(test), len(train)) == (1319, 7473)
    assert test[0].answer == "18" and "####" not in test[0].solution
    assert strip_calculator_annotations(test[0].solution).startswith("Janet sells 16 - 3 - 4 = 9 duck eggs")
    assert len({it.id for it in test}) == len(test)


def test_svamp_split_is_a_partition(data_root):
    train, test = read_svamp(data_root, "train"), read_svamp(data_root, "test")
    assert (len(train), len(test)) == (216, 784)
    assert not {it.id for it in train} & {it.id for it in test}
    first = next(it for it in test if it.id == "chal-1")
    assert first.answer == "51" and first.question.endswith(
        "each pack. How much do you have to pay to buy each pack?"
    )


def test_babi(data_root):
    train, test = read_babi_qa1(data_root, "train"), read_babi_qa1(data_root, "test")
    assert (len(train), len(test)) == (10_000, 1_000)
    first = test[0]
    assert first.story == ("John travelled to the hallway.", "Mary journeyed to the bathroom.")
    assert (first.question, first.answer, first.supporting) == ("Where is John?", "hallway", (1,))
    assert len({it.id for it in test}) == len(test)


def test_bbh_counts(data_root):
    counts = {p.stem: len(read_bbh(data_root, p.stem)) for p in sorted((data_root / "bbh").glob("*.json"))}
    assert len(counts) == 27 and sum(counts.values()) == 6511
    assert (counts["causal_judgement"], counts["penguins_in_a_table"], counts["snarks"]) == (187, 146, 178)
    assert read_bbh(data_root, "boolean_expressions")[0].target == "False"


def test_shakespeare_split_real(data_root):
    text = read_shakespeare(data_root)
    train, heldout = shakespeare_split(text)
    assert len(text) == 1_115_394 and train + heldout == text
    assert train.endswith("\n") and 0.099 < len(heldout) / len(text) <= 0.1


@pytest.mark.parametrize(
    ("text", "fraction", "expected"),
    [
        ("aa\nbb\ncc\ndd\n", 0.25, ("aa\nbb\ncc\n", "dd\n")),
        ("aa\nbb\ncc\ndd\n", 0.3, ("aa\nbb\ncc\n", "dd\n")),
        ("aaaa\nb\n", 0.5, ("aaaa\n", "b\n")),
        ("abcdef", 0.5, ("abcdef", "")),
    ],
)
def test_shakespeare_split_cuts_at_a_line_start(text, fraction, expected):
    assert shakespeare_split(text, fraction) == expected


def _write(root, relpath, text):
    path = root / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


GOOD_ARC = {
    "id": "q1",
    "question": "Q?",
    "choices": {"text": ["a", "b"], "label": ["A", "B"]},
    "answerKey": "B",
}


@pytest.mark.parametrize(
    ("relpath", "content", "read", "needle"),
    [
        (
            "arc/ARC-Easy-test.jsonl",
            json.dumps(GOOD_ARC) + "\n{not json\n",
            lambda r: read_arc(r, "Easy", "test"),
            ":2: invalid JSON",
        ),
        (
            "arc/ARC-Easy-test.jsonl",
            json.dumps({**GOOD_ARC, "answerKey": "C"}) + "\n",
            lambda r: read_arc(r, "Easy", "test"),
            ":1: answerKey 'C'",
        ),
        (
            "gsm8k/test.jsonl",
            '{"question": "q", "answer": "a\\n#### 1"}\n{"question": "q"}\n',
            lambda r: read_gsm8k(r, "test"),
            ":2: missing key 'answer'",
        ),
        (
            "gsm8k/test.jsonl",
            '{"question": "q", "answer": "no marker"}\n',
            lambda r: read_gsm8k(r, "test"),
            ":1: answer has no '#### <number>' line",
        ),
        (
            "openbookqa/test.tsv",
            "ID\tQuestion Stem\tChoices\tComplete Question\tAnswer Key\n1\tq\t(A) x (B) y\tq\n",
            lambda r: read_openbookqa(r, "test"),
            ":2: expected 5 tab-separated columns",
        ),
        (
            "babi_qa1/qa1_single-supporting-fact_test.txt",
            "1 Mary went home.\n2 Where is Mary?\thome\n",
            lambda r: read_babi_qa1(r, "test"),
            ":2: question line",
        ),
        (
            "bbh/web_of_lies.json",
            '{"examples": [\n  {"input": "x",}\n]}',
            lambda r: read_bbh(r, "web_of_lies"),
            ":2: invalid JSON",
        ),
    ],
)
def test_corrupt_files_name_the_line(tmp_path, relpath, content, read, needle):
    path = _write(tmp_path, relpath, content)
    with pytest.raises(DataCorrupt) as info:
        read(tmp_path)
    message = str(info.value)
    assert str(path) in message and needle in message and "\n" not in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "read",
    [
        read_shakespeare,
        lambda r: read_arc(r, "Challenge", "test"),
        lambda r: read_openbookqa(r, "dev"),
        lambda r: read_gsm8k(r, "train"),
        lambda r: read_svamp(r, "test"),
        lambda r: read_babi_qa1(r, "train"),
        lambda r: read_bbh(r, "navigate"),
    ],
)
def test_missing_files_raise_data_missing(tmp_path, read):
    with pytest.raises(DataMissing, match=str(tmp_path)):
        read(tmp_path)
