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

from reports.load import load_run
from reports.scores import REFERENCE, Z95, primary_scores, relative_scores

MODALITY_ORDER = ("text", "image", "video", "audio")


def _cell(value: float, stderr: float) -> str:
    if math.isnan(value):
        return "–"
    if math.isnan(stderr):
        return f"{value:.3f}"
    return f"{value:.3f} ± {Z95 * stderr:.3f}"


def score_table(run_dir: str | Path) -> str:
    """The Markdown score table of one run (see the module docstring)."""
    run = load_run(run_dir)
    rows = relative_scores(primary_scores(run.results), baseline=run.baseline_results)
    subnets = [s for s in dict.fromkeys([REFERENCE, *rows["subnet"]]) if s in set(rows["subnet"])]
    has_baseline = run.baseline is not None and run.baseline_results is not None
    order = {m: i for i, m in enumerate(MODALITY_ORDER)}
    tasks = (
        rows.drop_duplicates("task")
        .assign(_o=lambda d: d["modality"].map(order).fillna(len(order)))
        .sort_values(["_o", "task"])
    )
    header = ["task", "metric", "n", *subnets, *([run.baseline] if has_baseline else [])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by = rows.set_index(["subnet", "task"])
    for _, t in tasks.iterrows():
        cells = [
            _cell(float(by.loc[(s, t["task"]), "value"]), float(by.loc[(s, t["task"]), "stderr"]))
            if (s, t["task"]) in by.index
            else "–"
            for s in subnets
        ]
        label = t["task"]
        if has_baseline:
            cells.append(_cell(float(t["rand_value"]), float(t["rand_stderr"])))
            label += " (at chance)" if t["above_chance"] is False else ""
        arrow = "↑" if t["higher_is_better"] else "↓"
        lines.append("| " + " | ".join([label, f"{t['metric']} {arrow}", str(int(t["n"])), *cells]) + " |")
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
    sys.exit(main())
