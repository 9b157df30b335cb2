"""The evaluation harness: tasks, metrics, the model protocol, the sweep and the lm-eval bridge.

Importing :mod:`evals` is cheap and registers nothing; ``import evals.tasks`` registers every task
in :data:`evals.task.TASKS` (the suite loader, the catalog and the sweep do so). ``reports/`` may
therefore import :mod:`evals.results` and :mod:`evals.metrics` without loading any task.
"""
