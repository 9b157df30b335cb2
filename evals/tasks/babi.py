"""``babi_qa1``: bAbI task 1 (single supporting fact), test split, generation, exact match.

Prompt: ``num_fewshot`` solved train items, then the story so far (one sentence per line), then
``"Question: Where is Mary?\\nAnswer:"``. Generation stops at ``"\\n"``; the score is exact match of the
one-word answer after :func:`evals.metrics.normalize_answer` (case, whitespace, trailing period).

References:
  - Weston et al. 2015, https://arxiv.org/abs/1502.05698.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ernie5.data.text import HOW_TO_GET, BabiItem, read_babi_qa1
from evals.api import GenerationRequest, GenerationResult, Request, Response
from evals.metrics import exact_match
from evals.task import TASKS, Example, Score, Task

STOP = ("\n",)


@dataclass(frozen=True, kw_only=True)
class BabiOptions:
    num_fewshot: int = 2
    """Solved train items before the story."""
    max_new_tokens: int = 16
    fewshot_seed: int = 1234

    def __post_init__(self) -> None:
        if not 0 <= self.num_fewshot <= 8:
            raise ValueError(f"num_fewshot={self.num_fewshot} must be in [0, 8]")
        if not 1 <= self.max_new_tokens <= 256:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be in [1, 256]")


def _prompt(item: BabiItem) -> str:
    return "".join(f"{sentence}\n" for sentence in item.story) + f"Question: {item.question}\nAnswer:"


@TASKS.register("babi_qa1")
class BabiQA1(Task):
    """bAbI task 1 test (1,000 questions): where is a person after a short story of movements."""

    name = "babi_qa1"
    version = 1
    metrics: ClassVar[dict[str, bool]] = {"exact_match": True}
    splits = ("test", "train")
    data_files = (
        "babi_qa1/qa1_single-supporting-fact_test.txt",
        "babi_qa1/qa1_single-supporting-fact_train.txt",
    )
    how_to_get = HOW_TO_GET["babi_qa1"]
    Options = BabiOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        fewshot = ""
        if self.options.num_fewshot:
            pool = read_babi_qa1(data_dir, "train")
            shots = random.Random(self.options.fewshot_seed).sample(pool, self.options.num_fewshot)
            fewshot = "".join(f"{_prompt(s)} {s.answer}\n\n" for s in shots)
        items = read_babi_qa1(data_dir, "test")
        return [Example(id=it.id, prompt=_prompt(it), target=it.answer, fewshot=fewshot) for it in items]

    def requests(self, example: Example) -> list[Request]:
        return [
            GenerationRequest(context=example.context, max_new_tokens=self.options.max_new_tokens, stop=STOP)
        ]

    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        if len(responses) != 1 or not isinstance(responses[0], GenerationResult):
            raise ValueError(f"{self.name}/{example.id}: expected one generation result")
        return {"exact_match": exact_match(responses[0].text, example.target)}
