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
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import math
import numbers
import os
import re
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

from ernie5.data.root import resolve_data_dir  # noqa: E402
from ernie5.store.checkpoint import load_checkpoint, resolve_checkpoint  # noqa: E402
from ernie5.subnets.params import count_params  # noqa: E402
from ernie5.subnets.resolve import resolve_specs  # noqa: E402
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
            raise ValueError("ernie5: model_args needs checkpoint=PATH (a checkpoint or run folder)")
        dev = str(device or "cpu")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", dev) or (dev != "cpu" and not torch.cuda.is_available()):
            raise ValueError(f"ernie5: device={dev!r}: use cpu, or cuda[:N] on a machine with CUDA")
        ckpt = load_checkpoint(resolve_checkpoint(checkpoint), device=dev)
        (sub,) = resolve_specs([str(subnet)], ckpt, resolve_data_dir(None))
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
    """Run lm-eval's command line on ``argv`` (no program name) with ``ernie5`` registered; its exit code."""
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
    try:
        cli.execute(args)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        lm_eval.tasks.TaskManager = manager
    return 0


def _all_local(tasks: Any, include_path: Any) -> bool:
    """Whether every name in ``--tasks`` is a task defined by a YAML under ``--include_path``."""
    if not tasks or not include_path:
        return False
    names = {t for item in ([tasks] if isinstance(tasks, str) else tasks) for t in str(item).split(",")}
    roots = [Path(p) for p in ([include_path] if isinstance(include_path, str) else include_path)]
    return names <= {t for r in roots if r.is_dir() for t in _defined_tasks(r)}


class _Loader(yaml.SafeLoader):
    """Safe YAML loader that keeps lm-eval tags (``!function x``) as plain strings."""


_Loader.add_multi_constructor("!", lambda loader, tag, node: f"{tag} {getattr(node, 'value', '')}")


def _read_task_yaml(path: Path, seen: tuple[Path, ...] = ()) -> tuple[dict, list[Path]]:
    """A task YAML merged over its ``include`` chain, and the files read (task file first)."""
    cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    cfg, files = (cfg if isinstance(cfg, dict) else {}), [path]
    inc = cfg.pop("include", None)
    if isinstance(inc, str) and (path.parent / inc).is_file() and path not in seen:
        base, more = _read_task_yaml(path.parent / inc, (*seen, path))
        cfg, files = {**base, **cfg}, files + more
    return cfg, files


def _defined_tasks(root: Path) -> dict[str, Path]:
    """Task name -> YAML file, for the single-task YAMLs under ``root``."""
    found: dict[str, Path] = {}
    for path in sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")]):
        task = _read_task_yaml(path)[0].get("task")
        if isinstance(task, str):
            found.setdefault(task, path)
    return found


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

    def __init__(self, lm_eval_task: str, yaml_path: Path, task_dir: Path, num_fewshot: int | None = None):
        self.lm_eval_task, self.task_dir = lm_eval_task, task_dir
        self.name = "lmeval-" + re.sub(r"[^A-Za-z0-9_.-]", "_", lm_eval_task)
        cfg, self._files = _read_task_yaml(yaml_path)
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
        """sha256 over the task's YAML files and the bytes of its data files."""
        digest = hashlib.sha256()
        for path in self._files:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        for ref in self._refs:
            path = _fill(ref, data_dir)
            if path is None or not path.is_file():
                raise FileNotFoundError(f"lm-eval task {self.lm_eval_task}: missing {ref}")
            digest.update(ref.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
        return digest.hexdigest()

    def _task_manager(self, data_dir: str | Path | None, work_dir: Path) -> Any:
        """Copy the task folder with ``{data_dir}`` filled in (absolute); one TaskManager per copy."""
        from lm_eval.tasks import TaskManager

        root = str(Path(data_dir).resolve()).encode() if data_dir is not None else None
        src = self.task_dir.resolve()
        dst = Path(work_dir).resolve() / f"{src.name}-{hashlib.sha256(str(src).encode()).hexdigest()[:8]}"
        for f in (f for f in sorted(src.rglob("*")) if f.is_file()):
            out, data = dst / f.relative_to(src), f.read_bytes()
            if f.suffix in (".yaml", ".yml") and root is not None:
                data = data.replace(b"{data_dir}", root)
            if not out.is_file() or out.read_bytes() != data:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(data)
        if str(dst) not in _TASK_MANAGERS:
            _TASK_MANAGERS[str(dst)] = TaskManager(include_path=str(dst), include_defaults=False)
        return _TASK_MANAGERS[str(dst)]

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
        with _quiet_lm_eval():
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


def lm_eval_units(entry: Any, suite_dir: Path) -> list[LmEvalUnit]:
    """One unit per task of a suite's ``lm_eval`` entry (``task_dir`` is relative to ``suite_dir``)."""
    task_dir = (Path(suite_dir) / entry.task_dir).resolve()
    found = _defined_tasks(task_dir)
    missing = [t for t in entry.tasks if t not in found]
    if missing:
        raise ValueError(
            f"lm_eval: task(s) {', '.join(missing)} not defined in {task_dir} "
            f"(found: {', '.join(sorted(found)) or 'none'})"
        )
    return [LmEvalUnit(t, found[t], task_dir, entry.num_fewshot) for t in entry.tasks]
