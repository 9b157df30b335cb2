"""Process-level runtime tuning, applied explicitly by the entry points (never at import).

glibc's malloc returns every large block (over 128 KiB by default, adaptively up to 32 MiB) to the
kernel when it is freed, so each training step re-faults hundreds of MB of fresh pages for its
temporaries, a large share of a CPU step. Raising the mmap and trim thresholds keeps freed memory
in the process for reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_DONE = False


def tune_allocator() -> bool:
    """Keep freed large blocks in the process (glibc only); returns whether it applied."""
    global _DONE
    if _DONE:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
        )
    except (OSError, AttributeError):
        return False
    _DONE = ok
    return ok
