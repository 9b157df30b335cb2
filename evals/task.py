"""The :class:`Task` base class, the :class:`Example` record and the ``TASKS`` registry.

What a sweep unit evaluates is an :class:`Evaluable`: a registered :class:`Task`, or an lm-eval
task (``evals.lm_eval.unit.LmEvalUnit``). Both answer :meth:`Evaluable.evaluate` with a
:class:`UnitResult`; the sweep never asks which kind it holds.

A task turns dataset items into :class:`Example` s, each example into model requests
(:mod:`evals.api`), and the responses into per-example metric values, which :meth:`Task.aggregate`
reduces to ``(value, stderr)``. The flow, for every example::

    requests = task.requests(example); responses = model.<kind>(requests)
    scores = task.score(example, responses)                     # {"acc": 1.0, ...}
    value, stderr = task.aggregate("acc", [scores["acc"] for each example])

Tasks are small classes registered by name; ``evals/tasks/__init__.py`` imports every task module.
A task is built from suite kwargs (``Task(num_fewshot=3)``), checked strictly against its ``Options``
dataclass. Fixed-option variants (``arith_d4`` = ``arith`` with ``difficulty=4``) are registered with
:func:`register_variant` and refuse to have their fixed options overridden.

Conventions: the data root is used as given (resolve it with ``ernie5.data.resolve_data_dir`` at the
entry point); example ids are stable strings, unique within a task, used to pair samples across runs;
``version`` is bumped whenever prompts or scoring change and is recorded in every result.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from ernie5.config import ConfigError, from_dict, to_dict
from ernie5.data.root import DataMissing, require_file
from ernie5.files import hash_file_into
from ernie5.registry import Registry
from ernie5.runtime.packages import missing_reason
from evals.api import (
    REQUEST_KINDS,
    GenerationResult,
    LoglikelihoodResult,
    Request,
    Response,
    RollingResult,
    add_routing,
)
from evals.metrics import (
    argmax,
    bootstrap_stderr,
    corpus_bits_per_byte,
    corpus_error_rate,
    mean_stderr,
)

Modality = Literal["text", "image", "video", "audio"]
Capability = Literal["understanding", "generation"]
"""``understanding``: answer about an input of the modality; ``generation``: produce the modality
(likelihood of held-out text counts as text generation)."""
Score = float | tuple[float, ...]
"""A per-example metric value, or the components of a corpus-level metric (``(nll_nats, n_bytes)``)."""

CORPUS_METRICS: dict[str, Callable[[list[Any]], float]] = {
    "bits_per_byte": corpus_bits_per_byte,
    "wer": corpus_error_rate,
    "cer": corpus_error_rate,
}
"""Metrics aggregated over the whole corpus from per-example components, with a bootstrap stderr."""
BOOTSTRAP_ITERS = 1000
EXCERPT_CHARS = 300

T = TypeVar("T")
TaskT = TypeVar("TaskT", bound="type[Task]")

TASKS: Registry[type[Task]] = Registry("task")
"""Every evaluation task by name; filled by importing :mod:`evals.tasks`."""


@dataclass(frozen=True)
class Example:
    """One evaluation item, in the shape every task shares."""

    id: str
    """Stable and unique within the task; pairs samples across runs."""
    prompt: str
    """The item's own text (question, story, document), without any few-shot prefix."""
    target: str = ""
    """Reference answer (generation) or the gold choice's text (multiple choice)."""
    choices: tuple[str, ...] = ()
    gold: int = -1
    """Index of the correct choice; -1 when there are no choices."""
    fewshot: str = ""
    """Few-shot prefix placed before ``prompt`` (the same for every example of a task instance)."""

    @property
    def context(self) -> str:
        """What the model is conditioned on: ``fewshot + prompt``."""
        return self.fewshot + self.prompt


@dataclass(frozen=True, kw_only=True)
class NoOptions:
    """The task takes no options."""


def select(items: Sequence[T], limit: int | None, seed: int, salt: str) -> list[T]:
    """All ``items`` in order if ``limit`` is None; else the first ``limit`` of a shuffle seeded by
    ``(salt, seed)``, so a smaller limit selects a prefix of a larger one."""
    if limit is None:
        return list(items)
    if limit < 0:
        raise ValueError(f"limit={limit} must be >= 0")
    order = list(range(len(items)))
    random.Random(f"{salt}:{seed}").shuffle(order)
    return [items[i] for i in order[:limit]]


def _excerpt(text: str, n: int = EXCERPT_CHARS) -> str:
    if len(text) <= n:
        return text
    half = n // 2
    return f"{text[:half]} [...] {text[-half:]}"


def _jsonable(value: Score) -> float | list[float]:
    return list(value) if isinstance(value, tuple) else value


class TaskInputError(ValueError):
    """A task whose requests the evaluated model cannot answer (no such method)."""


