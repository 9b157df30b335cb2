"""The one resolution of sub-model specs against a checkpoint.

A :class:`~ernie5.model.elastic.SubnetSpec` names dimensions and deploy selections; resolving it
against a model gives the concrete :class:`~ernie5.model.elastic.Subnet` (kept layers, kept
experts, top-k). Importance-based selections need calibration statistics of that model, and the
rule for when they are needed is here and nowhere else (:func:`needs_calibration`): only when a
spec selects by importance along a dimension it actually reduces. The command line (``generate``,
``extract``), the sweep, the suite loader's sub-models and the lm-eval bridge all resolve through
:func:`resolve_specs`, which calibrates at most once for all the specs it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ernie5.model.config import ModelConfig
from ernie5.model.elastic import Subnet, SubnetSpec, parse_subnet, resolve, select_count
from ernie5.store.checkpoint import Checkpoint, CheckpointError, load_checkpoint, resolve_checkpoint
from ernie5.subnets.importance import calibration_batches, compute_importance


def needs_calibration(spec: SubnetSpec, cfg: ModelConfig) -> bool:
    """Whether resolving ``spec`` against a model with ``cfg`` needs importance statistics: it keeps
    fewer layers than the model has and selects them by importance, or fewer experts and selects
    those by importance."""
    fewer_layers = select_count(spec.depth, cfg.n_layers, "depth") < cfg.n_layers
    fewer_experts = select_count(spec.width, cfg.moe.n_experts, "width") < cfg.moe.n_experts
    return (fewer_layers and spec.layers == "importance") or (fewer_experts and spec.experts == "importance")


def resolve_specs(
    specs: Sequence[SubnetSpec | str], ckpt: Checkpoint, data_dir: str | Path | None = None
) -> list[Subnet]:
    """The concrete sub-models of ``specs`` for ``ckpt``'s model, in order.

    Calibrates importance once (on :func:`~ernie5.subnets.importance.calibration_batches`) when
    any spec needs it.

    Raises:
        SubnetError: a spec that does not parse or does not fit the model.
        CheckpointError: importance selection on a checkpoint without a tokenizer.
    """
    parsed = [parse_subnet(s) for s in specs]
    importance = None
    if any(needs_calibration(s, ckpt.cfg) for s in parsed):
        if ckpt.tokenizer is None:
            raise CheckpointError(f"{ckpt.path}: importance selection needs the checkpoint's tokenizer")
        importance = compute_importance(ckpt.model, calibration_batches(ckpt.tokenizer, data_dir))
    return [resolve(s, ckpt.cfg, importance) for s in parsed]


def load_subnet(
    checkpoint: str | Path, subnet: str | SubnetSpec | None, data_dir: str | Path | None = None
) -> tuple[Checkpoint, Subnet]:
    """Load a checkpoint (or a run folder's newest one) and resolve ``subnet`` against it."""
    ckpt = load_checkpoint(resolve_checkpoint(checkpoint))
    (sub,) = resolve_specs([parse_subnet(subnet)], ckpt, data_dir)
    return ckpt, sub
