"""``ernie5 nightly``: the main job.

With no arguments, on a fresh machine with no data and an empty cache: sweep
``suites/nightly.yaml`` over the shipped ``reference`` model (``ernie5/reference/``, an
all-modality elastic MoE trained by ``ernie5 recipe reference``; nothing is trained) and its
sub-models, next to a random-initialised twin, into a run folder, then write the report (and, with
``--baseline``, the comparison with an earlier run). Every task that needs no data (procedural
text, the shapes world's images and clips, DTMF audio; understanding and generation) is computed;
the tasks that need a data root (``--data-dir`` / ``$ERNIE5_DATA_DIR``) run when one is given and
are otherwise recorded as skipped with how to get the data. ``--checkpoint`` sweeps another model.

On GPUs: ``--device cuda`` (or ``auto``, the default, on a machine with one) runs the model there;
``torchrun --nproc-per-node N -m jobs.cli nightly ...`` (or ``accelerate launch``) spreads the units
over ``N`` processes, one GPU each, into one run folder (:mod:`evals.sweep`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ernie5.data.root import resolve_data_dir
from ernie5.runtime.distributed import init_dist

NIGHTLY_CHECKPOINT = "reference"
"""The model the main job sweeps when no checkpoint is given: the shipped reference."""


def run_nightly(
    checkpoint: str | Path | None = None,
    suite: str = "nightly",
    data_dir: str | Path | None = None,
    out: str | Path | None = None,
    baseline: str | Path | None = None,
    quiet: bool = False,
    confirm_run_unsafe_code: bool = False,
    log_with: Sequence[str] = (),
    device: str = "auto",
) -> dict:
    """Run the main job; returns its summary (also written to ``RUN_DIR/nightly.json``).

    ``failed_units`` lists the sweep's units recorded as errors (``subnet/task: reason``); the report
    is written either way. ``confirm_run_unsafe_code``, ``log_with`` (experiment trackers) and
    ``device`` are passed to :func:`evals.sweep.run_sweep`. Under ``torchrun`` / ``accelerate launch``
    the processes share the sweep's units; process 0 then writes the report, the comparison and
    ``nightly.json`` (the others return the sweep's counts).
    """
    from evals.sweep import run_sweep

    t0 = time.perf_counter()
    data_dir = resolve_data_dir(data_dir)
    dist = init_dist()
    # Every process of a launch takes process 0's time stamp for the default run folder.
    out = Path(out or dist.broadcast(Path("runs") / f"nightly-{time.strftime('%Y%m%d-%H%M%S')}"))
    if checkpoint is None:
        checkpoint = NIGHTLY_CHECKPOINT
    summary = run_sweep(
        checkpoint,
        suite,
        out,
        data_dir=data_dir,
        quiet=quiet,
        argv=sys.argv,
        confirm_run_unsafe_code=confirm_run_unsafe_code,
        log_with=log_with,
        device=device,
    )
    result = {
        "run_dir": str(out),
        "checkpoint": str(checkpoint),
        "data_dir": str(data_dir) if data_dir else None,
        "sweep_s": round(time.perf_counter() - t0, 1),
        "units": summary.n_units,
        "computed": summary.computed,
        "reused": summary.reused,
        "skipped": summary.skipped,
        "errors": summary.errors,
        "failed_units": summary.failed,
        "skipped_tasks": summary.unavailable,
        "harness_overhead_share": round(summary.overhead_share, 4),
    }
    if not dist.main:
        return result
    from reports import build_report, compare_runs

    result["report"] = str(build_report(out))
    if baseline is not None:
        cmp = compare_runs(baseline, out)
        result["comparison"] = str(cmp.out_dir)
        result["regression"] = cmp.has_regression
    result["total_s"] = round(time.perf_counter() - t0, 1)
    (out / "nightly.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result
