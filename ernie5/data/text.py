"""Readers for the real text datasets under the data root, returning plain frozen records.

Every reader takes the data root (used as given; resolve it with
:func:`ernie5.data.root.resolve_data_dir` first) and raises :class:`~ernie5.data.root.DataMissing` when
a file is absent and :class:`DataCorrupt` (``path:line: what``) when a file is malformed. Records keep
the dataset's own ids where it has them; otherwise ids are built from the file position, which is stable
as long as the file is unchanged (tasks fingerprint the bytes).

Layouts (relative to the root): ``tinyshakespeare/input.txt``; ``arc/ARC-{Easy,Challenge}-{split}.jsonl``
(Hugging Face ``allenai/ai2_arc`` layout); ``openbookqa/{train,dev,test}.tsv``; ``gsm8k/{train,test}.jsonl``;
``svamp/SVAMP.json``; ``babi_qa1/qa1_single-supporting-fact_{train,test}.txt``; ``bbh/<task>.json``.

Deviations:
  1. SVAMP ships without splits. :func:`read_svamp` splits it by a hash of each item's ``ID``:
     ``int(sha256(ID)[:8], 16) % 5 == 0`` is ``train`` (the few-shot pool, 216 items), the rest is
     ``test`` (784 items). A hash split does not depend on file order. Bodies that lack final
     punctuation get a period before the question is appended.
  2. One OpenBookQA train row (``12-1145``) lists five options, two labelled ``(D)``. Options are taken
     by position, so it reads as five choices; the answer key is mapped by position (A=0, B=1, ...).
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ernie5.data.root import require_file

HOW_TO_GET: dict[str, str] = {
    "tinyshakespeare": "karpathy/char-rnn data/tinyshakespeare/input.txt -> <root>/tinyshakespeare/input.txt",
    "arc": "HF allenai/ai2_arc splits as JSONL "
    "-> <root>/arc/ARC-{Easy,Challenge}-{train,validation,test}.jsonl",
    "openbookqa": "OpenBookQA Main TSVs (ID, Question Stem, Choices, Complete Question, Answer Key) "
    "-> <root>/openbookqa/{train,dev,test}.tsv",
    "gsm8k": "openai/grade-school-math grade_school_math/data/{train,test}.jsonl -> <root>/gsm8k/",
    "svamp": "arkilpatel/SVAMP SVAMP.json -> <root>/svamp/SVAMP.json",
    "babi_qa1": "bAbI v1.2 en-10k qa1_single-supporting-fact_{train,test}.txt -> <root>/babi_qa1/",
    "bbh": "suzgunmirac/BIG-Bench-Hard bbh/<task>.json -> <root>/bbh/",
}
"""One-line instructions per dataset folder, shown when a file is missing."""

_GSM8K_CALC = re.compile(r"<<[^>]*>>")
_OBQA_OPTION = re.compile(r"\(([A-Z])\)\s")


class DataCorrupt(ValueError):
    """A dataset file is malformed. The message is one line: ``path:line: what is wrong``."""

    def __init__(self, path: Path, line: int | None, what: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {what}")


@dataclass(frozen=True)
class ChoiceItem:
    """A multiple-choice question; ``answer`` indexes ``choices``."""

    id: str
    question: str
    choices: tuple[str, ...]
    labels: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class MathItem:
    """A math word problem; ``answer`` is the final number as written (``"1,000"``, ``"51"``)."""

    id: str
    question: str
    solution: str
    """Worked solution without the final ``#### N`` line (GSM8K; "" for SVAMP)."""
    answer: str


@dataclass(frozen=True)
class BabiItem:
    """One bAbI question with the story sentences before it (questions removed)."""

    id: str
    story: tuple[str, ...]
    question: str
    answer: str
    supporting: tuple[int, ...]
    """Line numbers (within the story) of the supporting facts."""


