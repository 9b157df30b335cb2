"""The process's resident memory, as long runs log it (a sweep records it after every unit)."""

from __future__ import annotations

import os
import resource
import sys


def resident_mb() -> float:
    """Resident set size now, in MiB: ``/proc/self/statm`` on Linux; elsewhere the peak so far
    (``getrusage``), the closest portable figure."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / (2**20 if sys.platform == "darwin" else 2**10)
