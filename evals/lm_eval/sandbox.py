"""Task code runs only when the user allows it: ``!function`` and ``unsafe_code`` refused in a suite's
folder before anything runs (:func:`refuse_code`), and, while lm-eval runs, no task code outside its own
task folders and every template in Jinja's sandbox (:class:`CodeGuard`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from evals.lm_eval.common import SUITE_CODE_FLAG, UnsafeTaskCode, one_line
from evals.lm_eval.task_yaml import read_task_yaml


def lm_eval_task_root() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


class CodeGuard:
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

    def __enter__(self) -> CodeGuard:
        import lm_eval.tasks._yaml_loader as loader
        import lm_eval.utils as lm_utils
        from jinja2.sandbox import SandboxedEnvironment

        env, real_import = lm_utils.env, loader._import_func_in_yml
        self._sandbox = SandboxedEnvironment(
            loader=env.loader, undefined=env.undefined, keep_trailing_newline=env.keep_trailing_newline
        )
        self._sandbox.filters.update(env.filters)
        builtin = lm_eval_task_root()

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


def refuse_code(task_dir: Path, files: list[Path]) -> None:
    """ValueError naming the first file of ``task_dir`` whose tasks would run Python, and the flag."""
    checked: set[Path] = set()
    for path in (f for f in files if f.suffix in (".yaml", ".yml")):
        cfg, chain = read_task_yaml(path, root=task_dir)
        for f in (f for f in chain if f not in checked):
            checked.add(f)
            try:
                docs = list(yaml.compose_all(f.read_text(encoding="utf-8"), Loader=yaml.SafeLoader))
            except (yaml.YAMLError, UnicodeDecodeError) as e:
                raise ValueError(f"lm_eval: {f}: not readable YAML ({one_line(e)})") from None
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


@contextlib.contextmanager
def sandbox_errors(task: str):
    """A template stopped by Jinja's sandbox (see :class:`CodeGuard`) as a one-line ValueError."""
    from jinja2.exceptions import SecurityError

    try:
        yield
    except SecurityError as e:
        raise ValueError(
            f"lm-eval task {task}: a template tried to reach Python ({one_line(e)}); templates are data "
            f"unless {SUITE_CODE_FLAG} is given"
        ) from None