@dataclass(frozen=True)
class BbhItem:
    """One BIG-Bench Hard example."""

    id: str
    input: str
    target: str


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataCorrupt(path, lineno, f"invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataCorrupt(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataCorrupt(path, e.lineno, f"invalid JSON ({e.msg})") from None


def _get(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path, line: int | None) -> Any:
    if key not in obj:
        raise DataCorrupt(path, line, f"missing key {key!r}")
    if not isinstance(obj[key], kind):
        raise DataCorrupt(path, line, f"key {key!r} has type {type(obj[key]).__name__}")
    return obj[key]


def read_shakespeare(root: str | Path | None) -> str:
    """The whole Tiny Shakespeare corpus as text."""
    path = require_file(root, "tinyshakespeare/input.txt", HOW_TO_GET["tinyshakespeare"])
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataCorrupt(path, None, f"not UTF-8 at byte {e.start}") from None


def shakespeare_split(text: str, heldout_fraction: float = 0.1) -> tuple[str, str]:
    """``(train_text, heldout_text)``: the held-out part is the last ``heldout_fraction`` of the characters,
    moved forward to the next line start. Training and evaluation both call this, so training never sees
    the held-out tail. ``train_text + heldout_text == text``."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction={heldout_fraction} must be in (0, 1)")
    cut = int(len(text) * (1.0 - heldout_fraction))
    newline = text.find("\n", cut - 1) if cut > 0 else -1
    cut = newline + 1 if newline >= 0 else len(text)
    return text[:cut], text[cut:]


def read_arc(root: str | Path | None, subset: Literal["Easy", "Challenge"], split: str) -> list[ChoiceItem]:
    """ARC questions; answer keys may be letters or digits and always match one of the labels."""
    if subset not in ("Easy", "Challenge") or split not in ("train", "validation", "test"):
        raise ValueError(
            f"ARC subset={subset!r} split={split!r}: expected Easy|Challenge, train|validation|test"
        )
    path = require_file(root, f"arc/ARC-{subset}-{split}.jsonl", HOW_TO_GET["arc"])
    items = []
    for lineno, obj in _jsonl(path):
        choices = _get(obj, "choices", dict, path, lineno)
        texts = tuple(_get(choices, "text", list, path, lineno))
        labels = tuple(str(x) for x in _get(choices, "label", list, path, lineno))
        key = str(_get(obj, "answerKey", (str, int), path, lineno))
        if len(texts) != len(labels) or len(texts) < 2:
            raise DataCorrupt(path, lineno, f"{len(texts)} choice texts but {len(labels)} labels")
        if key not in labels:
            raise DataCorrupt(path, lineno, f"answerKey {key!r} is not one of the labels {list(labels)}")
        question = _get(obj, "question", str, path, lineno)
        items.append(
            ChoiceItem(str(_get(obj, "id", str, path, lineno)), question, texts, labels, labels.index(key))
        )
    return items


def read_openbookqa(root: str | Path | None, split: Literal["train", "dev", "test"]) -> list[ChoiceItem]:
    """OpenBookQA (Main) questions parsed from the ``Choices`` column ``(A) ... (B) ...``."""
    if split not in ("train", "dev", "test"):
        raise ValueError(f"OpenBookQA split={split!r}: expected train|dev|test")
    path = require_file(root, f"openbookqa/{split}.tsv", HOW_TO_GET["openbookqa"])
    items = []
    with path.open(encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(rows, None)
        if header is None or [h.strip() for h in header[:5]] != [
            "ID",
            "Question Stem",
            "Choices",
            "Complete Question",
            "Answer Key",
        ]:
            raise DataCorrupt(path, 1, f"unexpected header {header}")
        for lineno, row in enumerate(rows, start=2):
            if not row:
                continue
            if len(row) != 5:
                raise DataCorrupt(path, lineno, f"expected 5 tab-separated columns, got {len(row)}")
            parts = _OBQA_OPTION.split(" " + row[2].strip() + " ")[1:]
            labels, texts = tuple(parts[0::2]), tuple(t.strip() for t in parts[1::2])
            key = row[4].strip()
            position = ord(key) - ord("A") if len(key) == 1 else -1
            if len(texts) < 2 or not 0 <= position < len(texts):
                raise DataCorrupt(path, lineno, f"answer key {key!r} does not match options {list(labels)}")
            items.append(ChoiceItem(row[0].strip(), row[1].strip(), texts, labels, position))
    return items


def strip_calculator_annotations(solution: str) -> str:
    """Remove GSM8K calculator annotations: ``48/2=<<48/2=24>>24`` -> ``48/2=24``."""
    return _GSM8K_CALC.sub("", solution)


def read_gsm8k(root: str | Path | None, split: Literal["train", "test"]) -> list[MathItem]:
    """GSM8K problems; ``solution`` keeps calculator annotations, ``answer`` is the text after ``####``."""
    if split not in ("train", "test"):
        raise ValueError(f"GSM8K split={split!r}: expected train|test")
    path = require_file(root, f"gsm8k/{split}.jsonl", HOW_TO_GET["gsm8k"])
    items = []
    for lineno, obj in _jsonl(path):
        question = _get(obj, "question", str, path, lineno)
        full = _get(obj, "answer", str, path, lineno)
        if "####" not in full:
            raise DataCorrupt(path, lineno, "answer has no '#### <number>' line")
        solution, _, answer = full.rpartition("####")
        items.append(MathItem(f"gsm8k-{split}-{lineno}", question, solution.strip(), answer.strip()))
    return items


def _svamp_split(item_id: str) -> str:
    digest = hashlib.sha256(item_id.encode("utf-8")).hexdigest()
    return "train" if int(digest[:8], 16) % 5 == 0 else "test"


def read_svamp(root: str | Path | None, split: Literal["train", "test"]) -> list[MathItem]:
    """SVAMP problems of one hash split (see the module docstring); whole answers are integer strings."""
    if split not in ("train", "test"):
        raise ValueError(f"SVAMP split={split!r}: expected train|test")
    path = require_file(root, "svamp/SVAMP.json", HOW_TO_GET["svamp"])
    data = _json(path)
    if not isinstance(data, list):
        raise DataCorrupt(path, 1, "expected a JSON array of problems")
    items = []
    for i, obj in enumerate(data):
        where = f"item {i}"
        if not isinstance(obj, dict) or not {"ID", "Body", "Question", "Answer"} <= obj.keys():
            raise DataCorrupt(path, None, f"{where}: expected an object with ID, Body, Question, Answer")
        if not isinstance(obj["Answer"], int | float) or isinstance(obj["Answer"], bool):
            raise DataCorrupt(path, None, f"{where}: Answer {obj['Answer']!r} is not a number")
        if _svamp_split(str(obj["ID"])) != split:
            continue
        body = str(obj["Body"]).strip()
        body = body if body.endswith((".", "?", "!")) else body + "."
        value = float(obj["Answer"])
        answer = str(int(value)) if value.is_integer() else repr(value)
        items.append(MathItem(str(obj["ID"]), f"{body} {str(obj['Question']).strip()}", "", answer))
    return items


def read_babi_qa1(root: str | Path | None, split: Literal["train", "test"]) -> list[BabiItem]:
    """bAbI task 1: one item per question, with the story statements seen so far."""
    if split not in ("train", "test"):
        raise ValueError(f"bAbI split={split!r}: expected train|test")
    path = require_file(root, f"babi_qa1/qa1_single-supporting-fact_{split}.txt", HOW_TO_GET["babi_qa1"])
    items: list[BabiItem] = []
    story: list[str] = []
    story_index = 0
    with path.open(encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.rstrip("\n")
            if not line.strip():
                continue
            number, _, rest = line.partition(" ")
            if not number.isdigit() or not rest:
                raise DataCorrupt(path, lineno, "expected '<number> <sentence>'")
            if int(number) == 1:
                story, story_index = [], story_index + 1
            if "\t" not in rest:
                story.append(rest.strip())
                continue
            fields = rest.split("\t")
            if len(fields) != 3 or not fields[1].strip():
                raise DataCorrupt(
                    path, lineno, "question line needs 'question<TAB>answer<TAB>supporting ids'"
                )
            try:
                supporting = tuple(int(x) for x in fields[2].split())
            except ValueError:
                raise DataCorrupt(path, lineno, f"bad supporting ids {fields[2]!r}") from None
            item_id = f"babi1-{split}-{story_index}-{number}"
            items.append(BabiItem(item_id, tuple(story), fields[0].strip(), fields[1].strip(), supporting))
    return items


def read_bbh(root: str | Path | None, task: str) -> list[BbhItem]:
    """One BIG-Bench Hard task file (``bbh/<task>.json``). Evaluation only: never train on it (canary)."""
    if not re.fullmatch(r"[a-z_]+", task):
        raise ValueError(f"BBH task {task!r}: expected a file stem like 'boolean_expressions'")
    path = require_file(root, f"bbh/{task}.json", HOW_TO_GET["bbh"])
    data = _json(path)
    if not isinstance(data, dict) or not isinstance(data.get("examples"), list):
        raise DataCorrupt(path, 1, "expected an object with an 'examples' list")
    items = []
    for i, obj in enumerate(data["examples"]):
        if not isinstance(obj, dict) or not isinstance(obj.get("input"), str) or "target" not in obj:
            raise DataCorrupt(path, None, f"example {i}: expected an object with 'input' and 'target'")
        items.append(BbhItem(f"{task}-{i}", obj["input"], str(obj["target"])))
    return items
