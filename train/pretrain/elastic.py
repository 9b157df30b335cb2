"""Training-time sampling of elastic sub-models (depth, width, top-k), one per micro-batch.

Each dimension is sampled independently from a generator seeded by ``(seed, step, micro)``, so the
sequence of sub-models is a pure function of the step (exact resume, identical on every process):
  * depth: all layers w.p. ``p_full_depth``; else ``L' ~ U{ceil(min_depth * L) .. L-1}`` layers,
    keeping the first and last layer and a random subset of the middle, order preserved;
  * width: all routed experts w.p. ``p_full_width``; else a random ``width_fraction`` of them,
    one subset shared by all MoE layers of the micro-batch;
  * top-k: the default w.p. ``p_default_top_k``; else ``k' ~ U{min_top_k .. k-1}``.
The sampled full model and sub-models share one objective and one backward (no distillation).

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §3.3 (75/25 depth, 80/20 width and sparsity).

Deviations:
  1. Sampled per micro-batch rather than per training instance: all rows of a micro-batch share
     one sub-model, which keeps every MoE GEMM dense; over many micro-batches the marginals match.
  2. The report does not say which layers are skipped; we keep the first and last layer (the MTP
     module and later the audio heads consume the top of the stack) and drop a random middle subset.
"""

from __future__ import annotations

import math
import random

from ernie5.model.config import ModelConfig
from ernie5.model.elastic import Subnet
from train.pretrain.config import ElasticConfig


def sample_subnet(
    cfg: ElasticConfig, model: ModelConfig, seed: int, step: int, micro: int
) -> tuple[Subnet, dict]:
    """The sub-model of micro-batch ``micro`` of optimizer step ``step``, and its dimensions."""
    full = Subnet.full(model)
    n, e, k = model.n_layers, model.moe.n_experts, model.moe.top_k
    if not cfg.enabled:
        return full, {"depth": n, "width": e, "top_k": k}
    rng = random.Random(f"elastic/{seed}/{step}/{micro}")
    layers = full.layers
    if n > 2 and rng.random() >= cfg.p_full_depth:
        lo = max(2, math.ceil(cfg.min_depth * n))
        depth = rng.randint(min(lo, n - 1), n - 1)
        middle = rng.sample(range(1, n - 1), depth - 2)
        layers = tuple(sorted([0, n - 1, *middle]))
    experts = full.experts
    n_width = e
    if e > 1 and rng.random() >= cfg.p_full_width:
        n_width = max(k, round(cfg.width_fraction * e))
        if n_width < e:
            kept = tuple(sorted(rng.sample(range(e), n_width)))
            experts = tuple(kept if model.is_moe_layer(i) else None for i in range(n))
    top_k = k
    if k > cfg.min_top_k and rng.random() >= cfg.p_default_top_k:
        top_k = rng.randint(cfg.min_top_k, k - 1)
    name = f"d{len(layers)}-w{n_width}-k{top_k}"
    subnet = Subnet(
        layers, experts, top_k, "full" if (layers, experts, top_k) == (full.layers, full.experts, k) else name
    )
    return subnet, {"depth": len(layers), "width": n_width, "top_k": top_k}
