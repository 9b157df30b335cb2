"""``shakespeare_bpb``: bits per byte of the held-out Tiny Shakespeare tail (rolling log-likelihood).

The held-out tail is exactly what :func:`ernie5.data.text.shakespeare_split` holds out from training.
It is cut into documents of at most ``doc_chars`` characters at speech (blank-line) boundaries, falling
back to line boundaries for longer speeches; the documents concatenate back to the tail. Each document is
scored on its own with ``loglikelihood_rolling`` (no context across documents), and the metric is the
corpus ratio: sum of NLL (nats) / ln 2 / sum of UTF-8 bytes, with a bootstrap stderr over documents.

References:
  - lm-eval ``wikitext`` (rolling log-likelihood, ``bits_per_byte`` with ``weighted_perplexity``-style
    corpus aggregation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ernie5.data.text import HOW_TO_GET, read_shakespeare, shakespeare_split
from evals.api import Request, Response, RollingRequest, RollingResult
from evals.task import TASKS, Example, Score, Task

_SPEECH_END = re.compile(r"(?<=\n\n)")


@dataclass(frozen=True, kw_only=True)
class ShakespeareOptions:
    doc_chars: int = 2048
    """Largest document in characters (a single longer line stays whole)."""

    def __post_init__(self) -> None:
        if not 256 <= self.doc_chars <= 65536:
            raise ValueError(f"doc_chars={self.doc_chars} must be in [256, 65536]")


def split_documents(text: str, max_chars: int) -> list[str]:
    """Greedily pack speeches (or, for long ones, their lines) into documents of at most ``max_chars``;
    ``"".join(result) == text``."""
    units: list[str] = []
    for speech in _SPEECH_END.split(text):
        units.extend(speech.splitlines(keepends=True) if len(speech) > max_chars else [speech])
    docs: list[str] = []
    current = ""
    for unit in units:
        if current and len(current) + len(unit) > max_chars:
            docs.append(current)
            current = ""
        current += unit
    if current:
        docs.append(current)
    return docs


@TASKS.register("shakespeare_bpb")
class ShakespeareBPB(Task):
    """Bits per byte on the held-out 10% of Tiny Shakespeare."""

    name = "shakespeare_bpb"
    version = 1
    capability = "generation"
    metrics: ClassVar[dict[str, bool]] = {"bits_per_byte": False}
    splits = ("heldout",)
    data_files = ("tinyshakespeare/input.txt",)
    how_to_get = HOW_TO_GET["tinyshakespeare"]
    Options = ShakespeareOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        _, heldout = shakespeare_split(read_shakespeare(data_dir))
        docs = split_documents(heldout, self.options.doc_chars)
        return [Example(id=f"shakespeare-{i}", prompt=doc) for i, doc in enumerate(docs)]

    def requests(self, example: Example) -> list[Request]:
        return [RollingRequest(text=example.prompt)]

    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        if len(responses) != 1 or not isinstance(responses[0], RollingResult):
            raise ValueError(f"{self.name}/{example.id}: expected one rolling loglikelihood result")
        result = responses[0]
        return {"bits_per_byte": (-result.logprob, float(len(example.prompt.encode("utf-8"))))}