@dataclass
class UnitResult:
    """What evaluating one task on one model gave."""

    metrics: dict[str, dict[str, Any]]
    """Metric -> ``{"value", "stderr", "n", "higher_is_better"}``."""
    n_examples: int
    samples: list[dict]
    """One JSON-able record per example (``{"id", "scores", "sample"}``)."""
    model_s: float = 0.0
    """Seconds the model spent in forwards answering (0 for answers from the response cache)."""
    routing: dict[int, list[int]] = field(default_factory=dict)
    """MoE layer -> routed pairs per expert over the real tokens of the answers computed here."""


class Evaluable(ABC):
    """What a sweep unit evaluates on a model: metadata, data checks and :meth:`evaluate`."""

    name: str
    version: int
    modality: Modality
    capability: Capability
    metrics: dict[str, bool]
    """Metric -> higher is better; the primary metric first."""
    requires: tuple[str, ...] = ()
    """Model capabilities the task needs beyond text: ``vision`` (a vision tokenizer and module),
    ``refiner`` (a cascaded refiner), ``audio`` (an audio codec and module). A sweep records the
    task as skipped on a model without them."""

    @property
    @abstractmethod
    def kwargs(self) -> dict[str, Any]:
        """The resolved options as a plain mapping (for results files and fingerprints)."""

    @abstractmethod
    def available(self, data_dir: str | Path | None) -> tuple[bool, str]:
        """``(True, "")`` if everything the task reads is present, else ``(False, one-line reason)``."""

    @abstractmethod
    def fingerprint_data(self, data_dir: str | Path | None) -> str:
        """sha256 over everything the task reads ("" for procedural tasks)."""

    @abstractmethod
    def evaluate(
        self, model: Any, *, data_dir: str | Path | None, limit: int | None, seed: int, work_dir: Path
    ) -> UnitResult:
        """Evaluate ``model`` (an :class:`~evals.api.EvalModel`) on ``limit`` examples drawn with
        ``seed``; ``work_dir`` is scratch space the task may use."""


