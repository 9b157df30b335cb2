"""Procedural generators: determinism, format and correct answers."""

from __future__ import annotations

import random
import re

import pytest

from ernie5.data.procedural import DIFFICULTY_RANGE, KINDS, STOP, generate, procedural_document

ARITH = re.compile(r"Q: (\d+)([+\-*])(\d+)=\nA:")
WORDS = re.compile(r"Q: (copy|reverse) ([a-z]+)\nA:")
SORT = re.compile(r"Q: sort ([0-9a-z ]+)\nA:")


def _expected(prompt: str) -> str:
    """Solve a prompt independently of the generator."""
    if m := ARITH.fullmatch(prompt):
        a, op, b = int(m[1]), m[2], int(m[3])
        return str({"+": a + b, "-": a - b, "*": a * b}[op])
    if m := WORDS.fullmatch(prompt):
        return m[2] if m[1] == "copy" else m[2][::-1]
    m = SORT.fullmatch(prompt)
    assert m, prompt
    items = m[1].split()
    key = int if items[0].isdigit() else str
    return " ".join(sorted(items, key=key))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_answers_are_correct(kind, difficulty):
    rng = random.Random(f"{kind}-{difficulty}")
    for _ in range(50):
        ex = generate(kind, difficulty, rng)
        assert ex.prompt.startswith("Q: ") and ex.prompt.endswith("\nA:")
        assert ex.answer.startswith(" ") and "\n" not in ex.answer
        assert ex.answer == " " + _expected(ex.prompt)
        assert (ex.kind, ex.difficulty) == (kind, difficulty)


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_arithmetic_operands_have_the_difficulty_in_digits(difficulty):
    rng = random.Random(difficulty)
    for kind in ("add", "sub", "mul"):
        for _ in range(50):
            a, _, b = ARITH.fullmatch(generate(kind, difficulty, rng).prompt).groups()
            assert len(a) == len(b) == difficulty
            if kind == "sub":
                assert int(a) >= int(b)


@pytest.mark.parametrize(
    ("kind", "difficulty", "pattern"),
    [
        ("copy", 5, r"Q: copy [a-z]{5}\nA:"),
        ("sort_numbers", 3, r"Q: sort \d+ \d+ \d+\nA:"),
        ("sort_letters", 4, r"Q: sort [a-z] [a-z] [a-z] [a-z]\nA:"),
    ],
)
def test_lengths_follow_the_difficulty(kind, difficulty, pattern):
    assert re.fullmatch(pattern, generate(kind, difficulty, random.Random(0)).prompt)


def test_generation_is_deterministic_and_uses_no_global_state():
    random.seed(123)
    expected_global = random.random()
    random.seed(123)
    a = [generate(k, 3, random.Random(7)) for k in KINDS]
    doc = procedural_document(random.Random(7))
    assert random.random() == expected_global
    assert a == [generate(k, 3, random.Random(7)) for k in KINDS]
    assert doc == procedural_document(random.Random(7))
    assert doc != procedural_document(random.Random(8))


def test_documents_are_solved_problems():
    for seed in range(20):
        doc = procedural_document(random.Random(seed))
        assert doc.endswith(STOP)
        lines = doc.split("\n")[:-1]
        assert len(lines) % 2 == 0 and 4 <= len(lines) // 2 <= 12
        for question, answer in zip(lines[0::2], lines[1::2]):
            assert answer.startswith("A: ")
            assert answer[2:] == " " + _expected(question + "\nA:")
    assert procedural_document(random.Random(0), n_pairs=3).count("Q: ") == 3


@pytest.mark.parametrize(
    ("kind", "difficulty"),
    [("div", 2), ("add", 0), ("mul", DIFFICULTY_RANGE["mul"][1] + 1), ("sort_letters", 0)],
)
def test_invalid_requests(kind, difficulty):
    with pytest.raises(ValueError):
        generate(kind, difficulty, random.Random(0))
