"""``openbookqa``: OpenBookQA (Main), test split, zero-shot multiple choice without the open book.

Context ``"Question: <question stem>\\nAnswer:"``, continuations ``" " + choice``; ``acc`` and
``acc_norm`` (see :mod:`evals.tasks.multiple_choice`).

References:
  - Mihaylov et al. 2018, https://arxiv.org/abs/1809.02789; lm-eval ``openbookqa``.

Deviations:
  1. lm-eval uses the bare question stem as context; here it is wrapped in the same
     ``Question: ...\\nAnswer:`` template as ARC so the two science sets are prompted alike.
"""

from __future__ import annotations

from pathlib import Path

from ernie5.data.text import HOW_TO_GET, read_openbookqa
from evals.task import TASKS, Example
from evals.tasks.multiple_choice import MultipleChoiceTask


@TASKS.register("openbookqa")
class OpenBookQA(MultipleChoiceTask):
    """OpenBookQA test (500 questions, 4 choices)."""

    name = "openbookqa"
    version = 1
    splits = ("test",)
    data_files = ("openbookqa/test.tsv",)
    how_to_get = HOW_TO_GET["openbookqa"]

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        items = read_openbookqa(data_dir, "test")
        return [self.make_example(it.id, it.question, it.choices, it.answer) for it in items]
