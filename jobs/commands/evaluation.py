"""Evaluation commands: ``tasks``, ``specialists``, ``sweep``, ``lm-eval`` and ``nightly`` (the main job).

Each handler sits beside the parser of its command; :func:`add_parsers` adds them to ``ernie5``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jobs.commands.common import (
    EXIT_EVAL_FAILED,
    EXIT_OK,
    CLIError,
    check_out,
    eval_device_argument,
    log_with_argument,
    print_json,
)


def cmd_tasks(args) -> int:
    """``ernie5 tasks``."""
    from ernie5.data.root import resolve_data_dir
    from evals.catalog import format_table, list_tasks

    rows = list_tasks(resolve_data_dir(args.data_dir))
    if args.json:
        print_json(rows)
    else:
        print(format_table(rows))
    return 0


def add_tasks_parser(sub) -> None:
    """``ernie5 tasks``."""
    ta = sub.add_parser(
        "tasks", help="list the registered evaluation tasks and whether their data is present"
    )
    ta.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    ta.add_argument("--json", action="store_true", help="print JSON")
    ta.set_defaults(fn=cmd_tasks)


def cmd_specialists(args) -> int:
    """``ernie5 specialists``."""
    from ernie5.data.root import resolve_data_dir
    from evals.specialists import suite_specialists

    report = suite_specialists(args.suite, resolve_data_dir(args.data_dir))
    if args.json:
        print_json(report)
    else:
        for r in report["rows"]:
            print(
                f"{r['task']:24s} {r['metric']:20s} {r['value']:.3f} ± {1.96 * r['stderr']:.3f}  n={r['n']}"
                f"  {r['specialist']}"
            )
        for s in report["skipped"]:
            print(f"{s['task']:24s} skipped: {s['reason']}")
    return 0


def add_specialists_parser(sub) -> None:
    """``ernie5 specialists``."""
    sp = sub.add_parser(
        "specialists",
        help="score the specialist baselines (a small model trained for one task) on a suite's items",
    )
    sp.add_argument("--suite", required=True, help="suite name (nightly, reference, ...) or YAML file")
    sp.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.set_defaults(fn=cmd_specialists)


def _skipped_tasks(command: str, unavailable: dict[str, str], strict: bool) -> None:
    """Name every task the run skipped on stderr, with its reason and how to supply it; under
    ``--strict`` a skip is bad input (exit 2)."""
    if not unavailable:
        return
    print(f"ernie5 {command}: skipped {len(unavailable)} task(s):", file=sys.stderr)
    for task, reason in sorted(unavailable.items()):
        print(f"  {task}: {reason}", file=sys.stderr)
    if strict:
        raise CLIError(f"--strict: {len(unavailable)} task(s) skipped (first: {min(unavailable)})")


def _failed_units(command: str, failed: list[str], n_units: int, run_dir) -> int:
    """Exit 3 with a one-line summary when any unit of the sweep is an error, else 0."""
    if not failed:
        return EXIT_OK
    print(
        f"ernie5 {command}: error: {len(failed)} of {n_units} units failed (first: {failed[0]}); "
        f"see {Path(run_dir) / 'units.csv'}",
        file=sys.stderr,
    )
    return EXIT_EVAL_FAILED


def _sweep_summary(s) -> dict:
    return {
        "run_dir": str(s.run_dir),
        "units": s.n_units,
        "computed": s.computed,
        "reused": s.reused,
        "skipped": s.skipped,
        "errors": s.errors,
        "unit_wall_s": round(s.wall_s, 3),
        "model_s": round(s.model_s, 3),
        "harness_overhead_share": round(s.overhead_share, 4),
        "cache_hits": s.cache_hits,
        "cache_misses": s.cache_misses,
    }


def cmd_sweep(args) -> int:
    """``ernie5 sweep``."""
    from ernie5.store.runs import LOCK_FILE
    from evals.sweep import run_sweep

    if args.limit is not None and args.limit < 1:
        raise CLIError(f"--limit {args.limit}: expected an integer >= 1")
    out = check_out(args.out)
    trained = (out / "checkpoints").is_dir() or (out / "config.yaml").is_file()  # a training run's folder
    is_run = (out / "units").is_dir() or ((out / LOCK_FILE).is_file() and not trained)
    if out.exists() and any(out.iterdir()) and not args.resume and not is_run:
        raise CLIError(f"--out {out} exists and is not a sweep run folder; choose a new folder")
    summary = run_sweep(
        args.checkpoint,
        args.suite,
        out,
        data_dir=args.data_dir,
        limit=args.limit,
        cache_path=args.cache,
        quiet=args.quiet,
        argv=sys.argv,
        confirm_run_unsafe_code=args.confirm_run_unsafe_code,
        log_with=args.log_with or (),
        device=args.device,
    )
    print(json.dumps(_sweep_summary(summary)))
    _skipped_tasks("sweep", getattr(summary, "unavailable", {}), getattr(args, "strict", False))
    return _failed_units("sweep", summary.failed, summary.n_units, summary.run_dir)


def add_sweep_parser(sub) -> None:
    """``ernie5 sweep``."""
    sw = sub.add_parser("sweep", help="evaluate every (sub-model, task) unit of a suite on a checkpoint")
    sw.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder")
    sw.add_argument("--suite", required=True, help="suite name (smoke, nightly, full) or YAML file")
    sw.add_argument(
        "--out", required=True, help="run folder (units already there with a matching fingerprint are kept)"
    )
    sw.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    sw.add_argument("--limit", type=int, help="cap the examples of every task (>= 1)")
    sw.add_argument(
        "--resume", action="store_true", help="continue a run folder (same as running into it again)"
    )
    sw.add_argument("--cache", help="response cache file (default: RUN_DIR/cache.sqlite)")
    sw.add_argument("--quiet", action="store_true", help="no progress bar")
    sw.add_argument(
        "--strict", action="store_true", help="a skipped task (missing data, ...) is an error (exit 2)"
    )
    sw.add_argument(
        "--confirm-run-unsafe-code",
        action="store_true",
        help="allow the suite's lm-eval tasks to run Python from their task folder (`!function`)",
    )
    log_with_argument(sw)
    eval_device_argument(sw)
    sw.set_defaults(fn=cmd_sweep)


def cmd_lm_eval(args) -> int:
    """``ernie5 lm-eval``: lm-eval's own command line with the ``ernie5`` model registered."""
    from ernie5.runtime.packages import missing_reason

    if why := missing_reason("lm_eval"):
        raise CLIError(f"`ernie5 lm-eval` {why}")
    from evals.lm_eval.cli import run_lm_eval_cli

    return run_lm_eval_cli(args.lm_eval_args)


