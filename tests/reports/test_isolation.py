"""``reports`` never imports the model, torch, the training code or the task registry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FORBIDDEN = ("torch", "ernie5.model", "train", "evals.tasks", "evals.task")
ROOT = Path(__file__).resolve().parents[2]


def test_importing_reports_pulls_in_no_model_code():
    code = (
        "import json, sys; import reports; from reports import build_report, compare_runs; "
        "import reports.plots; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'train'} "
        "or m.startswith(('ernie5.model', 'evals.')) or m == 'evals')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    loaded = json.loads(out.stdout)
    assert [m for m in loaded if m in FORBIDDEN or m.startswith(("torch.", "train.", "ernie5.model."))] == []
