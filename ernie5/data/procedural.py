"""Seeded procedural problems (arithmetic, copy/reverse, sorting) shared by eval tasks and pretraining.

One format everywhere: the prompt is ``"Q: <problem>\\nA:"``, the answer starts with a space and has no
newline (``" 522"``), and in training text every answer is followed by ``"\\n"``, so a model learns to
stop there and eval generation stops at ``"\\n"``::

    Q: 37+485=        Q: reverse kqzt      Q: sort 42 7 19
    A: 522            A: tzqk              A: 7 19 42

Difficulty is the number of digits per operand (arithmetic), the string length (copy, reverse) or the
list length (sorting). All randomness comes from the ``random.Random`` passed in: no global state, so a
seed fully determines every example and document.

Deviations:
  1. Subtraction orders its operands so the result is never negative (``485-37``), which keeps answers
     digit strings for every kind.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

KINDS: tuple[str, ...] = ("add", "sub", "mul", "copy", "reverse", "sort_numbers", "sort_letters")
DIFFICULTY_RANGE: dict[str, tuple[int, int]] = {
    "add": (1, 8),
    "sub": (1, 8),
    "mul": (1, 6),
    "copy": (1, 64),
    "reverse": (1, 64),
    "sort_numbers": (1, 32),
    "sort_letters": (1, 32),
}
"""Inclusive difficulty bounds accepted by :func:`generate`."""
TRAIN_DIFFICULTY: dict[str, tuple[int, int]] = {
    "add": (1, 4),
    "sub": (1, 4),
    "mul": (1, 3),
    "copy": (2, 16),
    "reverse": (2, 16),
    "sort_numbers": (2, 8),
    "sort_letters": (2, 8),
}
"""Inclusive difficulty ranges mixed into :func:`procedural_document` (the pretraining curriculum)."""
STOP = "\n"
"""What follows every answer in training text, and so where eval generation stops."""

_OPS = {"add": "+", "sub": "-", "mul": "*"}


@dataclass(frozen=True)
class ProceduralExample:
    """A generated problem: ``prompt`` ends with ``"A:"``; ``answer`` starts with a space, no newline."""

    prompt: str
    answer: str
    kind: str
    difficulty: int


def _operand(n_digits: int, rng: random.Random) -> int:
    low = 0 if n_digits == 1 else 10 ** (n_digits - 1)
    return rng.randint(low, 10**n_digits - 1)


def _letters(n: int, rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(n))


def generate(kind: str, difficulty: int, rng: random.Random) -> ProceduralExample:
    """One problem of ``kind`` (see :data:`KINDS`) at ``difficulty``, drawn from ``rng``."""
    if kind not in DIFFICULTY_RANGE:
        raise ValueError(f"unknown procedural kind {kind!r} (valid: {', '.join(KINDS)})")
    low, high = DIFFICULTY_RANGE[kind]
    if not low <= difficulty <= high:
        raise ValueError(f"{kind} difficulty={difficulty} must be in [{low}, {high}]")
    if kind in _OPS:
        a, b = _operand(difficulty, rng), _operand(difficulty, rng)
        if kind == "sub" and a < b:
            a, b = b, a
        result = {"add": a + b, "sub": a - b, "mul": a * b}[kind]
        problem, answer = f"{a}{_OPS[kind]}{b}=", str(result)
    elif kind in ("copy", "reverse"):
        text = _letters(difficulty, rng)
        problem, answer = f"{kind} {text}", text if kind == "copy" else text[::-1]
    elif kind == "sort_numbers":
        numbers = [rng.randint(0, 99) for _ in range(difficulty)]
        problem, answer = "sort " + " ".join(map(str, numbers)), " ".join(map(str, sorted(numbers)))
    else:
        letters = list(_letters(difficulty, rng))
        problem, answer = "sort " + " ".join(letters), " ".join(sorted(letters))
    return ProceduralExample(f"Q: {problem}\nA:", f" {answer}", kind, difficulty)


def procedural_document(rng: random.Random, n_pairs: int | None = None) -> str:
    """A training document of ``n_pairs`` (default 4..12, drawn) problems of mixed kinds and difficulties,
    each written as prompt + answer + ``"\\n"``."""
    n = rng.randint(4, 12) if n_pairs is None else n_pairs
    if n < 1:
        raise ValueError(f"n_pairs={n} must be >= 1")
    parts = []
    for _ in range(n):
        kind = rng.choice(KINDS)
        example = generate(kind, rng.randint(*TRAIN_DIFFICULTY[kind]), rng)
        parts.append(example.prompt + example.answer + STOP)
    return "".join(parts)
