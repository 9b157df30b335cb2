"""lm-eval 0.4.x bridge: any lm-eval task on any ERNIE5 sub-model, from the command line or a sweep.

* :class:`Ernie5LM` is lm-eval model ``ernie5``; ``model_args``: ``checkpoint`` (checkpoint or run folder),
  ``subnet`` (compact SubnetSpec, default ``full``), ``cache`` (our SQLite response cache, keyed by
  checkpoint *and* sub-model), ``batch_size``, ``device`` (cpu | cuda[:N]). :func:`run_lm_eval_cli` runs
  lm-eval's command line. :func:`lm_eval_units` makes a suite's ``lm_eval`` entry into sweep units
  (``limit`` is lm-eval's: the first ``limit`` documents, not a seeded subsample).
* ``--use_cache`` is refused for ``ernie5``: lm-eval's key has no model identity, so a second sub-model
  would silently get the first one's answers. The CLI rejects it with a one-line error and
  ``Ernie5LM.set_cache_hook`` (only lm-eval's ``CachingLM`` calls it) raises, which also covers
  ``simple_evaluate(use_cache=...)``. Use ``model_args cache=PATH`` instead.
* Suites are data only: a suite's task folder must lie inside the suite's folder or the shipped
  ``suites/lm_eval``; task code (``!function``, ``unsafe_code``) runs only with ``allow_code``
  (``--confirm-run-unsafe-code``), templates render in Jinja's sandbox otherwise, and every file of the
  folder enters the unit's fingerprint (:func:`lm_eval_units`). ``ernie5 lm-eval`` reads lm-eval's
  ``--confirm_run_unsafe_code`` the same way and reports user errors (an unknown task, refused code, a
  checkpoint that cannot be loaded) as one line with exit code 2 (:func:`run_lm_eval_cli`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.resources
import math
import numbers
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

from ernie5.data.root import resolve_data_dir  # noqa: E402
from ernie5.files import hash_file_into  # noqa: E402
from ernie5.store.checkpoint import load_checkpoint  # noqa: E402
from ernie5.subnets.params import count_params  # noqa: E402
from ernie5.subnets.spec import resolve_specs  # noqa: E402
from evals.adapter import Ernie5EvalModel  # noqa: E402
from evals.api import GenerationRequest, LoglikelihoodRequest, RollingRequest, add_routing  # noqa: E402
from evals.cache import CachedModel, ResponseCache  # noqa: E402
from evals.task import Evaluable, UnitResult  # noqa: E402

LM_EVAL_VERSION = importlib.metadata.version("lm-eval")
USE_CACHE_ERROR = (
    "lm-eval's --use_cache is not keyed by model, so sub-models would share answers; the "
    "ernie5 bridge caches per checkpoint and subnet itself: use --model_args ...,cache=PATH"
)
EXCERPT_CHARS = 300
CLI_CODE_FLAG = "--confirm_run_unsafe_code"
"""lm-eval's own flag, which ``ernie5 lm-eval`` also reads as consent to task code (``!function``)."""
SUITE_CODE_FLAG = "--confirm-run-unsafe-code"
"""The ``ernie5 sweep`` / ``nightly`` flag that becomes ``lm_eval_units(..., allow_code=True)``."""
_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints"}
_TASK_MANAGERS: dict[str, Any] = {}


def _inner(model: Any) -> Any:
    while isinstance(model, CachedModel):
        model = model.model
    return model


@contextlib.contextmanager
def _quiet_lm_eval():
    """lm-eval runs ``git describe`` in the working directory (its stderr leaks "not a git
    repository" outside a checkout) and draws progress bars; report our git hash and stay quiet."""
    import lm_eval.api.task as task_module
    import lm_eval.evaluator as evaluator

    from ernie5.store.runs import git_info

    saved_hash, saved_tqdm = evaluator.get_git_commit_hash, task_module.tqdm
    evaluator.get_git_commit_hash = lambda: git_info()["git_hash"]
    task_module.tqdm = functools.partial(saved_tqdm, disable=True)  # "Building contexts" bars
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = saved_hash
        task_module.tqdm = saved_tqdm


