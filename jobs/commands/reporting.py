"""Report commands: ``report``, ``compare`` and ``trend``.

Each handler sits beside the parser of its command; :func:`add_parsers` adds them to ``ernie5``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from jobs.commands.common import EXIT_REGRESSION, check_out


def cmd_report(args) -> int:
    """``ernie5 report``."""
    from reports import build_report

    if args.out is not None:
        check_out(args.out)
    elif Path(args.run_dir).is_dir():
        check_out(Path(args.run_dir) / "report", "report folder")
    out = build_report(args.run_dir, args.out, beside=args.beside)
    print(out / "index.html")
    return 0


def add_report_parser(sub) -> None:
    """``ernie5 report``."""
    r = sub.add_parser("report", help="HTML report, Markdown summary and CSV/JSON tables of a sweep run")
    r.add_argument("run_dir", metavar="RUN_DIR", help="sweep run folder (manifest.json, units/, ...)")
    r.add_argument("--out", default=None, help="report folder (default: RUN_DIR/report)")
    r.add_argument(
        "--beside",
        metavar="OTHER_RUN",
        help="another model's sweep (e.g. a Hugging Face MoE): the report opens with what each loses first",
    )
    r.set_defaults(fn=cmd_report)


def cmd_compare(args) -> int:
    """``ernie5 compare``: with --fail-on-regression, exit 1 on any significant regression."""
    from reports import compare_runs

    if args.out is not None:
        check_out(args.out)
    result = compare_runs(args.base_run, args.new_run, args.out)
    print(result.summary_markdown)
    print(f"written to {result.out_dir}", file=sys.stderr)
    return EXIT_REGRESSION if args.fail_on_regression and result.has_regression else 0


def add_compare_parser(sub) -> None:
    """``ernie5 compare``."""
    c = sub.add_parser("compare", help="paired per-(subnet, task) comparison of two sweep runs")
    c.add_argument("base_run", metavar="BASE_RUN", help="baseline run folder (e.g. last night's)")
    c.add_argument("new_run", metavar="NEW_RUN", help="run folder under test")
    c.add_argument("--out", default=None, help="output folder (default: NEW_RUN/report/compare-<BASE name>)")
    c.add_argument(
        "--fail-on-regression", action="store_true", help="exit 1 on any significant regression (CI gate)"
    )
    c.set_defaults(fn=cmd_compare)


def cmd_trend(args) -> int:
    """``ernie5 trend``: with --fail-on-regression, exit 1 when the last night has a significant regression
    versus the night before it (as ``compare`` of those two runs would)."""
    from reports import trend_runs

    if args.out is not None:
        check_out(args.out)
    result = trend_runs(args.run_dirs, args.out)
    print(result.summary_markdown)
    print(f"written to {result.out_dir}", file=sys.stderr)
    return EXIT_REGRESSION if args.fail_on_regression and result.last_has_regression else 0


def add_trend_parser(sub) -> None:
    """``ernie5 trend``."""
    t = sub.add_parser("trend", help="scores across nights: each night's paired change vs the night before")
    t.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="two or more sweep run folders, any order")
    t.add_argument(
        "--out", default=None, help="output folder (default: the last night's RUN_DIR/report/trend)"
    )
    t.add_argument(
        "--fail-on-regression",
        action="store_true",
        help="exit 1 if the last night has a significant regression vs the one before (CI gate)",
    )
    t.set_defaults(fn=cmd_trend)


def add_parsers(sub) -> None:
    """This module's commands, in ``ernie5 --help`` order."""
    add_report_parser(sub)
    add_compare_parser(sub)
    add_trend_parser(sub)
