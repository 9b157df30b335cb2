"""The two ``evals`` modules a report may use: the run-folder contract and the pure statistics.

``reports/`` reads run folders only: it never imports the model, ``torch``, ``train`` or the task
registry. ``import evals`` registers nothing, so these imports stay light (a test checks it).
"""

from __future__ import annotations

from evals import metrics, results

__all__ = ["metrics", "results"]
