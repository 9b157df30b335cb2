"""Optional packages a machine may lack, and the one line that says so.

The project's dependencies are all installed on the dev machine, but the GPU images people get are
not (the one this project is checked on has no lm-eval, jiwer, datasets, evaluate or torchao). What
needs such a package says so instead of failing at import: a task is recorded as skipped with
:func:`missing_reason`, a command stops with it (exit 2). Modules import these packages inside the
functions that use them, never at the top (``tests/runtime/test_packages.py`` imports every module and
runs a sweep with all of them hidden)."""

from __future__ import annotations

import importlib.util

OPTIONAL = {
    "lm_eval": "lm-eval>=0.4.10,<0.5",
    "jiwer": "jiwer>=3.0",
    "datasets": "datasets>=2.19,<6",
    "evaluate": "evaluate",
    "torchao": "torchao>=0.10",
}
"""Import name -> the requirement to install (the project's own pins)."""


def have(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is not a package; a module set to None
        return False


def missing_reason(*modules: str) -> str:
    """'' when every module is importable, else one line naming the first missing one and how to get it."""
    for module in modules:
        if not have(module):
            req = OPTIONAL.get(module, module)
            return f"needs the Python package {req.split('>')[0].split('=')[0]} (pip install '{req}')"
    return ""
