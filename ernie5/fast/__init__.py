"""Fast paths, applied to the paper's model from outside: fused CPU kernels (``ernie5.kernels``),
the MoE expert paths, attention back-ends and the fused decoding step.

``apply_fast_paths(model)`` is the one step (see :mod:`ernie5.fast.apply`); the model computes
the same function without it, and is the reference every fast path is tested against.
"""

from ernie5.fast.apply import apply_fast_paths, is_fast
from ernie5.fast.grad_squares import GradSquares

__all__ = ["GradSquares", "apply_fast_paths", "is_fast"]
