"""Parameter and FLOP accounting for a config, optionally under an elastic subnet.

Definitions (used by ``ernie5 params``, the harness's efficiency columns and the benchmarks):
  * ``total_params``: parameters of the (sub-)model as a standalone checkpoint would hold them:
    kept layers, kept routed experts (and their router rows), shared experts, embeddings, the text
    head and the MTP modules.
  * ``active_params``: parameters used to process one token in a plain forward: everything except
    the routed experts a token does not select and the MTP modules (they only serve training and
    speculative drafting) and the vision and audio modules (a text token never touches them). The input
    embedding table is counted whole, as Hugging Face does.
  * ``active_params_no_embedding``: the same without the input embedding (the MFU convention).
  * ``flops_per_token``: forward FLOPs per token, ``2 * active_params_no_embedding`` for the
    matmuls plus attention scores and values ``4 * layers * heads * head_dim * ctx`` with ``ctx``
    the mean causal context of a ``seq_len`` sequence, ``(seq_len + 1) / 2``.
  * ``train_flops_per_token``: model FLOPs of one training step per token (the MFU numerator):
    three times (forward + both backward GEMMs) the forward FLOPs of everything a pretraining step
    runs for a text token: the trunk's matmuls (as in ``flops_per_token`` but without the norm
    weights, which are not matmuls, and with the output head even when it is tied to the
    embedding, since its matmul runs either way) and attention cores, and each MTP module (its
    ``2d -> d`` projection, its dense block with causal attention, and the shared head's logits
    again). This is Megatron-LM's accounting (``num_floating_point_operations``: MTP projections
    and ``(mtp_num_layers + 1)`` logit terms, causal attention cores); norms, activations, routing
    and the optimizer are not FLOPs in this sense. ``6 * active_params_no_embedding`` is the
    PaLM-style trunk-only figure, which leaves out the attention cores and the MTP modules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ernie5.model.config import ModelConfig
from ernie5.model.elastic import Subnet


@dataclass(frozen=True)
class ParamReport:
    """Counts of one (sub-)model."""

    total_params: int
    active_params: int
    active_params_no_embedding: int
    activation_rate: float
    flops_per_token: float
    matmul_flops_per_token: float
    attn_flops_per_token: float
    mtp_flops_per_token: float
    train_flops_per_token: float
    seq_len: int
    n_layers: int
    top_k: int
    routed_experts_per_layer: float

    def to_dict(self) -> dict:
        """JSON-able dict."""
        return asdict(self)


def _attn_matmul_params(cfg: ModelConfig) -> int:
    """The q, k, v and output projections of one attention layer."""
    dh = cfg.dim_head
    return cfg.d_model * (cfg.n_heads + 2 * cfg.n_kv_heads) * dh + cfg.n_heads * dh * cfg.d_model


def _attn_params(cfg: ModelConfig) -> int:
    qk_norms = 2 * cfg.dim_head if cfg.qk_norm else 0
    return _attn_matmul_params(cfg) + qk_norms + 2 * cfg.d_model  # + the block's two norms


def _swiglu_params(d: int, f: int) -> int:
    return 3 * d * f


def _block_counts(cfg: ModelConfig, layer: int, n_experts_kept: int, top_k: int) -> tuple[int, int]:
    """(total, active) parameters of one block."""
    attn = _attn_params(cfg)
    if not cfg.is_moe_layer(layer):
        ffn = _swiglu_params(cfg.d_model, cfg.d_ff)
        return attn + ffn, attn + ffn
    m = cfg.moe
    expert = _swiglu_params(cfg.d_model, m.d_expert)
    router = cfg.d_model * n_experts_kept
    shared = m.n_shared_experts * expert
    total = attn + router + shared + n_experts_kept * expert
    active = attn + router + shared + top_k * expert
    return total, active


def _vision_params(cfg: ModelConfig) -> int:
    """Parameters of the vision input embeddings and bitwise head (modality-specific, not backbone)."""
    if not cfg.vision.enabled:
        return 0
    from ernie5.model.vision import VisionModule

    with torch.device("meta"):
        return sum(p.numel() for p in VisionModule(cfg.vision, cfg.d_model).parameters())


def _audio_params(cfg: ModelConfig) -> int:
    """Parameters of the audio input/start embeddings, NCP heads and code embeddings."""
    if not cfg.audio.enabled:
        return 0
    from ernie5.model.audio import AudioModule

    with torch.device("meta"):
        return sum(p.numel() for p in AudioModule(cfg.audio, cfg.d_model).parameters())


def count_params(cfg: ModelConfig, subnet: Subnet | None = None, seq_len: int | None = None) -> ParamReport:
    """Analytic counts for ``cfg`` under ``subnet`` (None = full model)."""
    subnet = subnet or Subnet.full(cfg)
    seq_len = seq_len or cfg.max_seq_len
    d, v = cfg.d_model, cfg.vocab_size
    emb = v * d
    head = 0 if cfg.tie_embeddings else v * d
    # Each MTP depth: two input norms, the 2d -> d projection, a dense block, the output norm.
    mtp = cfg.mtp.n_depth * (3 * d + 2 * d * d + _attn_params(cfg) + _swiglu_params(d, cfg.d_ff))
    total = emb + head + d + mtp + _vision_params(cfg) + _audio_params(cfg)  # + final norm
    active = emb + head + d
    routed = []
    for i in subnet.layers:
        kept = subnet.n_experts_kept(i, cfg.moe.n_experts)
        t, a = _block_counts(cfg, i, kept, subnet.top_k)
        total += t
        active += a
        if cfg.is_moe_layer(i):
            routed.append(kept)
    active_no_emb = active - emb
    matmul = 2.0 * active_no_emb
    ctx = (seq_len + 1) / 2
    attn_layer = 4.0 * cfg.n_heads * cfg.dim_head * ctx
    attn = attn_layer * len(subnet.layers)
    # Training runs the MTP modules on every token: matmuls of the projection, the block and the
    # shared head (norm weights are not matmuls), and the block's causal attention core.
    mtp_block = 2 * d * d + _attn_matmul_params(cfg) + _swiglu_params(d, cfg.d_ff)
    mtp_flops = cfg.mtp.n_depth * (2.0 * (mtp_block + v * d) + attn_layer)
    # The trunk's matmuls: the active parameters without the norm weights, with the head's matmul
    # even when it is tied to the embedding.
    norm_weights = d + len(subnet.layers) * (_attn_params(cfg) - _attn_matmul_params(cfg))
    trunk = 2.0 * (active_no_emb - norm_weights + (v * d if cfg.tie_embeddings else 0))
    return ParamReport(
        total_params=total,
        active_params=active,
        active_params_no_embedding=active_no_emb,
        activation_rate=active / total,
        flops_per_token=matmul + attn,
        matmul_flops_per_token=matmul,
        attn_flops_per_token=attn,
        mtp_flops_per_token=mtp_flops,
        train_flops_per_token=3.0 * (trunk + attn + mtp_flops),
        seq_len=seq_len,
        n_layers=len(subnet.layers),
        top_k=subnet.top_k,
        routed_experts_per_layer=sum(routed) / len(routed) if routed else 0.0,
    )


def count_instantiated(model: torch.nn.Module) -> int:
    """Parameters of an instantiated model (tied weights counted once); works on the meta device."""
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n
