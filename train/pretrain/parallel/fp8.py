"""FP8 training of the backbone's dense projections with torchao, where the GPU supports it.

:func:`apply_fp8` swaps every bias-free ``nn.Linear`` of the backbone blocks but the router
(attention ``wqkv`` and ``wo``, shared experts, dense FFNs) for torchao's ``Float8Linear`` (dynamic
tensorwise scaling: e4m3 in the forward, e5m2 for the gradients, fp32 accumulation). Nothing else
changes: embeddings, norms, the router (fp32 by design), the head, the MTP module and the routed
experts keep their precision.

Guarded: ``train.fp8: true`` needs a CUDA GPU of compute capability 8.9 or higher (Ada, Hopper and
later) and the ``torchao`` package; otherwise the run stops with a one-line error before training.
Without the switch nothing here is imported, and everything runs without torchao.

``train.fp8_emulate: true`` (torchtitan's ``float8.emulate``) runs the same casts in emulation on any
device, CPU included: every operand is scaled and rounded to e4m3/e5m2 exactly as on the GPU, and the
GEMM then runs in the operands' own precision. That is the FP8 numerics without FP8 hardware (slower,
not faster): what the CPU tests train with, and a way to check a recipe's FP8 losses before a GPU run.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §4: FP8 mixed-precision training.
  * Micikevicius et al. 2022, "FP8 Formats for Deep Learning" (arXiv 2209.05433); torchao
    ``float8`` training (``convert_to_float8_training``).

Deviations:
  1. The routed experts stay in bf16: their grouped GEMMs (``torch._grouped_mm``) have no stable
     FP8 path in the torchao release this project pins; the report casts its expert GEMMs too.
  2. Tensorwise dynamic scaling (torchao's default), where the report does not say which scaling
     recipe it uses.
"""

from __future__ import annotations

import logging

import torch
from torch import nn


class FP8Error(ValueError):
    """FP8 was asked for where it cannot run (one-line message)."""


def fp8_supported(device: torch.device, emulate: bool = False) -> str | None:
    """None when FP8 training can run on ``device`` (in emulation: on any device), else why not
    (one line)."""
    if not emulate:
        if device.type != "cuda":
            return f"train.fp8 needs a CUDA GPU (this run is on {device.type})"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return f"train.fp8 needs compute capability >= 8.9 (this GPU has {major}.{minor})"
    if not _torchao_float8():
        return f"train.{'fp8_emulate' if emulate else 'fp8'} needs the torchao package (pip install torchao)"
    return None


def _torchao_float8() -> bool:
    """Whether ``torchao.float8`` imports. torchao logs, at import, each of its CUDA extension
    libraries that does not load on this machine, and torch logs a deprecation from torchao's pytree
    registration: one-off import noise, kept out of the run's output."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    return True


def apply_fp8(model: nn.Module, device: torch.device, emulate: bool = False) -> int:
    """Swap the backbone blocks' bias-free linear layers for ``Float8Linear`` (in place); returns
    how many were swapped. ``emulate``: emulated FP8 casts, on any device. Raises
    :class:`FP8Error` where FP8 cannot run."""
    why = fp8_supported(device, emulate)
    if why is not None:
        raise FP8Error(why)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def eligible(mod: nn.Module, fqn: str) -> bool:
        # FP8 GEMMs need both dimensions divisible by 16. The router stays fp32 (its logits decide
        # the routing; the MoE layer reads its weight directly, never through the module).
        return (
            isinstance(mod, nn.Linear)
            and fqn.rsplit(".", 1)[-1] != "router"
            and mod.bias is None
            and mod.in_features % 16 == 0
            and mod.out_features % 16 == 0
        )

    before = sum(isinstance(m, nn.Linear) for m in model.layers.modules())
    convert_to_float8_training(
        model.layers, config=Float8LinearConfig(emulate=emulate), module_filter_fn=eligible
    )
    after = sum(type(m) is nn.Linear for m in model.layers.modules())
    return before - after
