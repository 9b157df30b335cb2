"""Readers of the real text datasets: counts from each SOURCE.md, formats, clear errors, and loading
through Hugging Face ``datasets``."""

from __future__ import annotations

import json
import os

import pytest

from ernie5.data.root import DataMissing
from ernie5.data.text import (
    DataCorrupt,
    arc_items,
    bbh_items,
    gsm8k_items,
    read_arc,
    read_babi_qa1,
    read_bbh,
    read_gsm8k,
    read_openbookqa,
    read_shakespeare,
    read_svamp,
    shakespeare_split,
    strip_calculator_annotations,
    svamp_items,
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
            "gsm8k/test.jsonl",
            '{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": "#### 2"} {"question": 3}\n',
            lambda r: read_gsm8k(r, "test"),
            ":2: invalid JSON",
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


def test_readers_load_through_datasets(data_root, monkeypatch):
    """The JSON-lines and text files are read by ``datasets.load_dataset``'s packaged builders."""
    import datasets

    seen = []
    real = datasets.load_dataset

    def spy(path, *args, **kwargs):
        seen.append((path, os.path.basename(kwargs["data_files"])))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    read_arc(data_root, "Easy", "validation")
    read_gsm8k(data_root, "test")
    read_openbookqa(data_root, "dev")
    read_babi_qa1(data_root, "test")
    read_shakespeare(data_root)
    assert seen == [
        ("json", "ARC-Easy-validation.jsonl"),
        ("json", "test.jsonl"),
        ("text", "dev.tsv"),
        ("text", "qa1_single-supporting-fact_test.txt"),
        ("text", "input.txt"),
    ]


def test_the_row_parsers_read_hub_layout_rows(data_root):
    """A ``datasets`` source of the hub layout (here built in memory; ``allenai/ai2_arc`` and
    ``openai/gsm8k`` have these columns) gives the records the file readers give."""
    import datasets

    arc = datasets.Dataset.from_list(
        [
            {
                "id": "a1",
                "question": "Q?",
                "choices": {"text": ["x", "y"], "label": ["A", "B"]},
                "answerKey": "B",
            },
            {
                "id": "a2",
                "question": "R?",
                "choices": {"text": ["u", "v", "w"], "label": ["1", "2", "3"]},
                "answerKey": "3",
            },
        ]
    )
    items = arc_items(arc)
    assert [(it.id, it.choices, it.labels, it.answer) for it in items] == [
        ("a1", ("x", "y"), ("A", "B"), 1),
        ("a2", ("u", "v", "w"), ("1", "2", "3"), 2),
    ]
    gsm = datasets.Dataset.from_list([{"question": "q", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"}])
    (item,) = gsm8k_items(gsm, "test")
    assert (item.id, item.solution, item.answer) == ("gsm8k-test-1", "2 + 2 = <<2+2=4>>4", "4")
    svamp = datasets.Dataset.from_list([{"ID": "chal-1", "Body": "b", "Question": "q?", "Answer": 51.0}])
    assert [it.answer for it in svamp_items(svamp, "test")] == ["51"]
    assert bbh_items(datasets.Dataset.from_list([{"input": "x", "target": "7"}]), "t")[0].id == "t-0"
    # a local mirror through the same loader gives exactly the file reader's records
    mirror = datasets.load_dataset(
        "json", data_files=str(data_root / "arc" / "ARC-Challenge-validation.jsonl"), split="train"
    )
    assert arc_items(mirror) == read_arc(data_root, "Challenge", "validation")
    bad = datasets.Dataset.from_list([{**arc[0], "answerKey": "C"}])
    with pytest.raises(DataCorrupt, match=r"^allenai/ai2_arc:1: answerKey 'C'"):
        arc_items(bad, "allenai/ai2_arc")


def test_an_edited_file_is_never_served_from_the_datasets_cache(tmp_path):
    """The cache is keyed by content: a file rewritten with its old mtime (as ``cp -p`` or ``rsync -t``
    of another version do) is read anew."""
    path = _write(tmp_path, "arc/ARC-Easy-test.jsonl", json.dumps(GOOD_ARC) + "\n")
    assert read_arc(tmp_path, "Easy", "test")[0].answer == 1
    stat = path.stat()
    path.write_text(json.dumps({**GOOD_ARC, "answerKey": "A"}) + "\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert read_arc(tmp_path, "Easy", "test")[0].answer == 0


def test_a_valid_file_the_builder_trips_over_is_still_read(tmp_path):
    """Mixed value types beside a blank line make the ``json`` builder fail, and it types a column of ISO
    date strings as timestamps; the files are valid, so they are read (in Python) with the records and
    line-based ids they always had."""
    arc = [{**GOOD_ARC, "id": "2020-01-01"}, {**GOOD_ARC, "id": "2020-01-02"}]
    _write(tmp_path, "arc/ARC-Easy-test.jsonl", "".join(json.dumps(r) + "\n" for r in arc))
    assert [it.id for it in read_arc(tmp_path, "Easy", "test")] == ["2020-01-01", "2020-01-02"]
    rows = [{"question": "q1", "answer": "#### 1"}, {"question": "q2", "answer": "#### 2", "x": 1}]
    rows.append({"question": "q3", "answer": "#### 3", "x": "one"})
    _write(tmp_path, "gsm8k/test.jsonl", "\n\n".join(json.dumps(r) for r in rows) + "\n")
    items = read_gsm8k(tmp_path, "test")
    assert [(it.id, it.answer) for it in items] == [
        ("gsm8k-test-1", "1"),
        ("gsm8k-test-3", "2"),
        ("gsm8k-test-5", "3"),
    ]


def test_without_the_datasets_package_the_readers_give_the_same_rows(data_root, monkeypatch):
    """A machine without ``datasets`` (the GPU image) reads every file with the Python parse."""
    import sys

    readers = [
        lambda: read_arc(data_root, "Easy", "validation"),
        lambda: read_gsm8k(data_root, "test"),
        lambda: read_openbookqa(data_root, "dev"),
        lambda: read_babi_qa1(data_root, "test"),
        lambda: read_shakespeare(data_root),
    ]
    with_datasets = [read() for read in readers]
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert [read() for read in readers] == with_datasets