class _DeviceEvalModel(Ernie5EvalModel):
    """The adapter with its inputs moved to the model's device and the logits brought back."""

    def _run(self, inputs, real_BT, tally):
        dev = self.model.tok_emb.weight.device
        out = super()._run(inputs.to(dev), real_BT.to(dev), tally)
        out.logits_BTV = out.logits_BTV.cpu()
        return out


@register_model("ernie5")
class Ernie5LM(LM):
    """An ERNIE5 checkpoint + sub-model as an lm-eval ``LM``, answering through our EvalModel."""

    def __init__(
        self,
        checkpoint: str | None = None,
        subnet: str = "full",
        batch_size: Any = None,
        device: str | None = None,
        cache: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if not checkpoint:
            raise LmEvalUsageError("ernie5: model_args needs checkpoint=PATH (a checkpoint or run folder)")
        dev = str(device or "cpu")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", dev) or (dev != "cpu" and not torch.cuda.is_available()):
            raise LmEvalUsageError(f"ernie5: device={dev!r}: use cpu, or cuda[:N] on a machine with CUDA")
        try:  # CheckpointError, SubnetError, DataDirError: one line on the command line
            ckpt = load_checkpoint(checkpoint, device=dev)
            (sub,) = resolve_specs([str(subnet)], ckpt, resolve_data_dir(None))
        except ValueError as e:
            raise LmEvalUsageError(f"ernie5: {_one_line(e)}") from None
        bs = 16 if batch_size is None or str(batch_size).startswith("auto") else max(1, int(batch_size))
        model = (Ernie5EvalModel if dev == "cpu" else _DeviceEvalModel)(ckpt, sub, batch_size=bs)
        self._setup(CachedModel(model, ResponseCache(cache)) if cache else model)
        self._device = dev

    @classmethod
    def from_eval_model(cls, eval_model: Any) -> Ernie5LM:
        """Wrap a loaded EvalModel (our adapter, a CachedModel, a baseline) without reloading anything."""
        self = cls.__new__(cls)
        LM.__init__(self)
        self._setup(eval_model)
        return self

    def _setup(self, eval_model: Any) -> None:
        self.eval_model, self.max_len = eval_model, int(getattr(_inner(eval_model), "max_len", 2048))
        self.model_s = 0.0
        """Seconds the model spent in forwards for every answer so far."""
        self.routing: dict[int, list[int]] = {}
        """Expert loads of every answer so far (see :class:`evals.api.Answers`)."""

    def _ask(self, method: str, requests: list) -> list:
        answers = getattr(self.eval_model, method)(requests)
        self.model_s += answers.model_s
        add_routing(self.routing, answers.routing)
        return answers.results

    def set_cache_hook(self, cache_hook: Any) -> None:
        """Called only by lm-eval's CachingLM (``use_cache``), whose key ignores the sub-model: refuse."""
        raise ValueError(USE_CACHE_ERROR)

    def loglikelihood(self, requests: list) -> list[tuple[float, bool]]:  # noqa: D102
        reqs = [LoglikelihoodRequest(r.args[0], r.args[1]) for r in requests]
        return [(float(a.logprob), bool(a.is_greedy)) for a in self._ask("loglikelihood", reqs)]

    def loglikelihood_rolling(self, requests: list) -> list[float]:  # noqa: D102
        reqs = [RollingRequest(r.args[0]) for r in requests]
        return [float(a.logprob) for a in self._ask("loglikelihood_rolling", reqs)]

    def generate_until(self, requests: list) -> list[str]:  # noqa: D102
        return [a.text for a in self._ask("generate", [self._gen_request(r.args) for r in requests])]

    def _gen_request(self, args: tuple) -> GenerationRequest:
        kw, until = dict(args[1] or {}), (args[1] or {}).get("until") or ()
        max_new = int(kw.get("max_gen_toks") or 256)
        max_new = max_new if max_new < self.max_len else max(1, self.max_len // 2)  # room for a prompt
        temperature = float(kw.get("temperature", 1.0) or 0.0) if kw.get("do_sample") else 0.0
        stop = (until,) if isinstance(until, str) else tuple(until)
        return GenerationRequest(args[0], max_new_tokens=max_new, stop=stop, temperature=temperature)

    def get_model_info(self) -> dict[str, Any]:
        """Checkpoint, concrete sub-model and its parameter counts (lm-eval merges this into config)."""
        inner, info = _inner(self.eval_model), {"fingerprint": getattr(self.eval_model, "fingerprint", None)}
        ckpt, sub = getattr(inner, "ckpt", None), getattr(inner, "subnet", None)
        if ckpt is None or sub is None:
            return info
        rep, n_exp = count_params(ckpt.cfg, sub), ckpt.cfg.moe.n_experts
        return {
            **info,
            "checkpoint": str(ckpt.path),
            "checkpoint_hash": getattr(inner, "ckpt_hash", None),
            "subnet": sub.name,
            "layers": list(sub.layers),
            "top_k": sub.top_k,
            "experts_per_layer": [n_exp if e is None else len(e) for e in sub.experts],
            "active_params": rep.active_params,
            "total_params": rep.total_params,
            "activation_rate": rep.activation_rate,
        }


def run_lm_eval_cli(argv: list[str]) -> int:
    """Run lm-eval's command line on ``argv`` (no program name) with ``ernie5`` registered; its exit code.

    A user error (an unknown task, a bad option combination, a checkpoint that cannot be loaded, a task
    that needs code without ``--confirm_run_unsafe_code``) is one line ``lm-eval: error: ...`` on stderr
    and exit code 2. Without ``--confirm_run_unsafe_code``, no task outside lm-eval's own task folders
    runs Python: a ``!function`` there (``--include_path``, ``--tasks x.yaml``, ``--config``) is refused
    and every task template renders in Jinja's sandbox (see :class:`_CodeGuard`).
    """
    import lm_eval.tasks
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    cli, saved = HarnessCLI(), sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        args = cli.parse_args()  # inserts "run" for the legacy form, exactly as lm-eval does
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        sys.argv = saved
    if getattr(args, "model", None) == "ernie5":
        if getattr(args, "use_cache", None):
            print(f"lm-eval: error: {USE_CACHE_ERROR}", file=sys.stderr)
            return 2
        if not any(a.startswith("--device") for a in argv):  # lm-eval's default is cuda:0
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not any(a.startswith(("--batch_size", "-b")) for a in argv):  # lm-eval's default is 1
            args.batch_size = 16
    manager = lm_eval.tasks.TaskManager
    if _all_local(getattr(args, "tasks", None), getattr(args, "include_path", None)):
        # Every task is defined under --include_path: skip indexing lm-eval's ~15k built-in tasks (~10 s).
        lm_eval.tasks.TaskManager = functools.partial(manager, include_defaults=False)
    guard = _CodeGuard(bool(getattr(args, "confirm_run_unsafe_code", False)), CLI_CODE_FLAG)
    try:
        with guard, _config_errors_are_user_errors(guard):
            cli.execute(args)
    except LmEvalUsageError as e:
        print(f"lm-eval: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        lm_eval.tasks.TaskManager = manager
    return 0


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextlib.contextmanager
def _config_errors_are_user_errors(guard: _CodeGuard):
    """While lm-eval's ``run`` builds its configuration and resolves ``--tasks`` (no model loaded yet), its
    errors (``Tasks not found: x``, bad option combinations, an unreadable ``--config``) become
    :class:`LmEvalUsageError`; a ``confirm_run_unsafe_code`` set in a ``--config`` file reaches ``guard``."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    saved_from_cli, saved_process = EvaluatorConfig.__dict__["from_cli"], EvaluatorConfig.process_tasks
    errors = (ValueError, TypeError, OSError, yaml.YAMLError)

    def from_cli(cls, args):
        try:
            cfg = saved_from_cli.__func__(cls, args)
        except errors as e:
            raise LmEvalUsageError(_one_line(e)) from None
        guard.allow = guard.allow or bool(getattr(cfg, "confirm_run_unsafe_code", False))
        return cfg

    def process_tasks(self, *a, **k):
        try:
            return saved_process(self, *a, **k)
        except LmEvalUsageError:
            raise
        except errors as e:
            raise LmEvalUsageError(_one_line(e)) from None

    EvaluatorConfig.from_cli, EvaluatorConfig.process_tasks = classmethod(from_cli), process_tasks
    try:
        yield
    finally:
        EvaluatorConfig.from_cli, EvaluatorConfig.process_tasks = saved_from_cli, saved_process


class LmEvalUsageError(ValueError):
    """A user error of the lm-eval bridge, reported by ``ernie5 lm-eval`` as one line with exit code 2."""


class UnsafeTaskCode(LmEvalUsageError):
    """A task asked lm-eval to import Python that the user did not allow."""


def _lm_eval_task_root() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


class _CodeGuard:
    """While lm-eval runs: no task code outside lm-eval's own task folders unless ``allow``.

    * ``!function mod.fn`` in a task YAML makes lm-eval import ``mod.py`` next to the YAML (or any
      importable module) and call it. lm-eval resolves every such tag through
      ``lm_eval.tasks._yaml_loader._import_func_in_yml``; the guard wraps it and raises
      :class:`UnsafeTaskCode` (naming the module file and ``flag``) for a YAML outside lm-eval's
      installed tasks. lm-eval's own ``confirm_run_unsafe_code`` covers only tasks marked
      ``unsafe_code`` (that execute model output), not ``!function``.
    * lm-eval renders ``doc_to_text`` & co. with an unsandboxed Jinja environment, where a template can
      reach ``os`` (``{{ lipsum.__globals__ ... }}``); the guard swaps in Jinja's
      ``SandboxedEnvironment`` (same filters), so a template is data.

    ``allow`` may be set while the guard is active (a ``--config`` file can confirm).
    """

    def __init__(self, allow: bool, flag: str) -> None:
        self._allow, self.flag = bool(allow), flag
        self._saved: tuple[Any, Any] | None = None
        self._sandbox: Any = None

    @property
    def allow(self) -> bool:  # noqa: D102
        return self._allow

    @allow.setter
    def allow(self, value: bool) -> None:
        import lm_eval.utils as lm_utils

        self._allow = bool(value)
        if self._saved is not None:
            lm_utils.env = self._saved[0] if self._allow else self._sandbox

    def __enter__(self) -> _CodeGuard:
        import lm_eval.tasks._yaml_loader as loader
        import lm_eval.utils as lm_utils
        from jinja2.sandbox import SandboxedEnvironment

        env, real_import = lm_utils.env, loader._import_func_in_yml
        self._sandbox = SandboxedEnvironment(
            loader=env.loader, undefined=env.undefined, keep_trailing_newline=env.keep_trailing_newline
        )
        self._sandbox.filters.update(env.filters)
        builtin = _lm_eval_task_root()

        def import_func(qual: str, base_dir: Path) -> Any:
            if not self._allow and not Path(base_dir).resolve().is_relative_to(builtin):
                module = qual.rpartition(".")[0]
                file = Path(base_dir) / f"{module.replace('.', '/')}.py"
                what = str(file) if file.is_file() else f"module {module!r}"
                raise UnsafeTaskCode(
                    f"a task YAML in {base_dir} names `!function {qual}`, which runs Python ({what}); "
                    f"pass {self.flag} to allow task code"
                )
            return real_import(qual, base_dir)

        self._saved = (env, real_import)
        loader._import_func_in_yml = import_func
        self.allow = self._allow
        return self

    def __exit__(self, *exc: Any) -> None:
        import lm_eval.tasks._yaml_loader as loader
        import lm_eval.utils as lm_utils

        assert self._saved is not None
        lm_utils.env, loader._import_func_in_yml = self._saved
        self._saved = None


def _all_local(tasks: Any, include_path: Any) -> bool:
    """Whether every name in ``--tasks`` is a task defined by a YAML under ``--include_path``."""
    if not tasks or not include_path:
        return False
    names = {t for item in ([tasks] if isinstance(tasks, str) else tasks) for t in str(item).split(",")}
    roots = [Path(p) for p in ([include_path] if isinstance(include_path, str) else include_path)]
    try:
        return names <= {t for r in roots if r.is_dir() for t in _defined_tasks(r)}
    except ValueError:  # a YAML we cannot read: let lm-eval index everything and report it
        return False


class _Loader(yaml.SafeLoader):
    """Safe YAML loader that keeps lm-eval tags (``!function x``) as plain strings."""


_Loader.add_multi_constructor("!", lambda loader, tag, node: f"{tag} {getattr(node, 'value', '')}")


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"lm_eval: {path}: not readable YAML ({_one_line(e)})") from None


def _read_task_yaml(
    path: Path, seen: tuple[Path, ...] = (), root: Path | None = None
) -> tuple[dict, list[Path]]:
    """A task YAML merged over its ``include`` chain as lm-eval merges it, and the files read (task file
    first). With ``root`` (a suite's task folder), an include must be a file inside ``root``
    (ValueError otherwise); without it, includes that are not files are skipped."""
    cfg = _load_yaml(path)
    cfg, files = (cfg if isinstance(cfg, dict) else {}), [path]
    inc = cfg.pop("include", None)
    merged: dict = {}
    for name in [inc] if isinstance(inc, str) else inc if isinstance(inc, list) else []:
        target = Path(name) if Path(str(name)).is_absolute() else path.parent / str(name)
        if root is not None:
            resolved = target.resolve()
            if not resolved.is_relative_to(root.resolve()) or not resolved.is_file():
                raise ValueError(
                    f"lm_eval: {path}: include {name!r} must be a file inside the task folder {root}"
                )
        if not target.is_file() or path in seen or target in (*seen, path):
            continue
        base, more = _read_task_yaml(target, (*seen, path), root)
        base.pop("task_list", None)
        merged, files = {**merged, **base}, files + more
    return {**merged, **cfg}, files


def _defined_tasks(root: Path, strict: bool = False) -> dict[str, Path]:
    """Task name -> YAML file, for the single-task YAMLs under ``root`` (``strict``: includes must stay
    inside ``root``)."""
    found: dict[str, Path] = {}
    for path in sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")]):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        task = _read_task_yaml(path, root=root if strict else None)[0].get("task")
        if isinstance(task, str):
            found.setdefault(task, path)
    return found


def _task_files(task_dir: Path) -> list[Path]:
    """Every file of a suite's task folder (what is copied into the run folder and fingerprinted); a file
    that resolves outside the folder (a symlink) is a ValueError."""
    root, files = task_dir.resolve(), []
    for f in sorted(task_dir.rglob("*")):
        if not f.is_file() or _SKIP_DIRS.intersection(f.relative_to(task_dir).parts):
            continue
        if not f.resolve().is_relative_to(root):
            raise ValueError(f"lm_eval: {f} resolves to {f.resolve()}, outside the task folder {root}")
        files.append(f)
    return files


def _tags(node: yaml.Node, seen: set[int] | None = None) -> Iterator[yaml.Node]:
    """Every node of a composed YAML document with a local tag (``!function``, ``!anything``)."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if node.tag.startswith("!"):
        yield node
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            yield from _tags(k, seen)
            yield from _tags(v, seen)
    elif isinstance(node, yaml.SequenceNode):
        for v in node.value:
            yield from _tags(v, seen)


def _refuse_code(task_dir: Path, files: list[Path]) -> None:
    """ValueError naming the first file of ``task_dir`` whose tasks would run Python, and the flag."""
    checked: set[Path] = set()
    for path in (f for f in files if f.suffix in (".yaml", ".yml")):
        cfg, chain = _read_task_yaml(path, root=task_dir)
        for f in (f for f in chain if f not in checked):
            checked.add(f)
            try:
                docs = list(yaml.compose_all(f.read_text(encoding="utf-8"), Loader=yaml.SafeLoader))
            except (yaml.YAMLError, UnicodeDecodeError) as e:
                raise ValueError(f"lm_eval: {f}: not readable YAML ({_one_line(e)})") from None
            for node in (n for doc in docs if doc is not None for n in _tags(doc)):
                module = str(node.value).rpartition(".")[0] if isinstance(node.value, str) else ""
                code = f.parent / f"{module.replace('.', '/')}.py"
                runs = f"runs {code}" if module and code.is_file() else "runs Python"
                raise ValueError(
                    f"lm_eval: {f}: `{node.tag} {node.value}` {runs}; suites are data only: pass "
                    f"{SUITE_CODE_FLAG} to run task code"
                )
        if cfg.get("unsafe_code"):
            raise ValueError(
                f"lm_eval: {path}: unsafe_code is set (the task executes model-written code); pass "
                f"{SUITE_CODE_FLAG} to run it"
            )


def _fill(ref: str, data_dir: str | Path | None) -> Path | None:
    if "{data_dir}" not in ref:
        return Path(ref)
    return None if data_dir is None else Path(ref.replace("{data_dir}", str(Path(data_dir).resolve())))


def _excerpt(text: str, n: int = EXCERPT_CHARS) -> str:
    return text if len(text) <= n else f"{text[: n // 2]} [...] {text[-n // 2 :]}"


def _num(v: Any) -> float:
    return float(v) if isinstance(v, numbers.Real) else math.nan  # stderr may be "N/A"; numpy -> float


class LmEvalUnit(Evaluable):
    """One lm-eval task of a suite's ``lm_eval`` entry, evaluated through ``simple_evaluate``."""

    modality = "text"
    capability = "understanding"

    def __init__(
        self,
        lm_eval_task: str,
        yaml_path: Path,
        task_dir: Path,
        num_fewshot: int | None = None,
        *,
        allow_code: bool = False,
    ):
        """The task ``lm_eval_task`` defined by ``yaml_path`` in the folder ``task_dir``.

        Raises:
            ValueError: a file of ``task_dir`` resolves outside it, an include leaves it, or (unless
                ``allow_code``) a task YAML there needs code (see :func:`lm_eval_units`).
        """
        self.lm_eval_task, self.task_dir, self.allow_code = lm_eval_task, task_dir, bool(allow_code)
        self.name = "lmeval-" + re.sub(r"[^A-Za-z0-9_.-]", "_", lm_eval_task)
        task_files = _task_files(task_dir)
        if not self.allow_code:
            _refuse_code(task_dir, task_files)
        cfg = _read_task_yaml(yaml_path, root=task_dir)[0]
        files = (cfg.get("dataset_kwargs") or {}).get("data_files") or []  # str | list | split -> str | list
        self._refs = [
            f
            for v in (files.values() if isinstance(files, dict) else [files])
            for f in ([v] if isinstance(v, str) else v)
        ]
        self.version = int(_num((cfg.get("metadata") or {}).get("version", 0)) or 0)
        filters = [f.get("name", "none") for f in cfg.get("filter_list") or []] or ["none"]
        self.metrics: dict[str, bool] = {
            m["metric"] + ("" if f == "none" else f"_{f}"): bool(m.get("higher_is_better", True))
            for m in cfg.get("metric_list") or []
            if isinstance(m, dict)
            for f in filters
        }
        self._kwargs = {"lm_eval_task": lm_eval_task, "num_fewshot": num_fewshot, "lm_eval": LM_EVAL_VERSION}

    @property
    def kwargs(self) -> dict[str, Any]:  # noqa: D102
        return self._kwargs

    def available(self, data_dir: str | Path | None) -> tuple[bool, str]:
        """``(True, "")`` when every data file the YAML names exists, else a one-line reason."""
        for ref in self._refs:
            path = _fill(ref, data_dir)
            if path is None:
                return False, f"lm-eval task {self.lm_eval_task}: no data root set for {ref}"
            if not path.is_file():
                return False, f"lm-eval task {self.lm_eval_task}: data file not found: {path}"
        return True, ""

    def fingerprint_data(self, data_dir: str | Path | None) -> str:
        """sha256 over every file of the task folder (YAML and code: what is copied into the run folder)
        and the bytes of the task's data files, so a changed file never reuses stale results."""
        digest = hashlib.sha256()
        for path in _task_files(self.task_dir):
            hash_file_into(digest, path.relative_to(self.task_dir).as_posix(), path)
        digest.update(b"\0data\0")
        for ref in self._refs:
            path = _fill(ref, data_dir)
            if path is None or not path.is_file():
                raise FileNotFoundError(f"lm-eval task {self.lm_eval_task}: missing {ref}")
            hash_file_into(digest, ref, path)
        return digest.hexdigest()

    def _task_manager(self, data_dir: str | Path | None, work_dir: Path) -> Any:
        """Copy the task folder with ``{data_dir}`` filled in (absolute), removing files of an earlier
        copy that the folder no longer has; one TaskManager per copy and content."""
        from lm_eval.tasks import TaskManager

        root = str(Path(data_dir).resolve()).encode() if data_dir is not None else None
        src = self.task_dir.resolve()
        dst = Path(work_dir).resolve() / f"{src.name}-{hashlib.sha256(str(src).encode()).hexdigest()[:8]}"
        digest, copied = hashlib.sha256(), set()
        for f in _task_files(src):
            out, data = dst / f.relative_to(src), f.read_bytes()
            if f.suffix in (".yaml", ".yml") and root is not None:
                data = data.replace(b"{data_dir}", root)
            copied.add(out)
            digest.update(f.relative_to(src).as_posix().encode() + b"\0" + hashlib.sha256(data).digest())
            if not out.is_file() or out.read_bytes() != data:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(data)
        for stale in [f for f in dst.rglob("*") if f.is_file() and f not in copied]:
            stale.unlink()
        key = f"{dst}\0{digest.hexdigest()}"
        if key not in _TASK_MANAGERS:
            _TASK_MANAGERS[key] = TaskManager(include_path=str(dst), include_defaults=False)
        return _TASK_MANAGERS[key]

    def evaluate(
        self, model: Any, *, data_dir: str | Path | None, limit: int | None, seed: int, work_dir: Path
    ) -> UnitResult:
        """Evaluate ``model`` (an EvalModel) with lm-eval's ``simple_evaluate``."""
        from lm_eval import simple_evaluate
        from lm_eval.loggers import EvaluationTracker

        ok, reason = self.available(data_dir)
        if not ok:
            raise FileNotFoundError(reason)
        task, tm = self.lm_eval_task, self._task_manager(data_dir, work_dir)
        lm = Ernie5LM.from_eval_model(model)
        with _quiet_lm_eval(), _CodeGuard(self.allow_code, SUITE_CODE_FLAG), _sandbox_errors(task):
            out = simple_evaluate(
                model=lm,
                tasks=[task],
                task_manager=tm,
                limit=limit,
                num_fewshot=self.kwargs["num_fewshot"],
                log_samples=True,
                use_cache=None,
                bootstrap_iters=1000,
                evaluation_tracker=EvaluationTracker(),
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
                confirm_run_unsafe_code=self.allow_code,
            )
        res, higher = out["results"][task], out.get("higher_is_better", {}).get(task, {})
        n = int((out.get("n-samples", {}).get(task) or {}).get("effective", 0))
        metrics = {}
        for metric, flt in (k.split(",", 1) for k in res if "," in k and "_stderr," not in k):
            metrics[metric if flt == "none" else f"{metric}_{flt}"] = {
                "value": _num(res[f"{metric},{flt}"]),
                "stderr": _num(res.get(f"{metric}_stderr,{flt}")),
                "n": n,
                "higher_is_better": bool(higher.get(metric, self.metrics.get(metric, True))),
            }
        self.metrics = {name: m["higher_is_better"] for name, m in metrics.items()}
        samples = _samples(out.get("samples", {}).get(task, []))
        return UnitResult(metrics, n, samples, lm.model_s, lm.routing)


def _samples(logged: list[dict]) -> list[dict]:
    """lm-eval's logged samples (one per doc and filter) as ours: one per doc, metrics per filter."""
    by_doc: dict[str, dict] = {}
    for s in logged:
        rec = by_doc.setdefault(str(s["doc_id"]), {"id": str(s["doc_id"]), "scores": {}, "sample": {}})
        suffix = "" if s.get("filter", "none") == "none" else f"_{s['filter']}"
        for m, v in ((m, s.get(m)) for m in s.get("metrics", [])):  # a corpus metric's parts stay a list
            rec["scores"][m + suffix] = [_num(x) for x in v] if isinstance(v, list | tuple) else _num(v)
        args, resps, target = s.get("arguments") or [], s.get("filtered_resps") or [], s.get("target")
        sample = rec["sample"]
        if not sample:
            sample["prompt"] = _excerpt(str(args[0][0])) if args and args[0] else ""
            if len(args) > 1 and isinstance(target, int) and 0 <= target < len(args):  # multiple choice
                sample["target"] = str(args[target][1]).strip()
            else:
                sample["target"] = target if isinstance(target, int | float) else _excerpt(str(target))
        if resps and all(isinstance(r, list | tuple) and r and isinstance(r[0], float | int) for r in resps):
            lps = [float(r[0]) for r in resps]  # one (logprob, is_greedy) per choice
            best = max(range(len(lps)), key=lps.__getitem__)
            sample["logprobs"] = [round(x, 4) for x in lps]
            sample["prediction" + suffix] = str(args[best][1]).strip() if best < len(args) else str(best)
        else:
            sample["prediction" + suffix] = _excerpt(str(resps[0] if resps else ""))
            sample.setdefault("output", _excerpt(str(((s.get("resps") or [[""]])[0] or [""])[0])))  # raw
    return list(by_doc.values())


@contextlib.contextmanager
def _sandbox_errors(task: str):
    """A template stopped by Jinja's sandbox (see :class:`_CodeGuard`) as a one-line ValueError."""
    from jinja2.exceptions import SecurityError

    try:
        yield
    except SecurityError as e:
        raise ValueError(
            f"lm-eval task {task}: a template tried to reach Python ({_one_line(e)}); templates are data "
            f"unless {SUITE_CODE_FLAG} is given"
        ) from None


def shipped_task_dir() -> Path:
    """The project's shipped lm-eval task folder (``suites/lm_eval`` of the installed ``suites`` package)."""
    return Path(str(importlib.resources.files("suites") / "lm_eval")).resolve()


def lm_eval_units(entry: Any, suite_dir: Path, *, allow_code: bool = False) -> list[LmEvalUnit]:
    """One unit per task of a suite's ``lm_eval`` entry (``task_dir`` is relative to ``suite_dir``).

    Suites are data only. ``task_dir`` must resolve (symlinks followed) to a folder inside ``suite_dir``
    or inside the shipped :func:`shipped_task_dir`, every file in it must stay inside it, and an
    ``include`` must name a file inside it. Unless ``allow_code`` (``--confirm-run-unsafe-code`` of
    ``ernie5 sweep`` / ``nightly``), a folder whose task YAMLs need code is refused: any ``!function``
    tag (lm-eval would import the ``.py`` it names and run it) in a YAML or its ``include`` chain, or
    ``unsafe_code: true`` (a task that executes model output); and while the units run, task templates
    render in Jinja's sandbox and any ``!function`` lm-eval meets is refused (:class:`_CodeGuard`).

    Raises:
        ValueError: one line naming the ``task_dir`` or the file and the rule (or the flag) it breaks.
    """
    suite_root, shipped = Path(suite_dir).resolve(), shipped_task_dir()
    task_dir = (Path(suite_dir) / entry.task_dir).resolve()
    if not task_dir.is_dir() or not any(task_dir.is_relative_to(r) for r in (suite_root, shipped)):
        raise ValueError(
            f"lm_eval: task_dir {entry.task_dir!r} (-> {task_dir}) must be a folder inside the suite's "
            f"folder {suite_root} or the shipped {shipped}"
        )
    found = _defined_tasks(task_dir, strict=True)
    missing = [t for t in entry.tasks if t not in found]
    if missing:
        raise ValueError(
            f"lm_eval: task(s) {', '.join(missing)} not defined in {task_dir} "
            f"(found: {', '.join(sorted(found)) or 'none'})"
        )
    return [LmEvalUnit(t, found[t], task_dir, entry.num_fewshot, allow_code=allow_code) for t in entry.tasks]
