"""``bbh_<subtask>``: BIG-Bench Hard, one registered task per subtask, generation, exact match.

Prompt: ``num_fewshot`` solved examples as ``"Q: <input>\\nA: <target>\\n\\n"``, then
``"Q: <input>\\nA:"``; generation stops at ``"\\n"`` or ``"Q:"``. Score: exact match after
:func:`evals.metrics.normalize_answer` (case, whitespace, trailing period; other punctuation such as
``"(B)"`` or ``"] )"`` is kept).

BBH has a single split and the chain-of-thought prompts were not copied, so the first
:data:`N_RESERVED` examples of each file are reserved as the few-shot pool and never evaluated. The
evaluated set is therefore the same for every ``num_fewshot`` (247 items for most subtasks).

The data carries a canary string: evaluation only, never add it to a training mixture.

References:
  - Suzgun et al. 2022, https://arxiv.org/abs/2210.09261; lm-eval ``bbh_fewshot`` / ``bbh_zeroshot``.

Deviations:
  1. Few-shot examples are the first three examples of the file (direct answers, no chain of thought),
     not the hand-written CoT prompts; they are excluded from evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ernie5.data.text import HOW_TO_GET, read_bbh
from evals.api import GenerationRequest, GenerationResult, Request, Response
from evals.metrics import exact_match
from evals.task import Example, Score, Task, register_variant

N_RESERVED = 3
STOP = ("\n", "Q:")
SUBTASKS: tuple[str, ...] = (
    "boolean_expressions",
    "causal_judgement",
    "date_understanding",
    "disambiguation_qa",
    "dyck_languages",
    "formal_fallacies",
    "geometric_shapes",
    "hyperbaton",
    "logical_deduction_five_objects",
    "logical_deduction_seven_objects",
    "logical_deduction_three_objects",
    "movie_recommendation",
    "multistep_arithmetic_two",
    "navigate",
    "object_counting",
    "penguins_in_a_table",
    "reasoning_about_colored_objects",
    "ruin_names",
    "salient_translation_error_detection",
    "snarks",
    "sports_understanding",
    "temporal_sequences",
    "tracking_shuffled_objects_five_objects",
    "tracking_shuffled_objects_seven_objects",
    "tracking_shuffled_objects_three_objects",
    "web_of_lies",
    "word_sorting",
)


@dataclass(frozen=True, kw_only=True)
class BBHOptions:
    num_fewshot: int = N_RESERVED
    """Reserved examples shown before the question (0..3)."""
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if not 0 <= self.num_fewshot <= N_RESERVED:
            raise ValueError(f"num_fewshot={self.num_fewshot} must be in [0, {N_RESERVED}]")
        if not 1 <= self.max_new_tokens <= 1024:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be in [1, 1024]")


class BBH(Task):
    """A BIG-Bench Hard subtask (base; each subtask is a registered variant)."""

    version = 1
    subtask: ClassVar[str]
    metrics: ClassVar[dict[str, bool]] = {"exact_match": True}
    splits = ("test",)
    how_to_get = HOW_TO_GET["bbh"]
    Options = BBHOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        items = read_bbh(data_dir, self.subtask)
        shots = items[: self.options.num_fewshot]
        fewshot = "".join(f"Q: {s.input}\nA: {s.target}\n\n" for s in shots)
        return [
            Example(id=it.id, prompt=f"Q: {it.input}\nA:", target=it.target, fewshot=fewshot)
            for it in items[N_RESERVED:]
        ]

    def requests(self, example: Example) -> list[Request]:
        return [
            GenerationRequest(context=example.context, max_new_tokens=self.options.max_new_tokens, stop=STOP)
        ]

    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        if len(responses) != 1 or not isinstance(responses[0], GenerationResult):
            raise ValueError(f"{self.name}/{example.id}: expected one generation result")
        return {"exact_match": exact_match(responses[0].text, example.target)}


for _subtask in SUBTASKS:
    register_variant(BBH, f"bbh_{_subtask}", subtask=_subtask, data_files=(f"bbh/{_subtask}.json",))
