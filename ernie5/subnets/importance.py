"""Importance calibration for deploy-time selection of layers and experts.

:func:`compute_importance` measures, on calibration batches, each layer's block influence
(``1 - cos(h_in, h_out)`` averaged over tokens, ShortGPT) and each routed expert's share of routed
pairs; the ``layers=importance`` and ``experts=importance`` deploy selections of
:func:`ernie5.subnets.spec.resolve` use them. :func:`calibration_batches` is the fixed text they
are measured on.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §3.3, §6.4.2 (sub-models deployed directly).
  * ShortGPT (arXiv 2403.03853): block influence.

Deviations:
  1. The report does not say how deploy-time layers and experts are chosen; importance is one of
     the selections the harness compares (the others are position-based or seeded random).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ernie5.data import procedural
from ernie5.model.model import Ernie5Model
from ernie5.tokenizers.special import BOS, EOS


@dataclass(frozen=True, slots=True)
class Importance:
    """Calibration statistics for importance-based deploy selection."""

    layer_influence: tuple[float, ...]
    """Block influence per layer: mean ``1 - cos(h_in, h_out)`` (ShortGPT)."""
    expert_frequency: tuple[tuple[float, ...] | None, ...]
    """Per layer, fraction of routed pairs per expert (None for dense layers)."""


def calibration_texts(data_dir: str | Path | None = None, n: int = 4) -> list[str]:
    """The calibration text: ``2 n`` seeded procedural documents, plus ``n`` 2000-character pieces of
    Tiny Shakespeare's training part when the data root has it."""
    rng = random.Random("calibration")
    texts = [procedural.procedural_document(rng) for _ in range(n * 2)]
    try:
        from ernie5.data import text as text_data

        train, _ = text_data.shakespeare_split(text_data.read_shakespeare(data_dir))
        texts += [train[i * 5000 : i * 5000 + 2000] for i in range(n)]
    except Exception:  # noqa: BLE001 - calibration text is optional
        pass
    return texts


def calibration_batches(
    tokenizer, data_dir: str | Path | None = None, n: int = 4, seq_len: int = 128
) -> list[torch.Tensor]:
    """Token batches for importance calibration: :func:`calibration_texts` in ``tokenizer``'s ids, two
    equal-length rows a batch."""
    ids = [[BOS, *tokenizer.encode(t), EOS][:seq_len] for t in calibration_texts(data_dir, n)]
    width = min(len(x) for x in ids)
    return [torch.tensor([x[:width] for x in ids[i : i + 2]]) for i in range(0, len(ids) - 1, 2)]


@torch.no_grad()
def compute_importance(model: Ernie5Model, batches: list[torch.Tensor]) -> Importance:
    """Block influence per layer and routing frequency per expert on calibration token batches."""
    cfg = model.cfg
    n = cfg.n_layers
    influence = [0.0] * n
    freq = [
        torch.zeros(cfg.moe.n_experts, dtype=torch.float64) if cfg.is_moe_layer(i) else None for i in range(n)
    ]
    hooks = []
    inputs: dict[int, torch.Tensor] = {}

    def pre(i):
        def fn(_mod, args):
            inputs[i] = args[0].detach()

        return fn

    def post(i):
        def fn(_mod, _args, output):
            h_out = output[0]
            cos = torch.nn.functional.cosine_similarity(inputs[i].float(), h_out.float(), dim=-1)
            influence[i] += float((1 - cos).mean())

        return fn

    for i, block in enumerate(model.layers):
        hooks.append(block.register_forward_pre_hook(pre(i)))
        hooks.append(block.register_forward_hook(post(i)))
    was_training = model.training
    model.eval()
    try:
        for ids in batches:
            out = model(ids, return_logits=False)
            for i, r in out.routing.items():
                freq[i] += r.counts_E.double()
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    nb = max(1, len(batches))
    return Importance(
        layer_influence=tuple(v / nb for v in influence),
        expert_frequency=tuple(
            tuple((f / f.sum().clamp_min(1)).tolist()) if f is not None else None for f in freq
        ),
    )
