"""``arith``, ``copy_reverse``, ``sort`` and their fixed-difficulty variants: generated problems.

Problems come from :mod:`ernie5.data.procedural`, the generators the pretraining mixture uses, so the
format is the one the model was trained on: ``"Q: 37+485=\\nA:"`` -> ``" 522"``. Generation stops at
``"\\n"``; the score is exact match after :func:`evals.metrics.normalize_answer`. No data is needed.

Example ``i`` for seed ``s`` is drawn from ``random.Random("<kinds>:<difficulty>:<s>:<i>")``, so a seed
fixes the set, a smaller ``limit`` is a prefix of a larger one, and ids (``arith-d2-s0-17``) stay unique.
``limit=None`` evaluates ``n_examples`` problems. Easy levels have few distinct problems (1-digit
arithmetic has 300), so repeats are possible and also occur in training text: these tasks measure skill,
not memorisation-free generalisation.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from ernie5.data.procedural import DIFFICULTY_RANGE, STOP, generate
from evals.api import GenerationRequest, GenerationResult, Request, Response
from evals.metrics import exact_match
from evals.task import TASKS, Example, Score, Task, register_variant


def _check(difficulty: int, n_examples: int, kind: str) -> None:
    low, high = DIFFICULTY_RANGE[kind]
    if not low <= difficulty <= high:
        raise ValueError(f"difficulty={difficulty} must be in [{low}, {high}]")
    if not 1 <= n_examples <= 100_000:
        raise ValueError(f"n_examples={n_examples} must be in [1, 100000]")


@dataclass(frozen=True, kw_only=True)
class ArithOptions:
    difficulty: int = 2
    """Digits per operand."""
    op: Literal["add", "sub", "mul", "mixed"] = "mixed"
    n_examples: int = 500

    def __post_init__(self) -> None:
        _check(self.difficulty, self.n_examples, "mul" if self.op in ("mul", "mixed") else self.op)


@dataclass(frozen=True, kw_only=True)
class CopyReverseOptions:
    difficulty: int = 8
    """String length."""
    op: Literal["copy", "reverse", "mixed"] = "mixed"
    n_examples: int = 500

    def __post_init__(self) -> None:
        _check(self.difficulty, self.n_examples, "copy")


@dataclass(frozen=True, kw_only=True)
class SortOptions:
    difficulty: int = 5
    """List length."""
    items: Literal["numbers", "letters", "mixed"] = "mixed"
    n_examples: int = 500

    def __post_init__(self) -> None:
        _check(self.difficulty, self.n_examples, "sort_numbers")


class ProceduralTask(Task):
    """Base for generated problems (not registered itself)."""

    version = 1
    family: ClassVar[str]
    metrics: ClassVar[dict[str, bool]] = {"exact_match": True}
    splits = ("generated",)
    how_to_get = "nothing to get: problems are generated from the seed"

    @abstractmethod
    def kinds(self) -> tuple[str, ...]:
        """Generator kinds mixed by this instance."""

    @abstractmethod
    def max_new_tokens(self) -> int:
        """A budget that fits the longest answer even with one token per character."""

    def examples(
        self, data_dir: str | Path | None, *, limit: int | None = None, seed: int = 0
    ) -> list[Example]:
        n = self.options.n_examples if limit is None else min(limit, self.options.n_examples)
        if n < 0:
            raise ValueError(f"limit={limit} must be >= 0")
        difficulty, kinds = self.options.difficulty, self.kinds()
        out = []
        for i in range(n):
            rng = random.Random(f"{'+'.join(kinds)}:{difficulty}:{seed}:{i}")
            problem = generate(rng.choice(kinds), difficulty, rng)
            item_id = f"{self.family}-d{difficulty}-s{seed}-{i}"
            out.append(Example(id=item_id, prompt=problem.prompt, target=problem.answer.strip()))
        return out

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        return self.examples(data_dir, limit=None, seed=0)

    def requests(self, example: Example) -> list[Request]:
        return [
            GenerationRequest(context=example.context, max_new_tokens=self.max_new_tokens(), stop=(STOP,))
        ]

    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        if len(responses) != 1 or not isinstance(responses[0], GenerationResult):
            raise ValueError(f"{self.name}/{example.id}: expected one generation result")
        return {"exact_match": exact_match(responses[0].text, example.target)}


def _mixed(option: str, mixed: tuple[str, ...], prefix: str = "") -> tuple[str, ...]:
    return mixed if option == "mixed" else (prefix + option,)


@TASKS.register("arith")
class Arith(ProceduralTask):
    """Multi-digit addition, subtraction (non-negative results) and multiplication."""

    name = "arith"
    family = "arith"
    Options = ArithOptions

    def kinds(self) -> tuple[str, ...]:
        return _mixed(self.options.op, ("add", "sub", "mul"))

    def max_new_tokens(self) -> int:
        return 2 * self.options.difficulty + 8


@TASKS.register("copy_reverse")
class CopyReverse(ProceduralTask):
    """Copy or reverse a random lower-case string."""

    name = "copy_reverse"
    family = "copyrev"
    Options = CopyReverseOptions

    def kinds(self) -> tuple[str, ...]:
        return _mixed(self.options.op, ("copy", "reverse"))

    def max_new_tokens(self) -> int:
        return self.options.difficulty + 8


@TASKS.register("sort")
class Sort(ProceduralTask):
    """Sort a list of numbers (0..99) or letters."""

    name = "sort"
    family = "sort"
    Options = SortOptions

    def kinds(self) -> tuple[str, ...]:
        return _mixed(self.options.items, ("sort_numbers", "sort_letters"), prefix="sort_")

    def max_new_tokens(self) -> int:
        return 3 * self.options.difficulty + 8


for _d in (1, 2, 3, 4):
    register_variant(Arith, f"arith_d{_d}", fixed={"difficulty": _d})
for _op in ("copy", "reverse"):
    for _length in (8, 16):
        register_variant(CopyReverse, f"{_op}_l{_length}", fixed={"op": _op, "difficulty": _length})
for _length in (4, 8):
    register_variant(Sort, f"sort_l{_length}", fixed={"difficulty": _length})
