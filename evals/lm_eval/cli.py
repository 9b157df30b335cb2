"""``ernie5 lm-eval``: lm-eval's own command line with model ``ernie5`` registered, user errors as one line
and exit code 2, and task code refused unless ``--confirm_run_unsafe_code`` is given."""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
import yaml

from evals.lm_eval.common import CLI_CODE_FLAG, LmEvalUsageError, one_line
from evals.lm_eval.model import USE_CACHE_ERROR
from evals.lm_eval.sandbox import CodeGuard
from evals.lm_eval.task_yaml import all_local


def run_lm_eval_cli(argv: list[str]) -> int:
    """Run lm-eval's command line on ``argv`` (no program name) with ``ernie5`` registered; its exit code.

    A user error (an unknown task, a bad option combination, a checkpoint that cannot be loaded, a task
    that needs code without ``--confirm_run_unsafe_code``) is one line ``lm-eval: error: ...`` on stderr
    and exit code 2. Without ``--confirm_run_unsafe_code``, no task outside lm-eval's own task folders
    runs Python: a ``!function`` there (``--include_path``, ``--tasks x.yaml``, ``--config``) is refused
    and every task template renders in Jinja's sandbox (see :class:`CodeGuard`).
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
    if all_local(getattr(args, "tasks", None), getattr(args, "include_path", None)):
        # Every task is defined under --include_path: skip indexing lm-eval's ~15k built-in tasks (~10 s).
        lm_eval.tasks.TaskManager = functools.partial(manager, include_defaults=False)
    guard = CodeGuard(bool(getattr(args, "confirm_run_unsafe_code", False)), CLI_CODE_FLAG)
    try:
        with guard, _config_errors_are_user_errors(guard):
            cli.execute(args)
    except LmEvalUsageError as e:
        print(f"lm-eval: error: {one_line(e)}", file=sys.stderr)
        return 2
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        lm_eval.tasks.TaskManager = manager
    return 0


@contextlib.contextmanager
def _config_errors_are_user_errors(guard: CodeGuard):
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
            raise LmEvalUsageError(one_line(e)) from None
        guard.allow = guard.allow or bool(getattr(cfg, "confirm_run_unsafe_code", False))
        return cfg

    def process_tasks(self, *a, **k):
        try:
            return saved_process(self, *a, **k)
        except LmEvalUsageError:
            raise
        except errors as e:
            raise LmEvalUsageError(one_line(e)) from None

    EvaluatorConfig.from_cli, EvaluatorConfig.process_tasks = classmethod(from_cli), process_tasks
    try:
        yield
    finally:
        EvaluatorConfig.from_cli, EvaluatorConfig.process_tasks = saved_from_cli, saved_process
