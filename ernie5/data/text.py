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

Loading: the JSON-lines and text files (ARC, GSM8K, OpenBookQA, bAbI, Tiny Shakespeare) are read
through Hugging Face ``datasets`` (``load_dataset`` with its packaged ``json`` and ``text`` builders
over the local file; nothing is downloaded), cached under the ``datasets`` cache
(``HF_DATASETS_CACHE``) and keyed by the file's sha256, so an edited file is never served stale. The
rows then go through row parsers that take any ``datasets`` rows of the same layout, so the records of
a local mirror or a hub dataset come from the loader lm-eval users know: :func:`arc_items`
(``allenai/ai2_arc``), :func:`gsm8k_items` (``openai/gsm8k``, ``main``), :func:`svamp_items` (SVAMP's
own fields) and :func:`bbh_items` (``input``/``target``), e.g.
``arc_items(load_dataset("allenai/ai2_arc", "ARC-Easy", split="test"), "allenai/ai2_arc")``. Where the
builder cannot read a file, reads a line as more than one row, or gives rows that do not parse, the
reader parses the file in Python instead: that pass names the malformed line (the builders' errors do
not) and reads the rare valid file a builder trips over or mistypes (mixed value types beside blank
lines; ISO date strings read as timestamps), so records and errors do not depend on the builder.

Exceptions, each said in its reader: OpenBookQA's TSV and bAbI's numbered story lines are split here
after the ``text`` builder has read their lines (the ``csv`` builder pads or shifts malformed rows
instead of failing; no builder parses bAbI), and SVAMP's and BBH's single JSON documents are parsed
with the standard ``json`` module (the ``json`` builder reads them with lenient ``ujson``, which
accepts invalid JSON).
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ernie5.data.root import require_file
from ernie5.files import file_sha256

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
    equation: str = ""
    """The equation that gives the answer (SVAMP's ``Equation``, ``"( 76.0 - 25.0 )"``; "" for GSM8K)."""


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


Rows = Iterable[Mapping[str, Any]]
"""Dataset rows: a ``datasets.Dataset`` (or any iterable of mappings) of one split."""


class _Bad(Exception):
    """A row is malformed; the message says what, the caller adds where."""


def _row_number(i: int) -> int:
    return i + 1


def _load(path: Path, builder: str, **config: Any) -> list[dict[str, Any]] | None:
    """The rows of one local file as ``datasets``' packaged ``builder`` reads them, or None when it
    cannot (the caller then parses the file itself). Cached by content: the file's sha256 is part of
    the builder config, hence of the cache key (``datasets`` keys local files by mtime only). Without
    the ``datasets`` package, None: the caller's own parse reads every file."""
    from ernie5.runtime.packages import have

    if not have("datasets"):
        return None
    import datasets

    digest = file_sha256(path)
    bars_were_off, verbosity = datasets.are_progress_bars_disabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # the caller handles a failure
    try:
        rows = datasets.load_dataset(
            builder,
            data_files=glob.escape(str(path.resolve())),
            split="train",
            description=f"ernie5 sha256={digest}",
            **config,
        )
        return rows.to_list()
    except Exception:  # any builder failure: the Python parse names the line or reads the file
        return None
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.enable_progress_bars()


def _read_jsonl(path: Path, parse: Callable[..., list]) -> list:
    """``parse(rows, path, line)`` over a JSON-lines file, ``line(i)`` being row ``i``'s line number.

    The rows come from the ``json`` builder when it reads one row per non-blank line and they parse;
    otherwise from a strict Python pass, which decides: it names a malformed line, or reads a file the
    builder mistyped (pyarrow takes a column of ISO date strings for timestamps) or failed on."""
    rows = _load(path, "json")
    if rows is not None:
        with path.open(encoding="utf-8", errors="replace") as f:
            lines = [n for n, line in enumerate(f, start=1) if line.strip()]
        if len(lines) == len(rows):  # else a line held more than one object
            try:
                return parse(rows, path, lines.__getitem__)
            except DataCorrupt:
                pass
    rows, lines = [], []
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
            rows.append(obj)
            lines.append(lineno)
    return parse(rows, path, lines.__getitem__)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataCorrupt(path, e.lineno, f"invalid JSON ({e.msg})") from None


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataCorrupt(path, None, f"not UTF-8 at byte {e.start}") from None


def _lines(path: Path) -> list[str]:
    """The lines of a text file without their line breaks (row ``i`` is line ``i + 1``)."""
    rows = _load(path, "text")
    if rows is not None:
        return [r["text"] for r in rows]
    return [line.rstrip("\n") for line in io.StringIO(_text(path)).readlines()]


def _parse(rows: Rows, where: str | Path, line: Callable[[int], int | None], parse: Callable) -> list:
    """``parse(i, row)`` over the rows; a :class:`_Bad` row is a :class:`DataCorrupt` naming its line."""
    items = []
    for i, row in enumerate(rows):
        try:
            if not isinstance(row, Mapping):
                raise _Bad(f"expected a JSON object, got {type(row).__name__}")
            items.append(parse(i, row))
        except _Bad as e:
            raise DataCorrupt(Path(where), line(i), str(e)) from None
    return items


