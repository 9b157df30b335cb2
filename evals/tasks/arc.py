"""``arc_easy`` and ``arc_challenge``: AI2 Reasoning Challenge, test split, zero-shot multiple choice.

Context ``"Question: <question>\\nAnswer:"``, continuations ``" " + choice``; ``acc`` and ``acc_norm``
(see :mod:`evals.tasks.multiple_choice`). Items have 3 to 5 choices; answer keys are letters or digits
and are mapped to the position of the matching label.

Option ``dataset`` (:mod:`evals.tasks.hub`): read the questions through ``datasets`` from a local mirror
or a cached hub dataset in the ``allenai/ai2_arc`` layout instead of the data root, e.g.
``{task: arc_easy, kwargs: {dataset: {path: allenai/ai2_arc, name: ARC-Easy}}}``; the split defaults to
``test``. ARC takes no other option.

References:
  - Clark et al. 2018, https://arxiv.org/abs/1803.05457; lm-eval ``arc_easy`` / ``arc_challenge``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from ernie5.data.text import HOW_TO_GET, arc_items, read_arc
from evals.task import TASKS, Example
from evals.tasks.hub import DatasetOption, DatasetOptions, parse_rows
from evals.tasks.multiple_choice import MultipleChoiceTask


class ARC(DatasetOption, MultipleChoiceTask):
    """ARC multiple choice (base; the subset is a class variable)."""

    version = 1
    subset: ClassVar[str]
    splits = ("test",)
    how_to_get = HOW_TO_GET["arc"]
    Options = DatasetOptions

    def __init__(self, **kwargs: Any) -> None:
        other = sorted(set(kwargs) - {"dataset"})
        if other:
            raise ValueError(f"task {self.name}: takes no options other than dataset, got {', '.join(other)}")
        super().__init__(**kwargs)

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        spec = self.dataset
        if spec is None:
            items = read_arc(data_dir, self.subset, "test")  # type: ignore[arg-type]
        else:
            items = parse_rows(spec, spec.split, arc_items)
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
