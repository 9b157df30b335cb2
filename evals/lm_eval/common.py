"""What the lm-eval modules share: lm-eval's version, the task-code flags and the bridge's user error."""

from __future__ import annotations

import importlib.metadata

LM_EVAL_VERSION = importlib.metadata.version("lm-eval")
CLI_CODE_FLAG = "--confirm_run_unsafe_code"
"""lm-eval's own flag, which ``ernie5 lm-eval`` also reads as consent to task code (``!function``)."""
SUITE_CODE_FLAG = "--confirm-run-unsafe-code"
"""The ``ernie5 sweep`` / ``nightly`` flag that becomes ``lm_eval_units(..., allow_code=True)``."""


class LmEvalUsageError(ValueError):
    """A user error of the lm-eval bridge, reported by ``ernie5 lm-eval`` as one line with exit code 2."""


class UnsafeTaskCode(LmEvalUsageError):
    """A task asked lm-eval to import Python that the user did not allow."""


def one_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
