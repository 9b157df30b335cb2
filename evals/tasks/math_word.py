"""``gsm8k`` and ``svamp``: math word problems, generation, exact match of the final number.

Prompt: ``num_fewshot`` solved train problems, then ``"Question: <problem>\\nAnswer:"``. Few-shot problems
are drawn once per task instance from the train split with ``fewshot_seed`` (the same shots for every
example; ``seed`` only picks the evaluated subset). Generation is greedy and stops at ``"\\n\\n"`` or
``"Question:"``. The score compares :func:`evals.answers.extract_final_number` of the output (the number
after ``####`` if present, else the last number) with the reference number.

GSM8K shots show the worked solution (calculator annotations ``<<..>>`` removed) and ``#### N``; SVAMP has
no solutions, so its shots show the bare number. SVAMP's train/test split is the hash split documented in
:mod:`ernie5.data.text`.

GSM8K option ``dataset`` (:mod:`evals.tasks.hub`): read the problems through ``datasets`` from a local
mirror or a cached hub dataset in the ``openai/gsm8k`` layout instead of the data root, e.g.
``{task: gsm8k, kwargs: {dataset: {path: openai/gsm8k, name: main}}}``. The evaluated split defaults to
``test``; the few-shot pool is the dataset's ``train`` split (not read when ``num_fewshot`` is 0).

References:
  - Cobbe et al. 2021, https://arxiv.org/abs/2110.14168; lm-eval ``gsm8k`` (5-shot, ``flexible-extract``).
  - Patel et al. 2021, https://arxiv.org/abs/2103.07191 (SVAMP).
"""

from __future__ import annotations

import random
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ernie5.data.text import (
    HOW_TO_GET,
    MathItem,
    gsm8k_items,
    read_gsm8k,
    read_svamp,
    strip_calculator_annotations,
)
from evals.answers import extract_final_number
from evals.api import GenerationRequest, GenerationResult, Request, Response
from evals.task import TASKS, Example, Score, Task
from evals.tasks.hub import DatasetOption, as_spec, parse_rows

STOP = ("\n\n", "Question:")


@dataclass(frozen=True, kw_only=True)
class MathOptions:
    num_fewshot: int = 5
    """Solved train problems before the question."""
    max_new_tokens: int = 256
    fewshot_seed: int = 1234
    """Seed of the few-shot draw (independent of the subsampling seed)."""

    def __post_init__(self) -> None:
        if not 0 <= self.num_fewshot <= 16:
            raise ValueError(f"num_fewshot={self.num_fewshot} must be in [0, 16]")
        if not 1 <= self.max_new_tokens <= 4096:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be in [1, 4096]")


@dataclass(frozen=True, kw_only=True)
class GSM8KOptions(MathOptions):
    dataset: Any = None
    """None (the data root), or a mapping of :class:`evals.tasks.hub.DatasetSpec` fields; held as a spec."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "dataset", as_spec(self.dataset))
        if self.dataset is not None and self.dataset.split == "train" and self.num_fewshot:
            raise ValueError(
                "dataset.split='train' is the few-shot pool; evaluate another split or set num_fewshot: 0"
            )


def _question(text: str) -> str:
    return f"Question: {text.strip()}\nAnswer:"


class MathWordTask(Task):
    """Base for final-number word problems (not registered itself)."""

    version = 1
    metrics: ClassVar[dict[str, bool]] = {"exact_match": True}
    splits = ("test", "train")
    Options = MathOptions

    @abstractmethod
    def _items(self, data_dir: str | Path | None, split: str) -> list[MathItem]:
        """Problems of ``split`` (``"train"`` or ``"test"``), in file order."""

    @abstractmethod
    def _solution(self, item: MathItem) -> str:
        """The answer text of a few-shot shot, after ``"Answer:"``."""

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        fewshot = ""
        if self.options.num_fewshot:
            pool = self._items(data_dir, "train")
            random.Random(self.options.fewshot_seed).shuffle(pool)
            shots = pool[: self.options.num_fewshot]
            fewshot = "".join(f"{_question(s.question)} {self._solution(s)}\n\n" for s in shots)
        return [
            Example(id=it.id, prompt=_question(it.question), target=it.answer, fewshot=fewshot)
            for it in self._items(data_dir, "test")
        ]

    def requests(self, example: Example) -> list[Request]:
        return [
            GenerationRequest(context=example.context, max_new_tokens=self.options.max_new_tokens, stop=STOP)
        ]

    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        if len(responses) != 1 or not isinstance(responses[0], GenerationResult):
            raise ValueError(f"{self.name}/{example.id}: expected one generation result")
        predicted = extract_final_number(responses[0].text)
        return {
            "exact_match": float(predicted is not None and predicted == extract_final_number(example.target))
        }

    def describe_sample(self, example: Example, responses: list[Response], scores: dict[str, Score]) -> dict:
        out = super().describe_sample(example, responses, scores)
        text = responses[0].text if responses and isinstance(responses[0], GenerationResult) else ""
        out["extracted"] = extract_final_number(text)
        return out


@TASKS.register("gsm8k")
class GSM8K(DatasetOption, MathWordTask):
    """GSM8K test (1,319 problems), 5-shot by default with worked solutions."""

    name = "gsm8k"
    data_files = ("gsm8k/test.jsonl", "gsm8k/train.jsonl")
    how_to_get = HOW_TO_GET["gsm8k"]
    Options = GSM8KOptions

    def dataset_splits(self) -> tuple[str, ...]:
        evaluated = super().dataset_splits()
        return evaluated + ("train",) if evaluated and self.options.num_fewshot else evaluated

    def _items(self, data_dir: str | Path | None, split: str) -> list[MathItem]:
        spec = self.dataset
        if spec is None:
            return read_gsm8k(data_dir, split)  # type: ignore[arg-type]
        which = spec.split if split == "test" else split
        return parse_rows(spec, which, lambda rows, where: gsm8k_items(rows, which, where))

    def _solution(self, item: MathItem) -> str:
        return f"{strip_calculator_annotations(item.solution)}\n#### {item.answer}"


@TASKS.register("svamp")
class SVAMP(MathWordTask):
    """SVAMP hash-split test (784 problems), 5-shot by default with bare answers."""

    name = "svamp"
    data_files = ("svamp/SVAMP.json",)
    how_to_get = HOW_TO_GET["svamp"]

    def _items(self, data_dir: str | Path | None, split: str) -> list[MathItem]:
        return read_svamp(data_dir, split)  # type: ignore[arg-type]

    def _solution(self, item: MathItem) -> str:
        return item.answer
