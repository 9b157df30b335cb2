"""``arc_easy`` and ``arc_challenge``: AI2 Reasoning Challenge, test split, zero-shot multiple choice.

Context ``"Question: <question>\\nAnswer:"``, continuations ``" " + choice``; ``acc`` and ``acc_norm``
(see :mod:`evals.tasks.multiple_choice`). Items have 3 to 5 choices; answer keys are letters or digits
and are mapped to the position of the matching label.

References:
  - Clark et al. 2018, https://arxiv.org/abs/1803.05457; lm-eval ``arc_easy`` / ``arc_challenge``.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from ernie5.data.text import HOW_TO_GET, read_arc
from evals.task import TASKS, Example
from evals.tasks.multiple_choice import MultipleChoiceTask


class ARC(MultipleChoiceTask):
    """ARC multiple choice (base; the subset is a class variable)."""

    version = 1
    subset: ClassVar[str]
    splits = ("test",)
    how_to_get = HOW_TO_GET["arc"]

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        items = read_arc(data_dir, self.subset, "test")  # type: ignore[arg-type]
        return [self.make_example(it.id, it.question, it.choices, it.answer) for it in items]


@TASKS.register("arc_easy")
class ARCEasy(ARC):
    """ARC-Easy test (2,376 questions)."""

    name = "arc_easy"
    subset = "Easy"
    data_files = ("arc/ARC-Easy-test.jsonl",)


@TASKS.register("arc_challenge")
class ARCChallenge(ARC):
    """ARC-Challenge test (1,172 questions)."""

    name = "arc_challenge"
    subset = "Challenge"
    data_files = ("arc/ARC-Challenge-test.jsonl",)
