"""AHRL's thinking skeletons: the first steps of a worked solution of an RL query, never its answer.

A :class:`Skeleton` is an ordered list of reasoning steps for one query and the way they are written
after its prompt. AHRL (``train.rl.trainer``) gives a hard query the first ``round(p_hint x n)`` of its
``n`` steps; the hint is prompt (no loss, no ratio) and the reward reads the model's own response only.
Every family's steps stop short of the final result, and no rendered hint is a prefix of the answer
(:func:`check_not_answer` is the test of it):

* arithmetic (``add``, ``sub``, ``mul``): the column work from the units up, carries and borrows
  (``"7+5=12, write 2 carry 1"``), or the partial products of a multiplication; the last column's
  step and the final sum are left out.
* ``copy`` / ``reverse``: a plan over the input (its length, its two halves, the order to write them
  in); no letter of the answer in answer order.
* ``sort_numbers`` / ``sort_letters``: a plan (how many items, the largest, which items fall in the
  lower and upper half of the range, in input order).
* GSM8K: the lines of the train split's worked solution without its last line (the one that computes
  the final number) and without the ``#### N`` line.
* SVAMP: the numbers its equation combines, then the innermost sub-expressions with their values, not
  the outermost operation.
* bAbI task 1: who the question is about and which story sentence last mentions them.
* ``shapes_vqa_attr``: the referent located by an attribute the question does not ask (the colour of
  the circle: "it is at the top left"); for "where is" questions, its column only (one coordinate
  of the two the answer names).

Other tasks (digit and clip questions, relational and count questions, image, speech and ASR queries)
have no skeleton: there is no reasoning to show before the answer, so AHRL gives them no hint.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §4.3 (AHRL: a partial *thinking skeleton* of the
    reference solution appended to hard prompts, its share decaying).
  * QuestA (arXiv 2507.13266) and StepHint (arXiv 2507.02841): hints as the first steps of a solution.

Deviations:
  1. The tasks have no reference thinking traces; the skeletons are derived from the problem (the
     procedural families, SVAMP's equation, bAbI's story, the shapes scene) or from the dataset's
     worked solution (GSM8K), one step per line of reasoning.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, replace

from ernie5.data.shapes import Scene, Shape


@dataclass(frozen=True)
class Skeleton:
    """The reasoning steps of one query and how a prefix of them is written after its prompt."""

    steps: tuple[str, ...] = ()
    open: str = " ["
    sep: str = "; "
    close: str = "]"

    def text(self, k: int) -> str:
        """The first ``k`` steps as hint text ("" for ``k <= 0``)."""
        k = min(k, len(self.steps))
        if k <= 0:
            return ""
        return self.open + self.sep.join(self.steps[:k]) + self.close


NONE = Skeleton()


def check_not_answer(skeleton: Skeleton, answer: str) -> None:
    """Raise ``ValueError`` when some rendered prefix of ``skeleton`` starts with the (stripped) answer
    or holds it whole: a hint must never hand over the answer."""
    want = " ".join(re.sub(r"[\[\];.,:]", " ", answer).split())
    for k in range(1, len(skeleton.steps) + 1):
        text = " ".join(re.sub(r"[\[\];.,:]", " ", skeleton.text(k)).split())
        if want and (text.startswith(want) or f" {want} " in f" {text} "):
            raise ValueError(f"hint {skeleton.text(k)!r} gives away the answer {answer.strip()!r}")


def safe(skeleton: Skeleton, answer: str) -> Skeleton:
    """``skeleton`` cut to its longest run of first steps that gives no hint away (an already sorted
    input's buckets, say, spell its answer): what every query's skeleton passes through."""
    steps = skeleton.steps
    while steps:
        try:
            check_not_answer(replace(skeleton, steps=steps), answer)
            break
        except ValueError:
            steps = steps[:-1]
    return replace(skeleton, steps=steps)


# ---------------------------------------------------------------------------------------- procedural
_PROBLEM = re.compile(r"^Q: (.*)\nA:$", re.S)


def procedural(prompt: str) -> Skeleton:
    """The skeleton of a procedural problem (``"Q: 37+485=\\nA:"``; :mod:`ernie5.data.procedural`)."""
    m = _PROBLEM.match(prompt)
    if not m:
        return NONE
    problem = m.group(1)
    arith = re.fullmatch(r"(\d+)([+*-])(\d+)=", problem)
    if arith:
        a, op, b = int(arith.group(1)), arith.group(2), int(arith.group(3))
        steps = {"+": _add_steps, "-": _sub_steps, "*": _mul_steps}[op](a, b)
        return Skeleton(tuple(steps))
    verb, _, rest = problem.partition(" ")
    if verb in ("copy", "reverse"):
        return Skeleton(tuple(_string_plan(rest, verb)))
    if verb == "sort":
        return Skeleton(tuple(_sort_plan(rest.split())))
    return NONE


def _digits(n: int) -> list[int]:
    """Digits of ``n`` from the units up."""
    return [int(c) for c in reversed(str(n))]


def _add_steps(a: int, b: int) -> list[str]:
    da, db = _digits(a), _digits(b)
    width = max(len(da), len(db))
    steps, carry = [], 0
    for i in range(width - 1):  # the last column would write the answer's leading digits
        x, y = (da[i] if i < len(da) else 0), (db[i] if i < len(db) else 0)
        total = x + y + carry
        plus = f"+{carry}" if carry else ""
        steps.append(f"{x}+{y}{plus}={total}, write {total % 10} carry {total // 10}")
        carry = total // 10
    return steps


def _sub_steps(a: int, b: int) -> list[str]:
    da, db = _digits(a), _digits(b)
    steps, borrow = [], 0
    for i in range(len(da) - 1):
        x, y = da[i] - borrow, (db[i] if i < len(db) else 0)
        borrow = int(x < y)
        steps.append(f"{x + 10 * borrow}-{y}={x + 10 * borrow - y}, borrow {borrow}")
    return steps


def _mul_steps(a: int, b: int) -> list[str]:
    db = _digits(b)
    if len(db) == 1:
        da = _digits(a)
        steps, carry = [], 0
        for i in range(len(da) - 1):
            total = da[i] * db[0] + carry
            plus = f"+{carry}" if carry else ""
            steps.append(f"{da[i]}*{db[0]}{plus}={total}, write {total % 10} carry {total // 10}")
            carry = total // 10
        return steps
    return [f"{a}*{d * 10**i}={a * d * 10**i}" for i, d in enumerate(db)]  # partial products, not their sum


def _string_plan(text: str, verb: str) -> list[str]:
    half = len(text) // 2
    steps = [f"{len(text)} letters"]
    if half:
        steps.append(f"halves {text[:half]} and {text[half:]}")
        if verb == "reverse":
            steps.append("write the second half backwards, then the first half backwards")
        else:
            steps.append("write the first half, then the second half")
    return steps


def _sort_plan(items: list[str]) -> list[str]:
    if len(items) < 2:  # one item is its own answer
        return []
    numeric = all(x.isdigit() for x in items)
    key = int if numeric else str
    largest = max(items, key=key)
    pivot = 50 if numeric else "m"
    low = [x for x in items if key(x) < pivot]
    high = [x for x in items if key(x) >= pivot]
    word = "numbers" if numeric else "letters"
    edge = "below 50" if numeric else "before n"
    return [
        f"{len(items)} {word}",
        f"the largest is {largest}",
        f"{edge}: {' '.join(low) or 'none'}; the rest: {' '.join(high) or 'none'}",
    ]


# ---------------------------------------------------------------------------------------- math words
def gsm8k(solution: str) -> Skeleton:
    """GSM8K: the worked solution's lines (calculator annotations stripped) but the last one."""
    lines = [line.strip() for line in solution.strip().splitlines() if line.strip()]
    return Skeleton(tuple(lines[:-1]), open=" ", sep="\n", close="\n")


def svamp(equation: str) -> Skeleton:
    """SVAMP: the numbers its equation (``"( ( 3.0 + 4.0 ) * 2.0 )"``) combines, then each inner
    sub-expression with its value, innermost first; not the outermost operation."""
    try:
        tree = ast.parse(equation, mode="eval").body
    except SyntaxError:
        return NONE
    numbers: list[str] = []
    inner: list[str] = []

    def walk(node: ast.AST, top: bool) -> float | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            numbers.append(_num(node.value))
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left, False), walk(node.right, False)
            if left is None or right is None:
                return None
            sym, fn = _OPS[type(node.op)]
            if right == 0 and sym == "/":
                return None
            value = fn(left, right)
            if not top:
                inner.append(f"{_num(left)} {sym} {_num(right)} = {_num(value)}")
            return value
        return None

    if walk(tree, True) is None:
        return NONE
    return Skeleton((f"the numbers: {', '.join(numbers)}", *inner), open=" ", sep=". ", close=".")