def _get(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``obj[key]`` of type ``kind``; absent and null are the same (a ``datasets`` row has every
    column, null where the file lacks the key)."""
    value = obj.get(key)
    if value is None:
        raise _Bad(f"missing key {key!r}")
    if not isinstance(value, kind):
        raise _Bad(f"key {key!r} has type {type(value).__name__}")
    return value


def read_shakespeare(root: str | Path | None) -> str:
    """The whole Tiny Shakespeare corpus as text (the ``text`` builder, one document)."""
    path = require_file(root, "tinyshakespeare/input.txt", HOW_TO_GET["tinyshakespeare"])
    rows = _load(path, "text", sample_by="document")
    if rows is None:
        return _text(path)
    return rows[0]["text"] if rows else ""


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


def arc_items(rows: Rows, where: str | Path = "rows", line: Callable[[int], int | None] = _row_number):
    """ARC questions from rows of the ``allenai/ai2_arc`` layout (``id``, ``question``, ``choices``
    ``{text, label}``, ``answerKey``); ``where`` and ``line`` name a bad row in errors.

    Answer keys may be letters or digits and always match one of the labels."""

    def parse(_: int, obj: Mapping[str, Any]) -> ChoiceItem:
        choices = _get(obj, "choices", Mapping)
        texts = tuple(_get(choices, "text", list))
        labels = tuple(str(x) for x in _get(choices, "label", list))
        key = str(_get(obj, "answerKey", (str, int)))
        if len(texts) != len(labels) or len(texts) < 2:
            raise _Bad(f"{len(texts)} choice texts but {len(labels)} labels")
        if key not in labels:
            raise _Bad(f"answerKey {key!r} is not one of the labels {list(labels)}")
        question = _get(obj, "question", str)
        return ChoiceItem(str(_get(obj, "id", str)), question, texts, labels, labels.index(key))

    return _parse(rows, where, line, parse)


def read_arc(root: str | Path | None, subset: Literal["Easy", "Challenge"], split: str) -> list[ChoiceItem]:
    """ARC questions of ``arc/ARC-{subset}-{split}.jsonl`` (:func:`arc_items`)."""
    if subset not in ("Easy", "Challenge") or split not in ("train", "validation", "test"):
        raise ValueError(
            f"ARC subset={subset!r} split={split!r}: expected Easy|Challenge, train|validation|test"
        )
    path = require_file(root, f"arc/ARC-{subset}-{split}.jsonl", HOW_TO_GET["arc"])
    return _read_jsonl(path, arc_items)


_OBQA_HEADER = ["ID", "Question Stem", "Choices", "Complete Question", "Answer Key"]


def read_openbookqa(root: str | Path | None, split: Literal["train", "dev", "test"]) -> list[ChoiceItem]:
    """OpenBookQA (Main) questions parsed from the ``Choices`` column ``(A) ... (B) ...``.

    The TSV's lines come from the ``text`` builder and are split on tabs here (no quoting): the
    ``csv`` builder (pandas) pads a short row and turns a long row's first column into an index
    instead of failing, which would turn a malformed row into a wrong question."""
    if split not in ("train", "dev", "test"):
        raise ValueError(f"OpenBookQA split={split!r}: expected train|dev|test")
    path = require_file(root, f"openbookqa/{split}.tsv", HOW_TO_GET["openbookqa"])
    lines = _lines(path)
    header = lines[0].split("\t") if lines else None
    if header is None or [h.strip() for h in header[:5]] != _OBQA_HEADER:
        raise DataCorrupt(path, 1, f"unexpected header {header}")
    items = []
    for lineno, line in enumerate(lines[1:], start=2):
        if not line:
            continue
        row = line.split("\t")
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


def gsm8k_items(
    rows: Rows, split: str, where: str | Path = "rows", line: Callable[[int], int | None] = _row_number
) -> list[MathItem]:
    """GSM8K problems from rows of the ``openai/gsm8k`` layout (``question``, ``answer``); ids are
    ``gsm8k-<split>-<line>``. ``solution`` keeps calculator annotations, ``answer`` is the text after
    ``####``."""

    def parse(i: int, obj: Mapping[str, Any]) -> MathItem:
        question = _get(obj, "question", str)
        full = _get(obj, "answer", str)
        if "####" not in full:
            raise _Bad("answer has no '#### <number>' line")
        solution, _, answer = full.rpartition("####")
        return MathItem(f"gsm8k-{split}-{line(i)}", question, solution.strip(), answer.strip())

    return _parse(rows, where, line, parse)


def read_gsm8k(root: str | Path | None, split: Literal["train", "test"]) -> list[MathItem]:
    """GSM8K problems of ``gsm8k/{split}.jsonl`` (:func:`gsm8k_items`; ids from the file's lines)."""
    if split not in ("train", "test"):
        raise ValueError(f"GSM8K split={split!r}: expected train|test")
    path = require_file(root, f"gsm8k/{split}.jsonl", HOW_TO_GET["gsm8k"])
    return _read_jsonl(path, lambda rows, where, line: gsm8k_items(rows, split, where, line))


def _svamp_split(item_id: str) -> str:
    digest = hashlib.sha256(item_id.encode("utf-8")).hexdigest()
    return "train" if int(digest[:8], 16) % 5 == 0 else "test"


def svamp_items(rows: Rows, split: str, where: str | Path = "rows") -> list[MathItem]:
    """SVAMP problems of one hash split (see the module docstring) from rows with ``ID``, ``Body``,
    ``Question`` and a numeric ``Answer``; whole answers are integer strings."""
    if split not in ("train", "test"):
        raise ValueError(f"SVAMP split={split!r}: expected train|test")
    items = []
    for i, obj in enumerate(rows):
        where_i = f"item {i}"
        if not isinstance(obj, Mapping) or any(
            obj.get(k) is None for k in ("ID", "Body", "Question", "Answer")
        ):
            raise DataCorrupt(
                Path(where), None, f"{where_i}: expected an object with ID, Body, Question, Answer"
            )
        if not isinstance(obj["Answer"], int | float) or isinstance(obj["Answer"], bool):
            raise DataCorrupt(Path(where), None, f"{where_i}: Answer {obj['Answer']!r} is not a number")
        if _svamp_split(str(obj["ID"])) != split:
            continue
        body = str(obj["Body"]).strip()
        body = body if body.endswith((".", "?", "!")) else body + "."
        value = float(obj["Answer"])
        answer = str(int(value)) if value.is_integer() else repr(value)
        question = f"{body} {str(obj['Question']).strip()}"
        items.append(MathItem(str(obj["ID"]), question, "", answer, str(obj.get("Equation") or "")))
    return items


def read_svamp(root: str | Path | None, split: Literal["train", "test"]) -> list[MathItem]:
    """SVAMP problems of one hash split of ``svamp/SVAMP.json`` (:func:`svamp_items`).

    Parsed with the standard ``json`` module, not the ``datasets`` ``json`` builder: the builder reads
    a single JSON document with ``ujson``, which accepts invalid JSON (trailing commas), so a corrupt
    file would be read instead of reported. A ``datasets`` source goes through :func:`svamp_items`."""
    if split not in ("train", "test"):
        raise ValueError(f"SVAMP split={split!r}: expected train|test")
    path = require_file(root, "svamp/SVAMP.json", HOW_TO_GET["svamp"])
    data = _json(path)
    if not isinstance(data, list):
        raise DataCorrupt(path, 1, "expected a JSON array of problems")
    return svamp_items(data, split, path)


def read_babi_qa1(root: str | Path | None, split: Literal["train", "test"]) -> list[BabiItem]:
    """bAbI task 1: one item per question, with the story statements seen so far (the lines come
    from the ``text`` builder; the numbered story format is parsed here)."""
    if split not in ("train", "test"):
        raise ValueError(f"bAbI split={split!r}: expected train|test")
    path = require_file(root, f"babi_qa1/qa1_single-supporting-fact_{split}.txt", HOW_TO_GET["babi_qa1"])
    items: list[BabiItem] = []
    story: list[str] = []
    story_index = 0
    for lineno, line in enumerate(_lines(path), start=1):
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
            raise DataCorrupt(path, lineno, "question line needs 'question<TAB>answer<TAB>supporting ids'")
        try:
            supporting = tuple(int(x) for x in fields[2].split())
        except ValueError:
            raise DataCorrupt(path, lineno, f"bad supporting ids {fields[2]!r}") from None
        item_id = f"babi1-{split}-{story_index}-{number}"
        items.append(BabiItem(item_id, tuple(story), fields[0].strip(), fields[1].strip(), supporting))
    return items


def bbh_items(rows: Rows, task: str, where: str | Path = "rows") -> list[BbhItem]:
    """BIG-Bench Hard examples of ``task`` from rows with ``input`` and ``target`` (ids ``<task>-<i>``)."""
    items = []
    for i, obj in enumerate(rows):
        if not isinstance(obj, Mapping) or not isinstance(obj.get("input"), str) or obj.get("target") is None:
            raise DataCorrupt(Path(where), None, f"example {i}: expected an object with 'input' and 'target'")
        items.append(BbhItem(f"{task}-{i}", obj["input"], str(obj["target"])))
    return items


def read_bbh(root: str | Path | None, task: str) -> list[BbhItem]:
    """One BIG-Bench Hard task file (``bbh/<task>.json``, its ``examples``; :func:`bbh_items`).
    Evaluation only: never train on it (canary).

    Parsed with the standard ``json`` module for the reason given in :func:`read_svamp` (the
    ``datasets`` ``json`` builder's ``field=`` mode reads the document with lenient ``ujson``)."""
    if not re.fullmatch(r"[a-z_]+", task):
        raise ValueError(f"BBH task {task!r}: expected a file stem like 'boolean_expressions'")
    path = require_file(root, f"bbh/{task}.json", HOW_TO_GET["bbh"])
    data = _json(path)
    if not isinstance(data, dict) or not isinstance(data.get("examples"), list):
        raise DataCorrupt(path, 1, "expected an object with an 'examples' list")
    return bbh_items(data["examples"], task, path)
