"""The unified backbone: embeddings, transformer blocks (attention + MoE), output heads and MTP.

One forward, top to bottom (:meth:`Ernie5Model.forward`):
  1. Embed: text ids through the token table; continuous inputs (merged image features, NFSP
     generation inputs, summed codec frames, speaker starts) placed where their masks say.
  2. Context: Uni-RoPE tables from the ``(t, h, w)`` positions and the (document, block) mask over
     the cached prefix and the new positions.
  3. Layers: the subnet's kept layers in order (skipped layers are identity on the residual
     stream), each with the subnet's top-k and available experts; the NCP audio heads read the top
     kept layers and add their codes' embeddings before the next layer.
  4. Heads: the final norm, then the text logits and loss, the MTP losses, the vision bit logits
     and loss. Each head owns its loss.

The elastic :class:`~ernie5.model.elastic.Subnet` is an argument; the model is never mutated.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2 (unified backbone, modality-specific input
    embeddings and output heads), §2.1 (MTP), §3.3 (elastic sub-models).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ernie5.model.attention import LayerContext
from ernie5.model.audio import AudioModule
from ernie5.model.block import Block
from ernie5.model.config import ModelConfig
from ernie5.model.elastic import Subnet
from ernie5.model.head import TextHead
from ernie5.model.inputs import Inputs, Targets
from ernie5.model.kv_cache import KVCache
from ernie5.model.mask import build_mask
from ernie5.model.moe import MoE, RouterOutput
from ernie5.model.mtp import MTPModule, shift_targets
from ernie5.model.rope import inv_frequencies, rope_cos_sin, text_positions
from ernie5.model.vision import VisionModule


@dataclass
class Losses:
    """The training losses of one forward; None where the batch has no such targets."""

    text: torch.Tensor | None = None
    """Weighted mean next-token NLL over positions with a target."""
    nll_BT: torch.Tensor | None = None
    """Per-position next-token NLL (0 where there is no target); for per-modality accounting."""
    mtp: list[torch.Tensor] = field(default_factory=list)
    """One mean NLL per MTP depth."""
    aux: torch.Tensor | None = None
    """Sum of the MoE balance and z losses over layers (already scaled by their coefficients)."""
    vision: torch.Tensor | None = None
    """Weighted bitwise BCE of the NFSP generation positions."""
    audio: torch.Tensor | None = None
    """Weighted mean NCP cross-entropy over levels."""
    audio_levels: list[torch.Tensor] = field(default_factory=list)
    """Mean NCP cross-entropy of each level (for logging)."""


@dataclass
class ModelOutput:
    """Everything a forward returns. What was not asked for is None or empty."""

    hidden_BTD: torch.Tensor
    """Hidden state after the last kept layer (before the final norm)."""
    logits_BTV: torch.Tensor | None = None
    routing: dict[int, RouterOutput] = field(default_factory=dict)
    """Per kept MoE layer: routing decisions and tokens per expert."""
    losses: Losses = field(default_factory=Losses)
    bit_logits_PD: torch.Tensor | None = None
    """Bit logits of every NFSP generation position, in row-major order."""
    audio_logits: list[torch.Tensor] = field(default_factory=list)
    """Per NCP level, ``(P, K[+1])`` logits of every prediction position, in row-major order."""
    audio_codes_PQ: torch.Tensor | None = None
    """The codes fed between layers at every prediction position (targets, or sampled)."""


@torch.no_grad()
def init_parameter_(name: str, p: torch.Tensor, cfg: ModelConfig) -> None:
    """The initial value of parameter ``name`` of an :class:`Ernie5Model`, in place: Normal(0,
    init_std) for weights and embeddings (residual output projections scaled by 1/sqrt(2L)); norm
    weights 1; biases 0. Shared by the one-process model and the sharded init of a parallel run
    (``train.pretrain.parallel.init``), which draws each full tensor in the same order."""
    std = cfg.init_std
    if name.endswith("bias"):
        nn.init.zeros_(p)
    elif p.dim() == 1 and "norm" in name:
        nn.init.ones_(p)  # RMSNorm / LayerNorm weights
    elif name.endswith(("wo.weight", "w2.weight", "ffn.w2")):
        nn.init.normal_(p, std=std / math.sqrt(2 * cfg.n_layers))
    else:
        nn.init.normal_(p, std=std)


class Ernie5Model(nn.Module):
    """Decoder-only unified backbone with elastic sub-models."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, cfg.is_moe_layer(i)) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = TextHead(cfg.d_model, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.mtp = nn.ModuleList(MTPModule(cfg) for _ in range(cfg.mtp.n_depth))
        self.vision = VisionModule(cfg.vision, cfg.d_model) if cfg.vision.enabled else None
        self.audio = AudioModule(cfg.audio, cfg.d_model, cfg.norm_eps) if cfg.audio.enabled else None
        self.register_buffer("inv_freq", inv_frequencies(cfg.dim_head, cfg.rope_theta), persistent=False)
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every parameter by :func:`init_parameter_`, in ``named_parameters`` order (one draw stream
        from the global RNG), then the buffers (:meth:`reset_buffers`)."""
        for name, p in self.named_parameters():
            init_parameter_(name, p, self.cfg)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The router biases 0 and the rotary frequencies recomputed (what a model made on the meta
        device and materialised with ``to_empty`` needs besides its parameters)."""
        for m in self.modules():
            if isinstance(m, MoE):
                m.router_bias.zero_()
        self.inv_freq.copy_(inv_frequencies(self.cfg.dim_head, self.cfg.rope_theta))

    def new_cache(
        self, batch: int, max_len: int, dtype: torch.dtype | None = None, mtp: bool = False
    ) -> KVCache:
        """An empty KV cache for ``batch`` rows (for the backbone, or for the MTP blocks)."""
        n = len(self.mtp) if mtp else self.cfg.n_layers
        dtype = dtype or self.tok_emb.weight.dtype
        return KVCache(
            n, batch, self.cfg.n_kv_heads, self.cfg.dim_head, max_len, dtype, self.tok_emb.weight.device
        )

    # ------------------------------------------------------------------ 1-2: embed, context
    def embed(self, inputs: Inputs) -> torch.Tensor:
        """Step 1: token embeddings with every continuous input placed where its mask says."""
        x_BTD = self.tok_emb(inputs.ids_BT.clamp_min(0))
        if inputs.embeds_MD is not None:
            x_BTD = x_BTD.masked_scatter(inputs.embed_mask_BT[..., None], inputs.embeds_MD.to(x_BTD.dtype))
        if inputs.vision is not None:
            if self.vision is None:
                raise ValueError("this model has no vision module (model.vision.enabled is false)")
            x_BTD = self.vision.embed(x_BTD, inputs.vision)
        if inputs.audio is not None:
            if self.audio is None:
                raise ValueError("this model has no audio module (model.audio.enabled is false)")
            x_BTD = self.audio.embed(x_BTD, inputs.audio)
        return x_BTD

    def context(
        self,
        positions_3BT: torch.Tensor,
        doc_ids_BT: torch.Tensor,
        block_ids_BT: torch.Tensor,
        cache: KVCache | None,
    ) -> LayerContext:
        """Step 2: rotary tables and the mask of the new positions over the cache and themselves."""
        cos_BTP, sin_BTP = rope_cos_sin(positions_3BT, self.inv_freq, self.cfg.sections)
        doc_k, blk_k = doc_ids_BT, block_ids_BT
        if cache is not None:  # keys are the cached prefix followed by the new positions
            doc_k, blk_k = cache.begin(doc_ids_BT, block_ids_BT)
        mask = build_mask(doc_ids_BT, block_ids_BT, doc_k, blk_k, self.cfg.attn_impl)
        return LayerContext(cos_BTP, sin_BTP, mask, cache)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        inputs: Inputs | torch.Tensor,
        *,
        subnet: Subnet | None = None,
        cache: KVCache | None = None,
        targets: Targets | torch.Tensor | None = None,
        audio_sampler: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        return_logits: bool = True,
        routing_replay: dict[int, torch.Tensor] | None = None,
    ) -> ModelOutput:
        """Run the (sub-)model on a packed batch.

        Args:
            inputs: the packed positions (a ``(B, T)`` tensor of ids is ``Inputs(ids)``); unset
                positions, documents and blocks default to one causal document per row that
                continues the cache.
            subnet: elastic sub-model (None = full model).
            cache: KV cache for incremental decoding (the positions are appended to it).
            targets: next-token targets of the text head (a tensor is ``Targets(ids)``); enables
                the text and MTP losses. Vision and audio targets travel in ``inputs``.
            audio_sampler: at inference, ``(level, logits_PK) -> codes_P`` picks each NCP level's
                code; its embedding is added to the hidden state before the next level's head.
            return_logits: also return the text logits of every position.
            routing_replay: Rollout Routing Replay (R3): MoE layer index -> ``(B, T, A)`` int64
                expert ids for this forward's positions (``A`` = the subnet's top-k), each row
                -1 where the position is routed normally. Those rows use the given experts in the
                given slot order, gated by the current router scores (so the router still gets a
                gradient); ``out.routing`` reports them. Every key must be a kept MoE layer.
        """
        if isinstance(inputs, torch.Tensor):
            inputs = Inputs(inputs)
        if isinstance(targets, torch.Tensor):
            targets = Targets(targets)
        subnet = subnet or Subnet.full(self.cfg)
        ctx = self.context(*self._positions(inputs, cache), cache)
        x_BTD = self.embed(inputs)

        audio = inputs.audio if inputs.audio is not None and inputs.audio.pred_mask_BT is not None else None
        if audio is not None and audio.targets_PQ is None and audio_sampler is None:
            raise ValueError("NCP positions need targets (training) or an audio_sampler (inference)")
        ncp_levels = self.audio.level_layers(subnet.layers) if audio is not None else {}
        out = ModelOutput(hidden_BTD=x_BTD)
        codes, aux = [], []
        n_exp, blocks = self.cfg.moe.n_experts, list(self.layers)
        if routing_replay is not None:
            self._check_replay(routing_replay, subnet)
        for i in subnet.layers:
            mask_E = subnet.expert_mask(i, n_exp, x_BTD.device)
            if routing_replay is None or i not in routing_replay:
                x_BTD, r = blocks[i](x_BTD, ctx, i, subnet.top_k, mask_E)
            else:
                x_BTD, r = blocks[i](x_BTD, ctx, i, subnet.top_k, mask_E, routing_replay[i])
            if r is not None:
                out.routing[i] = r
                aux += [loss for loss in (r.aux_loss, r.z_loss) if loss is not None]
            for level in ncp_levels.get(i, ()):
                x_BTD, logits_PK, codes_P, loss = self.audio.predict_level(level, x_BTD, audio, audio_sampler)
                out.audio_logits.append(logits_PK)
                codes.append(codes_P)
                if loss is not None:
                    out.losses.audio_levels.append(loss)
        if cache is not None:
            cache.commit()

        out.hidden_BTD = x_BTD
        out.losses.aux = torch.stack(aux).sum() if aux else None
        if return_logits or targets is not None:
            hn_BTD = self.norm(x_BTD)
            if return_logits:
                out.logits_BTV = self.head(hn_BTD)
            if targets is not None:
                out.losses.text, out.losses.nll_BT = self.head.loss(hn_BTD, targets)
                out.losses.mtp = self._mtp_losses(x_BTD, targets, ctx)
        gen = inputs.vision.gen if inputs.vision is not None else None
        if gen is not None:
            out.bit_logits_PD = self.vision.head(self.norm(x_BTD[inputs.vision.gen_mask_BT])).float()
            if gen.targets_PD is not None:
                out.losses.vision = self.vision.loss(out.bit_logits_PD, gen)
        if codes:
            out.audio_codes_PQ = torch.stack(codes, dim=1)
        if out.losses.audio_levels:
            out.losses.audio = self.audio.loss(out.losses.audio_levels)
        return out

    def _check_replay(self, routing_replay: dict[int, torch.Tensor], subnet: Subnet) -> None:
        """Every replayed layer is an MoE layer that ``subnet`` keeps (shapes: :class:`MoE`)."""
        kept = set(subnet.layers)
        bad = sorted(i for i in routing_replay if i not in kept or not isinstance(self.layers[i].ffn, MoE))
        if bad:
            raise ValueError(
                f"routing_replay: layers {bad} are not MoE layers kept by subnet {subnet.name!r}"
            )

    def _positions(
        self, inputs: Inputs, cache: KVCache | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``inputs``' positions, document ids and block ids, defaults filled in."""
        b, t = inputs.ids_BT.shape
        device = inputs.ids_BT.device
        start = cache.length if cache is not None else 0
        positions_3BT = inputs.positions_3BT
        if positions_3BT is None:
            positions_3BT = text_positions(b, t, start, device)
        doc_ids_BT = inputs.doc_ids_BT
        if doc_ids_BT is None:
            doc_ids_BT = torch.zeros(b, t, dtype=torch.long, device=device)
        block_ids_BT = inputs.block_ids_BT
        if block_ids_BT is None:
            block_ids_BT = torch.arange(start, start + t, device=device).expand(b, t)
        return positions_3BT, doc_ids_BT, block_ids_BT

    # ------------------------------------------------------------------ MTP
    def _mtp_losses(self, h_BTD: torch.Tensor, targets: Targets, ctx: LayerContext) -> list[torch.Tensor]:
        """Mean NLL of each MTP depth: depth ``k`` at position ``i`` is fed ``t_{i+k}`` and predicts
        ``t_{i+k+1}``; both must be real targets."""
        losses = []
        next_ids_BT = tgt_BT = targets.ids_BT
        for k, module in enumerate(self.mtp):
            tgt_BT = shift_targets(tgt_BT, next_ids_BT)
            h_BTD = module(h_BTD, self.tok_emb(next_ids_BT.clamp_min(0)), ctx, k)
            loss, _ = self.head.loss(module.norm_out(h_BTD), Targets(tgt_BT, targets.weights_BT))
            losses.append(loss)
            next_ids_BT = tgt_BT
        return losses

    def mtp_draft(
        self, h_BTD: torch.Tensor, next_ids_BT: torch.Tensor, mtp_cache: KVCache, positions_3BT: torch.Tensor
    ) -> torch.Tensor:
        """Logits of the first MTP depth for positions whose next token is known (decoding).

        ``h_BTD`` are backbone hidden states at those positions and ``next_ids_BT`` the tokens that
        follow them; the MTP block's cache advances by ``T``.
        """
        b, t, _ = h_BTD.shape
        start = mtp_cache.length
        blk_BT = torch.arange(start, start + t, device=h_BTD.device).expand(b, t)
        doc_BT = torch.zeros(b, t, dtype=torch.long, device=h_BTD.device)
        ctx = self.context(positions_3BT, doc_BT, blk_BT, mtp_cache)
        module = self.mtp[0]
        x_BTD = module(h_BTD, self.tok_emb(next_ids_BT), ctx, 0)
        mtp_cache.commit()
        return self.head(module.norm_out(x_BTD))