_OPS = {
    ast.Add: ("+", lambda x, y: x + y),
    ast.Sub: ("-", lambda x, y: x - y),
    ast.Mult: ("*", lambda x, y: x * y),
    ast.Div: ("/", lambda x, y: x / y),
}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


# ---------------------------------------------------------------------------------------- stories
_WHERE = re.compile(r"Where is (\w+)\?")


def babi_qa1(story: tuple[str, ...], question: str) -> Skeleton:
    """bAbI task 1: who the question asks about, and the number of the story's last sentence that
    mentions them (not the place it names)."""
    m = _WHERE.search(question)
    if not m:
        return NONE
    name = m.group(1)
    steps = [f"the question is about {name}"]
    last = [i for i, sentence in enumerate(story, start=1) if re.search(rf"\b{name}\b", sentence)]
    if last:
        steps.append(f"the last sentence about {name} is sentence {last[-1]}")
    return Skeleton(tuple(steps))


# ---------------------------------------------------------------------------------------- scenes
def shapes_attribute(scene: Scene, question: str, answer: str) -> Skeleton:
    """``shapes_vqa_attr``: locate the referent by an attribute neither asked nor given."""
    referent = _referent(scene, question)
    if referent is None:
        return NONE
    told = {w for w in (referent.kind, referent.color, referent.position) if w in question}
    if answer == referent.position:  # "Where is the red circle?": one coordinate of two
        column = ("left", "middle", "right")[referent.cell[1]]
        return Skeleton((f"find the {referent.name}: it is in the {column} column",))
    for attr in ("position", "kind", "color"):
        value = getattr(referent, attr)
        if value != answer and value not in told:
            what = {
                "position": f"it is at the {value}",
                "kind": f"it is a {value}",
                "color": f"it is {value}",
            }
            return Skeleton((f"find the object the question names: {what[attr]}",))
    return NONE


def _referent(scene: Scene, question: str) -> Shape | None:
    """The one shape of ``scene`` that ``question`` names (by kind, colour or position)."""
    matches = [
        s
        for s in scene.shapes
        if re.search(rf"\b{s.kind}\b", question)
        or re.search(rf"\b{s.color}\b", question)
        or f"at the {s.position}?" in question
    ]
    return matches[0] if len(matches) == 1 else None
