"""The score table of a model card, from a sweep run folder.

One row per task (its primary metric), one column per subnet (the full model first, the random
baseline last), each cell ``value ± half-width`` of the 95 % interval (1.96 x the task's stderr) and
``n``; a task whose full model is not significantly above the random model (see
:func:`reports.scores.above_chance`) is marked ``(at chance)``. ``MODEL_CARD.md`` embeds the tables
of the runs it quotes, so every number in it comes from a run folder and the command that made it.

``python -m reports.card RUN_DIR [RUN_DIR ...]`` prints the Markdown.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

from reports.load import load_run
from reports.scores import Z95, above_chance, primary_scores

MODALITY_ORDER = ("text", "image", "video", "audio")


def _cell(value: float, stderr: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if stderr is None or math.isnan(stderr):
        return f"{value:.3f}"
    return f"{value:.3f} ± {Z95 * stderr:.3f}"


def score_table(run_dir: str | Path) -> str:
    """The Markdown score table of one run (see the module docstring)."""
    run = load_run(run_dir)
    rows = primary_scores(run.results)
    subnets = list(dict.fromkeys(["full", *rows["subnet"]]))
    subnets = [s for s in subnets if s in set(rows["subnet"])]
    base = None
    if run.baseline_results is not None and run.baseline is not None:
        base = run.baseline_results.set_index(["task", "metric"])
    order = {m: i for i, m in enumerate(MODALITY_ORDER)}
    tasks = (
        rows[["task", "metric", "modality", "higher_is_better"]]
        .drop_duplicates("task")
        .assign(_o=lambda d: d["modality"].map(order).fillna(len(order)))
        .sort_values(["_o", "task"])
    )
    header = ["task", "metric", "n", *subnets, *([run.baseline] if base is not None else [])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by = rows.set_index(["subnet", "task"])
    for _, t in tasks.iterrows():
        cells, n = [], ""
        for s in subnets:
            if (s, t["task"]) in by.index:
                r = by.loc[(s, t["task"])]
                cells.append(_cell(float(r["value"]), float(r["stderr"])))
                n = n or str(int(r["n"]))
            else:
                cells.append("–")
        label = t["task"]
        if base is not None:
            key = (t["task"], t["metric"])
            if key in base.index:
                b = base.loc[key]
                cells.append(_cell(float(b["value"]), float(b["stderr"])))
                if "full" in subnets and ("full", t["task"]) in by.index:
                    f = by.loc[("full", t["task"])]
                    ok = above_chance(
                        float(f["value"]),
                        float(f["stderr"]),
                        float(b["value"]),
                        float(b["stderr"]),
                        bool(t["higher_is_better"]),
                    )
                    label += "" if ok else " (at chance)"
            else:
                cells.append("–")
        arrow = "↑" if t["higher_is_better"] else "↓"
        lines.append("| " + " | ".join([label, f"{t['metric']} {arrow}", n, *cells]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the score table of each run folder given."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m reports.card RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        return 2
    for i, run_dir in enumerate(args):
        if i:
            print()
        print(f"Run `{run_dir}`:\n")
        print(score_table(run_dir), end="")
    return 0


if __name__ == "__main__":
    pd.set_option("display.width", 200)
    sys.exit(main())
