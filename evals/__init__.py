"""The evaluation harness: tasks, metrics, the model protocol and a random baseline model.

Importing :mod:`evals` registers every task in :data:`evals.task.TASKS`.
"""

from evals import tasks
from evals.task import TASKS, Example, Task

__all__ = ["TASKS", "Example", "Task", "tasks"]