class Task(Evaluable):
    """Base class: metadata as class variables, options as a frozen dataclass, four small methods."""

    name: ClassVar[str]
    version: ClassVar[int]
    modality: ClassVar[Modality] = "text"
    capability: ClassVar[Capability] = "understanding"
    metrics: ClassVar[dict[str, bool]]
    """Metric -> higher is better; the primary metric first. The one place a metric's direction is
    declared: results carry it (``higher_is_better``) and reports and comparisons read it from there."""
    splits: ClassVar[tuple[str, ...]]
    """Splits read, the evaluated one first (``"generated"`` for procedural tasks)."""
    data_files: ClassVar[tuple[str, ...]] = ()
    """Files read, relative to the data root; empty for procedural tasks."""
    how_to_get: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()
    packages: ClassVar[tuple[str, ...]] = ()
    """Optional Python packages the scoring imports (``jiwer`` for WER): without one the task is
    skipped, the reason naming it (:func:`ernie5.runtime.packages.missing_reason`)."""
    Options: ClassVar[type] = NoOptions
    """Frozen dataclass of the task's kwargs; ``__post_init__`` checks ranges."""
    fixed: ClassVar[dict[str, Any]] = {}
    """Options pinned by a registered variant."""

    def __init__(self, **kwargs: Any) -> None:
        pinned = sorted(set(kwargs) & set(self.fixed))
        if pinned:
            setting = ", ".join(f"{k}={self.fixed[k]!r}" for k in pinned)
            raise ValueError(
                f"task {self.name}: {setting} is fixed by this variant; use the base task to change it"
            )
        if kwargs and not fields(self.Options):
            raise ValueError(f"task {self.name}: takes no options, got {', '.join(sorted(kwargs))}")
        try:
            self.options = from_dict(self.Options, {**self.fixed, **kwargs})
        except ConfigError as e:
            raise ValueError(f"task {self.name}: {e}") from None

    @property
    def kwargs(self) -> dict[str, Any]:
        """The resolved options as a plain mapping (for results files)."""
        return to_dict(self.options)

    def available(self, data_dir: str | Path | None) -> tuple[bool, str]:
        """``(True, "")`` if every package and data file is present, else ``(False, one-line reason)``."""
        if why := missing_reason(*self.packages):
            return False, why
        for relpath in self.data_files:
            try:
                require_file(data_dir, relpath, self.how_to_get)
            except DataMissing as e:
                return False, str(e)
        return True, ""

    def fingerprint_data(self, data_dir: str | Path | None) -> str:
        """sha256 over the names and bytes of the data files ("" for procedural tasks)."""
        if not self.data_files:
            return ""
        digest = hashlib.sha256()
        for relpath in self.data_files:
            hash_file_into(digest, relpath, require_file(data_dir, relpath, self.how_to_get))
        return digest.hexdigest()

    @abstractmethod
    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        """Every example of the evaluated split, in file order."""

    def examples(
        self, data_dir: str | Path | None, *, limit: int | None = None, seed: int = 0
    ) -> list[Example]:
        """The examples to evaluate: all of them, or a seeded subsample of ``limit`` (see :func:`select`)."""
        return select(self.all_examples(data_dir), limit, seed, salt=self.name)

    @abstractmethod
    def requests(self, example: Example) -> list[Request]:
        """The model calls needed to score ``example`` (all of one kind)."""

    @abstractmethod
    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        """Per-example value of every metric in ``metrics``."""

    def aggregate(self, metric: str, values: Sequence[Score], seed: int = 0) -> tuple[float, float]:
        """``(value, stderr)``: mean and closed-form stderr, or for corpus metrics the corpus value and a
        seeded bootstrap stderr."""
        if not values:
            raise ValueError(f"task {self.name}: no values to aggregate for {metric}")
        if metric in CORPUS_METRICS:
            fn = CORPUS_METRICS[metric]
            return fn(list(values)), bootstrap_stderr(fn, list(values), seed=seed, n=BOOTSTRAP_ITERS)
        return mean_stderr([float(v) for v in values])  # type: ignore[arg-type]

    def evaluate(
        self, model: Any, *, data_dir: str | Path | None, limit: int | None, seed: int, work_dir: Path
    ) -> UnitResult:
        """Examples -> requests -> one model call per request kind -> scores -> aggregates.

        Raises:
            TaskInputError: the model has no method for a kind of request the task makes.
        """
        examples = self.examples(data_dir, limit=limit, seed=seed)
        per_example = [self.requests(ex) for ex in examples]
        flat = [(i, j, r) for i, reqs in enumerate(per_example) for j, r in enumerate(reqs)]
        responses: list[list] = [[None] * len(reqs) for reqs in per_example]
        model_s, routing = 0.0, {}
        for kind in REQUEST_KINDS:
            method = kind.method
            group = [(i, j, r) for i, j, r in flat if isinstance(r, kind.request)]
            if not group:
                continue
            if not hasattr(model, method):
                raise TaskInputError(f"task {self.name} needs a model with {method}(); this one has none")
            answers = getattr(model, method)([r for _, _, r in group])
            for (i, j, _), a in zip(group, answers.results, strict=True):
                responses[i][j] = a
            model_s += answers.model_s
            add_routing(routing, answers.routing)
        unanswered = {type(r).__name__ for i, j, r in flat if responses[i][j] is None}
        if unanswered:
            raise TaskInputError(f"task {self.name}: no model method answers {', '.join(sorted(unanswered))}")
        scores = [self.score(ex, resp) for ex, resp in zip(examples, responses)]
        metrics = {}
        for metric, higher in self.metrics.items():
            value, stderr = self.aggregate(metric, [s[metric] for s in scores], seed=seed)
            metrics[metric] = {"value": value, "stderr": stderr, "n": len(scores), "higher_is_better": higher}
        samples = [
            {
                "id": ex.id,
                "scores": {k: _jsonable(v) for k, v in sc.items()},
                "sample": self.describe_sample(ex, resp, sc),
            }
            for ex, resp, sc in zip(examples, responses, scores)
        ]
        return UnitResult(metrics, len(examples), samples, model_s, routing)

    def describe_sample(self, example: Example, responses: list[Response], scores: dict[str, Score]) -> dict:
        """A short JSON-able view of one scored example for per-sample logs and report drill-downs."""
        out: dict[str, Any] = {"id": example.id, "prompt": _excerpt(example.prompt), "target": example.target}
        first = responses[0] if responses else None
        if example.choices and all(isinstance(r, LoglikelihoodResult) for r in responses):
            logprobs = [r.logprob for r in responses]  # type: ignore[union-attr]
            out["choices"] = list(example.choices)
            out["logprobs"] = [round(lp, 4) for lp in logprobs]
            out["prediction"] = example.choices[argmax(logprobs)]
        elif isinstance(first, GenerationResult):
            out["prediction"] = _excerpt(first.text)
        elif isinstance(first, RollingResult):
            out["prediction"] = f"logprob {first.logprob:.2f} over {first.n_tokens} tokens"
        out["scores"] = {k: _jsonable(v) for k, v in scores.items()}
        return out


def register_variant(
    base: TaskT, name: str, *, fixed: dict[str, Any] | None = None, **class_vars: Any
) -> TaskT:
    """Register a subclass of ``base`` as ``name`` with options in ``fixed`` pinned and class variables
    (``data_files``, ...) overridden. Explicit and greppable: one call per variant."""
    pinned = {**base.fixed, **(fixed or {})}
    from_dict(base.Options, pinned)  # a bad variant fails at import, not at evaluation time
    summary = ", ".join(f"{k}={v!r}" for k, v in (fixed or {}).items())
    doc = (base.__doc__ or base.__name__).strip().splitlines()[0]
    attrs = {
        "name": name,
        "fixed": pinned,
        "__doc__": f"{doc} Variant {name!r}{': ' + summary if summary else ''}.",
        "__module__": base.__module__,
        **class_vars,
    }
    cls_name = "".join(part.capitalize() for part in name.split("_"))
    return TASKS.register(name)(type(cls_name, (base,), attrs))
