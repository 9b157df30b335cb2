"""Sums of squares of weight gradients, handed from the kernels that produce them to the optimizer.

The bf16 expert backward (``cpu_expert_gemm.cpp``) sums the squares of the weight gradients it
writes in its epilogue; the optimizer's gradient norm then need not read those gradients again
(at the nano shape the expert weights are 97 % of the parameters). The trainer creates one
:class:`GradSquares`, gives it to :func:`ernie5.fast.apply_fast_paths` (the MoE layers record into
it) and to the optimizer step (which takes from it). A recorded sum is used only while the
gradient is still that very tensor, unchanged (same storage, same version counter).
"""

from __future__ import annotations

import torch


class GradSquares:
    """Recorded ``sum(grad ** 2)`` per parameter, valid only for the gradient it was computed from."""

    def __init__(self) -> None:
        self._sums: dict[int, tuple[int, int, float]] = {}
        """Parameter data pointer -> (gradient data pointer, gradient version counter, sum)."""

    def record(self, param: torch.Tensor, grad: torch.Tensor, sumsq: float) -> None:
        """Remember ``sumsq`` as the sum of squares of ``grad``, the gradient just computed for ``param``."""
        self._sums[param.data_ptr()] = (grad.data_ptr(), grad._version, sumsq)

    def take(self, param: torch.Tensor, grad: torch.Tensor) -> float | None:
        """The recorded sum of ``param``'s gradient if ``grad`` is that very tensor, unchanged since
        (autograd kept it as ``.grad`` without copying or accumulating into it); None otherwise.
        The entry is consumed either way."""
        entry = self._sums.pop(param.data_ptr(), None)
        if entry is not None and entry[0] == grad.data_ptr() and entry[1] == grad._version:
            return entry[2]
        return None

    def clear(self) -> None:
        """Forget every recorded sum (the optimizer step did not use them, or is over)."""
        self._sums.clear()
