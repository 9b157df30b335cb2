"""Multiple choice by log-likelihood: the shared scoring of ARC, OpenBookQA and similar tasks.

Each choice is scored as the continuation ``" " + choice`` after the example's context (the space
belongs to the continuation, as in lm-eval). Two metrics, as in lm-eval:

* ``acc``: the gold choice has the highest log-likelihood;
* ``acc_norm``: the gold choice has the highest log-likelihood per UTF-8 byte of the choice text
  (without the leading space), which removes the bias towards short answers.

Ties go to the first choice.
"""

from __future__ import annotations

from typing import ClassVar

from evals.api import LoglikelihoodRequest, LoglikelihoodResult, Request, Response
from evals.metrics import choice_accuracy
from evals.task import Example, Score, Task

CONTEXT_TEMPLATE = "Question: {question}\nAnswer:"


class MultipleChoiceTask(Task):
    """Base for log-likelihood multiple-choice tasks (not registered itself)."""

    capability = "understanding"
    metrics: ClassVar[dict[str, bool]] = {"acc": True, "acc_norm": True}

    @staticmethod
    def make_example(item_id: str, question: str, choices: tuple[str, ...], gold: int) -> Example:
        """An :class:`Example` with the shared ``Question: ...\\nAnswer:`` context."""
        prompt = CONTEXT_TEMPLATE.format(question=question.strip())
        return Example(id=item_id, prompt=prompt, target=choices[gold], choices=choices, gold=gold)

    def requests(self, example: Example) -> list[Request]:
        return [LoglikelihoodRequest(context=example.context, continuation=" " + c) for c in example.choices]

    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        if len(responses) != len(example.choices) or not all(
            isinstance(r, LoglikelihoodResult) for r in responses
        ):
            raise ValueError(
                f"{self.name}/{example.id}: expected {len(example.choices)} loglikelihood results"
            )
        logprobs = [r.logprob for r in responses]  # type: ignore[union-attr]
        lengths = [len(c.encode("utf-8")) for c in example.choices]
        return {
            "acc": choice_accuracy(logprobs, example.gold),
            "acc_norm": choice_accuracy(logprobs, example.gold, lengths),
        }
