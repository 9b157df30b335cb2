"""Preemption: ``SIGTERM`` (or a first Ctrl-C) asks a checkpointing trainer to stop at its next step
boundary with a checkpoint, as Slurm, Kubernetes and spot instances expect within their grace period.

:func:`preemptible` installs the handlers for the duration of a run. The loop asks :meth:`Preemption.
requested` after every step; when it is set, the loop writes its checkpoint and raises
:class:`Preempted` (``ernie5`` prints one line and exits with :data:`EXIT_PREEMPTED`, 143 = 128 +
SIGTERM, the convention). Should the step in progress not end within ``grace_s`` seconds of the signal,
the process exits with 143 at once: the last complete checkpoint stands (checkpoints are written to a
temporary name and renamed, so none is left half-written as if complete). A second Ctrl-C interrupts
at once (exit 130), as Ctrl-C always did.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_PREEMPTED = 143
"""The exit code of a run stopped by ``SIGTERM`` (128 + 15)."""


class Preempted(Exception):
    """A run that stopped at a step boundary on request, with a checkpoint (one-line message)."""


class Preemption:
    """Whether a stop was asked for, and when."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signal: str | None = None
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def request(self, name: str) -> None:
        if self.signal is None:
            self.signal = name
            print(
                f"ernie5: {name}: stopping at the next step boundary with a checkpoint "
                f"(at most {self.grace_s:g} s)",
                file=sys.stderr,
                flush=True,
            )
            self._timer = threading.Timer(self.grace_s, self._out_of_time)
            self._timer.daemon = True
            self._timer.start()

    def _out_of_time(self) -> None:
        print(
            f"ernie5: {self.signal}: the step did not end within {self.grace_s:g} s; exiting, the last "
            "complete checkpoint stands",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_PREEMPTED)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


@contextmanager
def preemptible(grace_s: float = 60.0) -> Iterator[Preemption]:
    """Handle ``SIGTERM`` and a first ``SIGINT`` as stop requests while the block runs (main thread
    only; elsewhere the handlers cannot be installed and the block runs as before)."""
    state = Preemption(grace_s)
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def on_term(signum, frame) -> None:
        state.request("SIGTERM")

    def on_int(signum, frame) -> None:
        if state.requested:  # the second Ctrl-C: now
            raise KeyboardInterrupt
        state.request("SIGINT")

    old_term = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.signal(signal.SIGINT, on_int)
    try:
        yield state
    finally:
        state.cancel()
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