def add_lm_eval_parser(sub) -> None:
    """``ernie5 lm-eval``."""
    le = sub.add_parser(
        "lm-eval",
        add_help=False,
        help="run any lm-eval task on a sub-model: ernie5 lm-eval --model ernie5 --model_args "
        "checkpoint=CKPT,subnet=k1 --tasks T [--include_path DIR] [--output_path OUT] (lm-eval's arguments)",
    )
    le.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    le.set_defaults(fn=cmd_lm_eval)


def cmd_nightly(args) -> int:
    """``ernie5 nightly``: the main job."""
    from jobs.nightly import run_nightly

    if args.out is not None:
        check_out(args.out)
    result = run_nightly(
        checkpoint=args.checkpoint,
        suite=args.suite,
        data_dir=args.data_dir,
        out=args.out,
        baseline=getattr(args, "baseline", None),
        quiet=args.quiet,
        confirm_run_unsafe_code=args.confirm_run_unsafe_code,
        log_with=args.log_with or (),
        device=args.device,
    )
    _skipped_tasks("nightly", result.get("skipped_tasks", {}), getattr(args, "strict", False))
    return _failed_units("nightly", result["failed_units"], result["units"], result["run_dir"])


def add_nightly_parser(sub) -> None:
    """``ernie5 nightly``."""
    n = sub.add_parser(
        "nightly", help="the main job: sweep the shipped reference (or a checkpoint) over the nightly suite"
    )
    n.add_argument("--checkpoint", help="evaluate this checkpoint (default: the shipped reference)")
    n.add_argument("--suite", default="nightly", help="suite name or YAML file")
    n.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    n.add_argument("--out", default=None, help="run folder (default: runs/nightly-<date>)")
    n.add_argument("--baseline", help="an earlier run folder to compare against")
    n.add_argument("--quiet", action="store_true")
    n.add_argument(
        "--strict", action="store_true", help="a skipped task (missing data, ...) is an error (exit 2)"
    )
    n.add_argument(
        "--confirm-run-unsafe-code",
        action="store_true",
        help="allow the suite's lm-eval tasks to run Python from their task folder (`!function`)",
    )
    log_with_argument(n)
    eval_device_argument(n)
    n.set_defaults(fn=cmd_nightly)


def add_parsers(sub) -> None:
    """This module's commands, in ``ernie5 --help`` order."""
    add_tasks_parser(sub)
    add_specialists_parser(sub)
    add_sweep_parser(sub)
    add_lm_eval_parser(sub)
    add_nightly_parser(sub)
