"""A suite's ``lm_eval`` entry as sweep units: one :class:`LmEvalUnit` per task, evaluated through lm-eval's
``simple_evaluate`` on the sweep's model, its results and samples in our shapes (``limit`` is lm-eval's:
the first ``limit`` documents, not a seeded subsample)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.resources
import math
import numbers
import re
from pathlib import Path
from typing import Any

from ernie5.files import hash_file_into
from ernie5.runtime.packages import missing_reason
from evals.lm_eval.common import LM_EVAL_VERSION, SUITE_CODE_FLAG
from evals.lm_eval.sandbox import CodeGuard, refuse_code, sandbox_errors
from evals.lm_eval.task_yaml import defined_tasks, read_task_yaml, task_files
from evals.task import Evaluable, UnitResult

EXCERPT_CHARS = 300
_TASK_MANAGERS: dict[str, Any] = {}


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
        files_here = task_files(task_dir)
        if not self.allow_code:
            refuse_code(task_dir, files_here)
        cfg = read_task_yaml(yaml_path, root=task_dir)[0]
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
        """``(True, "")`` when lm-eval is installed and every data file the YAML names exists, else a
        one-line reason."""
        if why := missing_reason("lm_eval"):
            return False, f"lm-eval task {self.lm_eval_task}: {why}"
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
        for path in task_files(self.task_dir):
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
        for f in task_files(src):
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
        from evals.lm_eval.model import Ernie5LM  # lm-eval's classes: imported only when it runs

        lm = Ernie5LM.from_eval_model(model)
        with _quiet_lm_eval(), CodeGuard(self.allow_code, SUITE_CODE_FLAG), sandbox_errors(task):
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
    render in Jinja's sandbox and any ``!function`` lm-eval meets is refused (:class:`CodeGuard`).

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
    found = defined_tasks(task_dir, strict=True)
    missing = [t for t in entry.tasks if t not in found]
    if missing:
        raise ValueError(
            f"lm_eval: task(s) {', '.join(missing)} not defined in {task_dir} "
            f"(found: {', '.join(sorted(found)) or 'none'})"
        )
    return [LmEvalUnit(t, found[t], task_dir, entry.num_fewshot, allow_code=allow_code) for t in entry.tasks]
