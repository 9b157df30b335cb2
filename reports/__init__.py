"""Reports on sweep run folders: the run report (seesaw, efficiency, routing), run comparisons
and trends across nights.

Reads only run folders (the contract in :mod:`evals.results`); never imports the model, torch,
``train`` or the task registry.
"""

from reports.compare import ComparisonResult, compare_runs
from reports.load import ReportError, load_run
from reports.report import build_report
from reports.trend import TrendResult, trend_runs

__all__ = [
    "ComparisonResult",
    "ReportError",
    "TrendResult",
    "build_report",
    "compare_runs",
    "load_run",
    "trend_runs",
]
