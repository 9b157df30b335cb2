"""Suites: YAML data naming the tasks, the sub-models and the measurements of a sweep.

A suite is data only (no templates, no code). Example::

    name: smoke
    seed: 0
    batch_size: 16
    tasks:
      - {task: arith_d2, limit: 20}
      - {task: bbh_boolean_expressions, limit: 10, kwargs: {num_fewshot: 1}}
    subnets:
      specs: [full, k1]
      grid: {depth: [1.0, 0.5], width: [1.0, 0.5], top_k: [2, 1]}
      layers: even            # deploy selection for reduced depth
      experts: random:0       # deploy selection for reduced width
      random_baseline: true   # also score a random-initialised twin (subnet "random")
    efficiency: {enabled: true, prompt_len: 64, decode_tokens: 32, repeats: 3}
    lm_eval:
      - {task_dir: lm_eval, tasks: [local_qa], limit: 20}

Subnets are the explicit ``specs`` plus the cross product of the ``grid`` (a value of 1.0 means the
full dimension), resolved against the checkpoint by ``ernie5.subnets.spec.resolve_specs`` (the
one rule for when importance calibration is needed) and de-duplicated by the concrete sub-model
they resolve to. ``random_baseline`` adds the pseudo-subnet ``random`` (``evals.results.RANDOM_BASELINE``),
evaluated on every task like a sub-model but built by ``evals.sweep.random_twin``. ``lm_eval`` entries name
lm-eval task YAMLs in ``task_dir`` (relative to the suite file, and resolving, symlinks followed,
inside the suite's own folder or the project's ``suites/lm_eval``); their ``data_files`` may use
``{data_dir}``, which the sweep fills in with the absolute data root (lm-eval resolves relative
paths against the working directory, not the YAML).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ernie5.config import ConfigError, from_dict, read_yaml
from ernie5.model.config import ModelConfig
from ernie5.model.elastic import Subnet
from ernie5.presets import is_path
from ernie5.subnets.spec import SubnetError, SubnetSpec, parse_subnet


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskEntry:
    """One task of the suite."""

    task: str
    """Registered task name (``ernie5 tasks`` lists them)."""
    limit: int | None = None
    """Examples evaluated (a seeded subsample); None = all."""
    seed: int | None = None
    """Subsampling seed (None = the suite's seed)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Task options, e.g. ``num_fewshot``."""

    def __post_init__(self) -> None:
        _check(self.limit is None or self.limit >= 1, f"limit={self.limit} must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class SubnetGrid:
    """Cross product of dimension values (int = count, float in (0, 1] = fraction)."""

    depth: tuple[int | float, ...] = (1.0,)
    width: tuple[int | float, ...] = (1.0,)
    top_k: tuple[int | float, ...] = (1.0,)


@dataclass(frozen=True, kw_only=True, slots=True)
class SubnetsConfig:
    """Which sub-models the sweep evaluates."""

    specs: tuple[str, ...] = ("full",)
    """Explicit SubnetSpec strings."""
    grid: SubnetGrid | None = None
    """Optional grid added to ``specs``."""
    layers: str = "even"
    """Deploy selection of kept layers for grid entries (even | prefix | random:SEED | importance)."""
    experts: str = "random:0"
    """Deploy selection of kept experts for grid entries (random:SEED | importance)."""
    random_baseline: bool = False
    """Also evaluate every task on ``random``: a freshly initialised twin of the checkpoint's model
    (``torch.manual_seed(<suite seed>)``, the full architecture, the checkpoint's tokenizers and
    frozen side models), the score baseline for chance-normalised retention. Not a sub-model: no
    efficiency row, no routing record, not in the manifest's ``subnets``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EfficiencyConfig:
    """Per-subnet efficiency measurements (in the same run as the scores)."""

    enabled: bool = True
    prompt_len: int = 64
    """Prompt tokens for the prefill latency and before decoding."""
    decode_tokens: int = 32
    """Greedy tokens decoded for tokens/s."""
    repeats: int = 3
    """Median over this many repeats."""
    extract: bool = True
    """Measure on the physically extracted sub-model (its deploy form) and record its file size."""

    def __post_init__(self) -> None:
        _check(self.prompt_len >= 1, f"prompt_len={self.prompt_len} must be >= 1")
        _check(self.decode_tokens >= 2, f"decode_tokens={self.decode_tokens} must be >= 2")
        _check(self.repeats >= 1, f"repeats={self.repeats} must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class LmEvalEntry:
    """lm-eval tasks run through ``simple_evaluate`` and stored like the suite's own."""

    task_dir: str
    """Folder of lm-eval task YAMLs, relative to the suite file."""
    tasks: tuple[str, ...]
    """lm-eval task names defined there."""
    limit: int | None = None
    num_fewshot: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SuiteConfig:
    """A sweep definition."""

    name: str
    description: str = ""
    seed: int = 0
    """Default subsampling seed of every task."""
    batch_size: int = 16
    """Requests per model call."""
    tasks: tuple[TaskEntry, ...] = ()
    subnets: SubnetsConfig = field(default_factory=SubnetsConfig)
    efficiency: EfficiencyConfig = field(default_factory=EfficiencyConfig)
    routing: bool = True
    """Record expert loads per task (for the routing analysis)."""
    lm_eval: tuple[LmEvalEntry, ...] = ()

    def __post_init__(self) -> None:
        _check(bool(self.name), "name must not be empty")
        _check(self.batch_size >= 1, f"batch_size={self.batch_size} must be >= 1")
        _check(bool(self.tasks) or bool(self.lm_eval), "tasks: a suite needs at least one task")


@dataclass(frozen=True)
class LoadedSuite:
    """A parsed suite with where it came from."""

    cfg: SuiteConfig
    path: Path
    text: str

    @property
    def hash(self) -> str:
        """sha256 of the suite file's text."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def suite_names() -> list[str]:
    """Suites shipped in the ``suites`` package."""
    return sorted(p.name[:-5] for p in resources.files("suites").iterdir() if p.name.endswith(".yaml"))


def resolve_suite_path(name_or_path: str | Path) -> Path:
    """A shipped suite name or a YAML path -> the file. A path contains a ``/`` or ends in ``.yaml``
    (:func:`ernie5.presets.is_path`); anything else is a name, never looked up in the current folder."""
    if is_path(name_or_path):
        p = Path(name_or_path)
        if not p.is_file():
            raise ConfigError(f"suite file not found: {name_or_path}")
        return p
    if str(name_or_path) in suite_names():
        return Path(str(resources.files("suites") / f"{name_or_path}.yaml"))
    raise ConfigError(
        f"unknown suite {str(name_or_path)!r} (suites: {', '.join(suite_names())}; "
        "or a YAML file: a path with a '/' or ending in .yaml)"
    )


def shipped_lm_eval_dir() -> Path:
    """The project's own lm-eval task folder (``suites/lm_eval``), symlinks resolved."""
    return Path(str(resources.files("suites") / "lm_eval")).resolve()


def _check_task_dir(suite_path: Path, task_dir: str) -> None:
    """An lm-eval ``task_dir`` (and every file in it) must resolve inside the suite's own folder or the
    project's ``suites/lm_eval``: a suite is data, and a task folder may hold code lm-eval imports."""
    folder = (suite_path.parent / task_dir).resolve()
    roots = (suite_path.parent.resolve(), shipped_lm_eval_dir())
    where = f"the suite's folder {roots[0]} or {roots[1]}"
    if not folder.is_dir():
        raise ConfigError(f"{suite_path}: lm_eval.task_dir {task_dir!r} is not a folder next to the suite")
    if not any(folder.is_relative_to(r) for r in roots):
        raise ConfigError(
            f"{suite_path}: lm_eval.task_dir {task_dir!r} resolves to {folder}, outside {where}"
        )
    for f in sorted(folder.rglob("*")):
        target = f.resolve()
        if not any(target.is_relative_to(r) for r in roots):
            raise ConfigError(
                f"{suite_path}: lm_eval.task_dir {task_dir!r}: {f} links to {target}, outside {where}"
            )


def load_suite(name_or_path: str | Path) -> LoadedSuite:
    """Load and validate a suite: strict keys, known tasks (with close-name hints), valid options."""
    import evals.tasks  # noqa: F401 - registers every task
    from evals.task import TASKS

    path = resolve_suite_path(name_or_path)
    cfg = from_dict(SuiteConfig, read_yaml(path))
    for i, entry in enumerate(cfg.tasks):
        try:
            TASKS.get(entry.task)(**entry.kwargs)
        except KeyError as e:
            raise ConfigError(f"{path}: tasks[{i}]: {e.args[0]}") from None
        except ValueError as e:
            raise ConfigError(f"{path}: tasks[{i}]: {e}") from None
    for spec in cfg.subnets.specs:
        try:
            parse_subnet(spec)
        except SubnetError as e:
            raise ConfigError(f"{path}: subnets.specs: {e}") from None
    for entry in cfg.lm_eval:
        _check_task_dir(path, entry.task_dir)
    return LoadedSuite(cfg, path, path.read_text(encoding="utf-8"))


def subnet_specs(cfg: SubnetsConfig) -> list[SubnetSpec]:
    """The suite's sub-model specs: the explicit ``specs``, then the ``grid`` in product order."""
    specs = [parse_subnet(s) for s in cfg.specs]
    if cfg.grid is not None:
        for d, w, k in itertools.product(cfg.grid.depth, cfg.grid.width, cfg.grid.top_k):
            specs.append(SubnetSpec(depth=d, width=w, top_k=k, layers=cfg.layers, experts=cfg.experts))
    return specs


def distinct_subnets(subnets: list[Subnet], model: ModelConfig) -> list[Subnet]:
    """``subnets`` without repeats of the same concrete sub-model, the full model first."""
    out: list[Subnet] = []
    seen = set()
    for sub in subnets:
        key = (sub.layers, sub.experts, sub.top_k)
        if key not in seen:
            seen.add(key)
            out.append(sub)
    out.sort(key=lambda s: not s.is_full_for(model))
    return out
