"""Intra-op thread count for a block of work, restored after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def num_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch intra-op threads (unchanged for None), restoring the previous count."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
