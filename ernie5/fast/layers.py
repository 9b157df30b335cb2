"""Fast RMSNorm and bias-free linear layers: the model's modules with fused CPU forwards.

:class:`FusedRMSNorm` is ``nn.RMSNorm`` whose forward and backward each make one pass over the
activations on CPU in bf16 or fp32 (eager PyTorch runs half a dozen elementwise ops).
:class:`RowsLinear` is a bias-free ``nn.Linear`` whose calls on a few token rows that need no
gradient (a decoding step) read the weight in place with fp32 sums (``linear_rows``). Both keep
their base class's parameters and state dict, and fall back to it wherever the kernels do not
apply; the base class is the parity reference (``tests/fast``).
"""

from __future__ import annotations

import torch
from torch import nn

from ernie5.kernels import ops


class FusedRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over the last dimension, with the fused CPU kernel where it applies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if self.weight is not None and len(self.normalized_shape) == 1 and ops.fusable(x, self.weight):
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            return ops.rms_norm(x, self.weight, eps)
        return super().forward(x)


class RowsLinear(nn.Linear):
    """Bias-free ``nn.Linear`` whose decoding calls run :func:`ernie5.kernels.ops.linear`; one with a
    bias (which that product has not) runs ``nn.Linear`` itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if self._parameters["bias"] is not None:  # the dict, not nn.Module.__getattr__: a decoding hot path
            return super().forward(x)
        return ops.linear(x, self.weight)
