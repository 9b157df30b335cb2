"""The model card's score table: one row per task, the full model first, the random twin last."""

from __future__ import annotations

from reports.card import main, score_table
from reports.load import load_run
from reports.scores import primary_scores, relative_scores

from .conftest import RANDOM


def test_the_table_has_every_task_with_intervals_and_marks_tasks_at_chance(make_run):
    run_dir = make_run("card", baseline=True, chance=("image",))
    table = score_table(run_dir).splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[:4] == ["task", "metric", "n", "full"] and header[-1] == RANDOM
    run = load_run(run_dir)
    rows = relative_scores(primary_scores(run.results), baseline=run.baseline_results)
    assert len(table) == 2 + rows["task"].nunique()
    at_chance = set(rows.loc[rows["above_chance"] == False, "task"])  # noqa: E712
    assert at_chance  # the fixture puts the image tasks at chance
    for line in table[2:]:
        task = line.strip("|").split("|")[0].strip()
        name = task.removesuffix(" (at chance)")
        assert task.endswith("(at chance)") == (name in at_chance)
        assert "±" in line


def test_the_command_needs_a_run_folder(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().err
