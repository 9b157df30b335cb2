"""``apply_fast_paths(model)``: the one step that makes the paper's model fast.

Like FSDP2's ``fully_shard``, it swaps the class of the model's modules, in place, for subclasses
that keep every parameter, buffer and state-dict key and change only how the forward computes:

=====================================  ==========================================================
model module                           fast class (module)
=====================================  ==========================================================
``Ernie5Model``                        ``FastErnie5Model`` (decode): tags fused decoding steps
backbone ``Block``                     ``FastBlock`` (decode): a decoding step in one kernel call
``Attention``                          ``FastAttention`` (attention): fused projection, back-ends
``MoE``                                ``FastMoE`` (moe): fused router, expert paths
``TextHead``                           ``FastTextHead`` (loss): chunked fused cross-entropy
``nn.RMSNorm``                         ``FusedRMSNorm`` (layers)
bias-free ``nn.Linear`` of the blocks  ``RowsLinear`` (layers): few-row decoding products
=====================================  ==========================================================

Every fast class falls back to its base wherever its kernels or shapes do not apply, so the model
computes the same function with or without this step; the eager model is the parity reference of
every fast path (``tests/fast``). Skipping the step (``load_checkpoint(..., fast=False)``, or not
calling it) runs the eager maths.
"""

from __future__ import annotations

from torch import nn

from ernie5.fast.attention import FastAttention
from ernie5.fast.decode import FastBlock, FastErnie5Model
from ernie5.fast.grad_squares import GradSquares
from ernie5.fast.layers import FusedRMSNorm, RowsLinear
from ernie5.fast.loss import FastTextHead
from ernie5.fast.moe import PATHS, FastMoE
from ernie5.model.attention import Attention
from ernie5.model.head import TextHead
from ernie5.model.model import Ernie5Model
from ernie5.model.moe import MoE, SwiGLU
from ernie5.model.mtp import MTPModule

_FAST = {
    Ernie5Model: FastErnie5Model,
    Attention: FastAttention,
    MoE: FastMoE,
    TextHead: FastTextHead,
    nn.RMSNorm: FusedRMSNorm,
}


def _swap(module: nn.Module, cls: type[nn.Module]) -> None:
    """Make ``module`` a ``cls`` (a subclass of its class that adds no state)."""
    if type(module) is not cls:
        if not issubclass(cls, type(module)):
            raise TypeError(
                f"apply_fast_paths: {type(module).__name__} is not one of the model's own classes "
                f"({cls.__name__} cannot take its place); run it eager (load_checkpoint(..., fast=False))"
            )
        module.__class__ = cls


def apply_fast_paths(
    model: nn.Module, *, moe_path: str = "auto", grad_squares: GradSquares | None = None
) -> nn.Module:
    """Give ``model``'s modules their fast forwards, in place; returns ``model``.

    Args:
        model: an :class:`~ernie5.model.model.Ernie5Model`, or any module of one (an MoE layer
            on its own, say); applying twice changes nothing but the options.
        moe_path: the MoE expert path (``auto`` | ``sorted`` | ``grouped`` | ``gather`` |
            ``loop``); ``auto`` picks by device, dtype and row count.
        grad_squares: where the fused expert backward records the sums of squares of the weight
            gradients it computes, for the optimizer's gradient norm (None: not recorded).
    """
    if moe_path not in PATHS:
        raise ValueError(f"moe_path={moe_path!r}: expected one of {', '.join(PATHS)}")
    for module in model.modules():
        for base, fast in _FAST.items():
            if isinstance(module, base):
                _swap(module, fast)
                break
        if isinstance(module, FastMoE):
            module.path, module.grad_squares = moe_path, grad_squares
    if isinstance(model, Ernie5Model):
        for block in model.layers:  # the backbone's blocks; the MTP block keeps the module path
            _swap(block, FastBlock)
    linears = []
    for module in model.modules():
        if isinstance(module, Attention):
            linears += [module.wqkv, module.wo]
        elif isinstance(module, SwiGLU):
            linears += [module.w13, module.w2]
        elif isinstance(module, MTPModule):
            linears.append(module.proj)
    for linear in linears:
        _swap(linear, RowsLinear)
    return model


def is_fast(model: nn.Module) -> bool:
    """Whether :func:`apply_fast_paths` was applied to ``model``."""
    return isinstance(model, FastErnie5Model)
