"""The unified backbone: embeddings, transformer blocks (attention + MoE), text head and MTP.

``Ernie5Model.forward`` takes the elastic :class:`~ernie5.model.elastic.Subnet` as an argument and never
mutates the model: layers outside the subnet are skipped (identity on the residual stream),
excluded experts are masked in the router, and top-k is the subnet's.

Multi-token prediction (MTP) follows DeepSeek-V3 with D sequential modules sharing the embedding
and the output head: ``h'_i = W [RMSNorm(h_i); RMSNorm(Emb(t_{i+k}))]`` -> one transformer block ->
shared head predicts ``t_{i+k+1}``.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2, §2.1 (unified backbone, MTP), §3.3 (elastic).
  * DeepSeek-V3 (arXiv 2412.19437) §2.2 (MTP modules, loss ``lambda / D * sum_k L_k``).

Deviations:
  1. The MTP block uses a dense SwiGLU FFN (width ``d_ff``) rather than an MoE block, so the draft
     path does not depend on elastic width; DeepSeek-V3's MTP block is an MoE block.
  2. The report does not disclose the MTP depth; D = 1 by default, as in DeepSeek-V3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ernie5.kernels import kernels, ops
from ernie5.model.attention import Attention
from ernie5.model.audio import AudioModule
from ernie5.model.config import ModelConfig
from ernie5.model.elastic import Subnet

if TYPE_CHECKING:
    from collections.abc import Callable

    from ernie5.sequence import AudioInputs, VisionInputs
from ernie5.model.kv_cache import KVCache
from ernie5.model.linear import Linear
from ernie5.model.loss import IGNORE, linear_cross_entropy
from ernie5.model.mask import AttnMask, build_mask
from ernie5.model.moe import MoE, RouterOutput, SwiGLU
from ernie5.model.norm import RMSNorm
from ernie5.model.rope import inv_frequencies, rope_cos_sin, text_positions
from ernie5.model.vision import VisionModule


@dataclass
class ModelOutput:
    """Everything a forward returns. Tensors not asked for are None."""

    hidden_BTD: torch.Tensor
    """Final hidden state after the last kept layer (before the final norm)."""
    logits_BTV: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    """Weighted mean next-token NLL over positions with a target."""
    nll_BT: torch.Tensor | None = None
    """Per-position next-token NLL (0 where there is no target); for per-modality accounting."""
    mtp_losses: list[torch.Tensor] = field(default_factory=list)
    """One mean NLL per MTP depth."""
    aux_loss: torch.Tensor | None = None
    """Sum of the MoE balance and z losses over layers (already scaled by their coefficients)."""
    routing: dict[int, RouterOutput] = field(default_factory=dict)
    """Per kept MoE layer: routing decisions and tokens per expert."""
    vision_loss: torch.Tensor | None = None
    """Weighted bitwise BCE of the NFSP generation positions (when they carry targets)."""
    bit_logits_PD: torch.Tensor | None = None
    """Bit logits of every NFSP generation position, in row-major order."""
    audio_loss: torch.Tensor | None = None
    """Weighted mean NCP cross-entropy over levels (when the audio positions carry targets)."""
    audio_level_losses: list[torch.Tensor] = field(default_factory=list)
    """Mean NCP cross-entropy of each level (for logging)."""
    audio_logits: list[torch.Tensor] = field(default_factory=list)
    """Per level, ``(P, K[+1])`` logits of every NCP prediction position, in row-major order."""
    audio_codes_PQ: torch.Tensor | None = None
    """The codes fed between layers at every prediction position (targets, or sampled)."""


@dataclass
class _Context:
    cos: torch.Tensor
    sin: torch.Tensor
    mask: AttnMask
    cache: KVCache | None


class Block(nn.Module):
    """Pre-norm transformer block: attention, then a dense or MoE SwiGLU FFN."""

    def __init__(self, cfg: ModelConfig, is_moe: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn: MoE | SwiGLU = MoE(cfg.d_model, cfg.moe) if is_moe else SwiGLU(cfg.d_model, cfg.d_ff)
        self._fused_plan: tuple | None = None  # see _fused_weights

    def forward(
        self,
        x_BTD: torch.Tensor,
        ctx: _Context,
        layer: int,
        top_k: int | None = None,
        expert_mask_E: torch.Tensor | None = None,
        dispatch: str | None = None,
    ) -> tuple[torch.Tensor, RouterOutput | None]:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), ctx.cos, ctx.sin, ctx.mask, ctx.cache, layer)
        h_BTD = self.ffn_norm(x_BTD)
        if isinstance(self.ffn, MoE):
            y_BTD, r = self.ffn(h_BTD, top_k, expert_mask_E, dispatch)
            return x_BTD + y_BTD, r
        return x_BTD + self.ffn(h_BTD), None

    def forward_fused(
        self,
        x_BTD: torch.Tensor,
        ctx: _Context,
        layer: int,
        top_k: int | None = None,
        expert_mask_E: torch.Tensor | None = None,
        dispatch: str | None = None,
    ) -> tuple[torch.Tensor, RouterOutput | None] | None:
        """:meth:`forward` of a decoding step in one kernel call (``decode_layer`` of
        :mod:`ernie5.kernels`): the same kernels in the same order, so the same result, without
        some 60 Python-level calls per layer. ``None`` where it does not apply (the caller checked
        the step with :func:`fused_decode_ok`; this checks the layer: its weights in ``x``'s
        dtype, experts the kernel takes, and the gather path being the one the module path
        would take for this step)."""
        ffn = self.ffn
        moe = isinstance(ffn, MoE)
        if moe:
            k = top_k or ffn.cfg.top_k
            x_ND = x_BTD.view(-1, x_BTD.shape[-1])
            if ffn.expert_path(x_ND, k, x_BTD.dtype, dispatch) != "gather":
                return None
        else:
            k = 1
        weights = self._fused_weights(x_BTD.dtype)
        if weights is None:
            return None
        mask, cache = ctx.mask, ctx.cache
        out = kernels().decode_layer(
            x_BTD.contiguous(),
            ctx.cos,
            ctx.sin,
            cache.k[layer],
            cache.v[layer],
            cache.length,
            mask.dense_B1TS if mask.dense_B1TS is not None else ops.NO_MASK,
            mask.is_causal,
            expert_mask_E if expert_mask_E is not None else ops.NO_MASK,
            k,
            *weights,
        )
        if not moe:
            return out[0], None
        return out[0], RouterOutput(out[1], out[2], out[3], None, None)

    def _fused_weights(self, dtype: torch.dtype) -> tuple | None:
        """The layer's half of ``decode_layer``'s arguments (weights, eps, routing settings, head
        counts), or None where the kernel does not take the layer in ``dtype``.

        Built once and kept with the submodules, parameters and buffers it was built from; every
        call checks, by dictionary lookups, that those are still the layer's and its parameters in
        ``dtype`` (``.to()`` keeps parameter objects and changes their data; assigning a new
        module, parameter or buffer rebuilds)."""
        plan = self._fused_plan
        if plan is not None:
            for owner, name, t, typed in plan[0]:
                if owner.get(name) is not t or (typed and t.dtype != dtype):
                    break
            else:
                return plan[1]
        owned, args = _fused_plan(self)
        ok = _fused_shapes_ok(self) and all(
            not typed or (t.is_cpu and t.dtype == dtype) for _, _, t, typed in owned
        )
        self._fused_plan = (owned, args if ok else None)
        return self._fused_plan[1]


_EMPTY = torch.empty(0)


def _fused_plan(block: Block) -> tuple[list, tuple]:
    """``([(owner dict, name, object, in x's dtype?) ...], decode_layer's weight arguments)``: every
    submodule, parameter and buffer the arguments come from, with the ``_modules``,
    ``_parameters`` or ``_buffers`` dict that holds it (where assignment and ``.to()`` put new
    ones)."""
    owned: list = []

    def sub(module: nn.Module, name: str) -> nn.Module | None:
        child = module._modules.get(name)
        owned.append((module._modules, name, child, False))
        return child

    def param(module: nn.Module | None, name: str = "weight") -> torch.Tensor:
        if module is None:
            return _EMPTY
        p = module._parameters[name]
        owned.append((module._parameters, name, p, True))
        return p

    def buffer(module: nn.Module, name: str) -> torch.Tensor:
        b = module._buffers[name]
        owned.append((module._buffers, name, b, False))  # any float dtype: the kernel reads it as fp32
        return b

    def eps(norm: RMSNorm) -> float:
        return norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps  # dtype: checked

    attn, ffn, attn_norm, ffn_norm = (sub(block, n) for n in ("attn", "ffn", "attn_norm", "ffn_norm"))
    q_norm, k_norm = sub(attn, "q_norm"), sub(attn, "k_norm")
    moe = isinstance(ffn, MoE)
    shared = sub(ffn, "shared") if moe else ffn
    if moe:
        c = ffn.cfg
        routed = (
            param(sub(ffn, "router")),
            buffer(ffn, "router_bias"),
            c.score_func == "sigmoid",
            c.norm_topk,
            c.route_scale,
        )
        experts = (param(ffn, "w13"), param(ffn, "w2"))
    else:
        routed, experts = (_EMPTY, _EMPTY, False, False, 1.0), (_EMPTY, _EMPTY)
    args = (
        param(attn_norm),
        eps(attn_norm),
        param(sub(attn, "wqkv")),
        param(q_norm),
        param(k_norm),
        eps(q_norm) if q_norm is not None else 0.0,
        param(sub(attn, "wo")),
        param(ffn_norm),
        eps(ffn_norm),
        *routed,
        *experts,
        param(sub(shared, "w13") if shared is not None else None),
        param(sub(shared, "w2") if shared is not None else None),
        attn.n_heads,
        attn.n_kv_heads,
    )
    return owned, args


def _fused_shapes_ok(block: Block) -> bool:
    """Whether ``decode_layer`` takes this layer's experts (``d_expert`` a multiple of 16)."""
    ffn = block.ffn
    return not isinstance(ffn, MoE) or ffn.cfg.d_expert % 16 == 0


def fused_decode_ok(
    x_BTD: torch.Tensor, cfg: ModelConfig, cache: KVCache | None, mask: AttnMask, dispatch: str | None
) -> bool:
    """Whether this forward is a decoding step that :meth:`Block.forward_fused` can run: a KV cache,
    at most :data:`~ernie5.kernels.ops.ROWS_MAX` token rows, nothing to differentiate, no autocast,
    on CPU in bf16 or fp32 with the decoding kernels built, a dense or no mask, the default expert
    path, and a model shape the kernels take (head dim and ``d_model`` multiples of 16, head dim
    at most 128)."""
    b, t, d = x_BTD.shape
    if cache is None or b * t > ops.ROWS_MAX or torch.is_grad_enabled() or not x_BTD.is_cpu:
        return False
    kern = kernels()
    return (
        kern is not None
        and mask.block_mask is None
        and dispatch in (None, "auto", "gather")
        and x_BTD.dtype in ops.FUSED_DTYPES
        and not torch.is_autocast_enabled("cpu")
        and d % 16 == 0
        and cfg.dim_head % 16 == 0
        and cfg.dim_head <= 128
        and cfg.d_ff % 16 == 0
        and kern.rows_kernels_available()
        and kern.router_linear_available()
    )


class MTPModule(nn.Module):
    """One DeepSeek-V3 MTP depth: combine ``h_i`` with ``Emb(t_{i+k})``, one block, shared head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm_h = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.norm_e = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.proj = Linear(2 * cfg.d_model, cfg.d_model)
        self.block = Block(cfg, is_moe=False)
        self.norm_out = RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(
        self, h_BTD: torch.Tensor, emb_BTD: torch.Tensor, ctx: _Context, layer: int = 0
    ) -> torch.Tensor:
        x_BTD = self.proj(torch.cat([self.norm_h(h_BTD), self.norm_e(emb_BTD)], dim=-1))
        x_BTD, _ = self.block(x_BTD, ctx, layer)
        return x_BTD


class Ernie5Model(nn.Module):
    """Decoder-only unified backbone with elastic sub-models."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, cfg.is_moe_layer(i)) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = Linear(cfg.d_model, cfg.vocab_size)
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
        """Normal(0, init_std) for weights and embeddings (residual output projections scaled by
        1/sqrt(2L)); norm weights 1; biases 0."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 1 and "norm" in name:
                nn.init.ones_(p)  # RMSNorm / LayerNorm weights
            elif name.endswith(("wo.weight", "w2.weight", "ffn.w2")):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=std)
        for m in self.modules():
            if isinstance(m, MoE):
                m.router_bias.zero_()
        self.inv_freq.copy_(inv_frequencies(self.cfg.dim_head, self.cfg.rope_theta))

    # ------------------------------------------------------------------ helpers
    def new_cache(
        self, batch: int, max_len: int, dtype: torch.dtype | None = None, mtp: bool = False
    ) -> KVCache:
        """An empty KV cache for ``batch`` rows (for the backbone, or for the MTP blocks)."""
        n = len(self.mtp) if mtp else self.cfg.n_layers
        dtype = dtype or self.tok_emb.weight.dtype
        return KVCache(
            n, batch, self.cfg.n_kv_heads, self.cfg.dim_head, max_len, dtype, self.tok_emb.weight.device
        )

    def _context(
        self,
        positions_3BT: torch.Tensor,
        doc_BT: torch.Tensor,
        blk_BT: torch.Tensor,
        cache: KVCache | None,
    ) -> _Context:
        cos, sin = rope_cos_sin(positions_3BT, self.inv_freq, self.cfg.sections)
        if cache is not None:
            doc_k, blk_k = cache.begin(doc_BT, blk_BT)
        else:
            doc_k, blk_k = doc_BT, blk_BT
        mask = build_mask(doc_BT, blk_BT, doc_k, blk_k, self.cfg.attn_impl)
        return _Context(cos, sin, mask, cache)

    def embed(
        self,
        input_ids_BT: torch.Tensor,
        input_embeds_MD: torch.Tensor | None = None,
        embed_mask_BT: torch.Tensor | None = None,
        vision: VisionInputs | None = None,
        audio: AudioInputs | None = None,
    ) -> torch.Tensor:
        """Text embeddings, with continuous inputs placed where their masks say: precomputed
        embeddings, merged vision-understanding features, NFSP generation inputs, summed codec
        frames and audio start/speaker positions."""
        x_BTD = self.tok_emb(input_ids_BT.clamp_min(0))
        if input_embeds_MD is not None:
            x_BTD = x_BTD.masked_scatter(embed_mask_BT[..., None], input_embeds_MD.to(x_BTD.dtype))
        if vision is not None:
            if self.vision is None:
                raise ValueError("this model has no vision module (model.vision.enabled is false)")
            if vision.und_items:
                und = torch.cat(
                    [
                        self.vision.understanding_embeds(u.pixels_CTHW[None], u.cnn_CThw[None])
                        for u in vision.und_items
                    ]
                )
                x_BTD = x_BTD.masked_scatter(vision.und_mask_BT[..., None], und.to(x_BTD.dtype))
            if vision.gen is not None:
                g = vision.gen
                gen = self.vision.generation_embeds(g.inputs_PD, g.scale_P, g.start_P, g.cell_P)
                x_BTD = x_BTD.masked_scatter(vision.gen_mask_BT[..., None], gen.to(x_BTD.dtype))
        if audio is not None:
            if self.audio is None:
                raise ValueError("this model has no audio module (model.audio.enabled is false)")
            if audio.frame_codes_MQ is not None:
                fr = self.audio.frame_embeds(audio.frame_codes_MQ)
                x_BTD = x_BTD.masked_scatter(audio.frame_mask_BT[..., None], fr.to(x_BTD.dtype))
            if audio.start_speaker_S is not None:
                st = self.audio.start_embeds(audio.start_speaker_S)
                x_BTD = x_BTD.masked_scatter(audio.start_mask_BT[..., None], st.to(x_BTD.dtype))
        return x_BTD

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids_BT: torch.Tensor,
        *,
        positions_3BT: torch.Tensor | None = None,
        doc_ids_BT: torch.Tensor | None = None,
        block_ids_BT: torch.Tensor | None = None,
        input_embeds_MD: torch.Tensor | None = None,
        embed_mask_BT: torch.Tensor | None = None,
        subnet: Subnet | None = None,
        cache: KVCache | None = None,
        targets_BT: torch.Tensor | None = None,
        loss_weights_BT: torch.Tensor | None = None,
        mtp_cache: KVCache | None = None,
        return_logits: bool = True,
        dispatch: str | None = None,
        vision: VisionInputs | None = None,
        audio: AudioInputs | None = None,
        audio_sampler: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> ModelOutput:
        """Run the (sub-)model on a packed batch.

        Args:
            input_ids_BT: text token ids (any value where ``embed_mask_BT`` is set).
            positions_3BT: Uni-RoPE positions; default ``t = h = w = cache offset + index``.
            doc_ids_BT: document id per token; default one document per row.
            block_ids_BT: attention block id per token; default ``= position index`` (causal).
            input_embeds_MD / embed_mask_BT: continuous input embeddings and where they go.
            subnet: elastic sub-model (None = full model).
            cache: KV cache for incremental decoding (positions are appended to it).
            targets_BT: next-token targets (``IGNORE`` = no loss); enables ``loss`` and MTP losses.
            loss_weights_BT: per-position loss weights (default 1), e.g. per-modality weighting.
            mtp_cache: KV cache of the MTP blocks (speculative decoding only).
            return_logits: also return the text logits of every position.
            dispatch: MoE expert path override (``loop`` for the naive reference).
            vision: vision-understanding inputs and NFSP generation positions (with bit targets in
                training); their bit logits and loss come back in the output.
            audio: codec frames, start positions and NCP prediction positions (with targets in
                training: teacher forcing; their logits and loss come back in the output).
            audio_sampler: at inference, ``(level, logits_PK) -> codes_P`` picks each level's code
                at the NCP positions; it is added to the hidden state before the next layer.
        """
        b, t = input_ids_BT.shape
        device = input_ids_BT.device
        start = cache.length if cache is not None else 0
        if positions_3BT is None:
            positions_3BT = text_positions(b, t, start, device)
        if doc_ids_BT is None:
            doc_ids_BT = torch.zeros(b, t, dtype=torch.long, device=device)
        if block_ids_BT is None:
            block_ids_BT = torch.arange(start, start + t, device=device).expand(b, t)
        subnet = subnet or Subnet.full(self.cfg)
        ctx = self._context(positions_3BT, doc_ids_BT, block_ids_BT, cache)

        x_BTD = self.embed(input_ids_BT, input_embeds_MD, embed_mask_BT, vision, audio)
        ncp = self._ncp_plan(subnet, audio, audio_sampler)
        ncp_codes: list[torch.Tensor] = []
        out = ModelOutput(hidden_BTD=x_BTD)
        routing: dict[int, RouterOutput] = {}
        aux = []
        n_exp = self.cfg.moe.n_experts
        fused = fused_decode_ok(x_BTD, self.cfg, cache, ctx.mask, dispatch)
        blocks = list(self.layers)  # one list, not a ModuleList lookup per layer
        for i in subnet.layers:
            mask_E = subnet.expert_mask(i, n_exp, device)
            step = blocks[i].forward_fused(x_BTD, ctx, i, subnet.top_k, mask_E, dispatch) if fused else None
            if step is None:
                step = blocks[i](x_BTD, ctx, i, subnet.top_k, mask_E, dispatch)
            x_BTD, r = step
            if r is not None:
                routing[i] = r
                aux += [l for l in (r.aux_loss, r.z_loss) if l is not None]
            for level in ncp.get(i, ()):
                x_BTD = self._ncp_level(level, x_BTD, audio, audio_sampler, out, ncp_codes)
        if cache is not None:
            cache.commit()

        out.hidden_BTD, out.routing = x_BTD, routing
        out.aux_loss = torch.stack(aux).sum() if aux else None
        if return_logits or targets_BT is not None:
            hn_BTD = self.norm(x_BTD)
            if return_logits:
                out.logits_BTV = self.head(hn_BTD)
        if targets_BT is not None:
            out.loss, out.nll_BT = self._head_loss(hn_BTD, targets_BT, loss_weights_BT)
            out.mtp_losses = self._mtp_losses(x_BTD, input_ids_BT, targets_BT, ctx, loss_weights_BT)
        if vision is not None and vision.gen is not None:
            h_PD = self.norm(x_BTD[vision.gen_mask_BT])
            out.bit_logits_PD = self.vision.head(h_PD).float()
            g = vision.gen
            if g.targets_PD is not None:
                bce = F.binary_cross_entropy_with_logits(
                    out.bit_logits_PD, g.targets_PD.float(), reduction="none"
                )
                w = g.weights_P if g.weights_P is not None else torch.ones_like(bce[:, 0])
                out.vision_loss = (bce.mean(dim=-1) * w).sum() / w.sum().clamp_min(1e-6)
        if out.audio_level_losses:
            ac = self.cfg.audio
            w = ac.level_weights or (1.0,) * ac.n_levels
            out.audio_loss = sum(wq * lq for wq, lq in zip(w, out.audio_level_losses, strict=True)) / sum(w)
        if out.audio_logits:
            out.audio_codes_PQ = torch.stack(ncp_codes, dim=1)
        return out

    # ------------------------------------------------------------------ Next-Codec Prediction
    def _ncp_plan(
        self, subnet: Subnet, audio: AudioInputs | None, sampler: Callable | None
    ) -> dict[int, list[int]]:
        """Layer index -> audio levels whose heads read that layer's output: level q on the
        ``(L - Q + q)``-th of the L kept layers; a subnet with fewer than Q layers stacks the first
        levels on its first layer (each level's code is still added before the next head)."""
        if audio is None or audio.pred_mask_BT is None:
            return {}
        if audio.targets_PQ is None and sampler is None:
            raise ValueError("NCP positions need targets (training) or an audio_sampler (inference)")
        q, kept = self.cfg.audio.n_levels, list(subnet.layers)
        plan: dict[int, list[int]] = {}
        for level in range(q):
            plan.setdefault(kept[max(0, len(kept) - q + level)], []).append(level)
        return plan

    def _ncp_level(
        self,
        level: int,
        x_BTD: torch.Tensor,
        audio: AudioInputs,
        sampler: Callable | None,
        out: ModelOutput,
        codes_out: list[torch.Tensor],
    ) -> torch.Tensor:
        """Run level ``level``'s head at the NCP positions and add its code's embedding."""
        mask = audio.pred_mask_BT
        h_PD = x_BTD[mask]
        logits = self.audio.logits(level, h_PD).float()
        out.audio_logits.append(logits)
        if audio.targets_PQ is not None:
            tgt = audio.targets_PQ[:, level]
            if level == 0:
                tgt = torch.where(tgt == -2, torch.full_like(tgt, self.cfg.audio.end_code), tgt)
            valid = tgt >= 0
            ce = F.cross_entropy(logits, tgt.clamp_min(0), reduction="none")
            out.audio_level_losses.append((ce * valid).sum() / valid.sum().clamp_min(1))
            codes = torch.where(valid, tgt, torch.full_like(tgt, -1))
        else:
            codes = sampler(level, logits).long()
        codes_out.append(codes)
        if level < self.cfg.audio.n_levels - 1:
            x_BTD = x_BTD.masked_scatter(mask[..., None], self.audio.add_code(level, h_PD, codes))
        return x_BTD

    def _mtp_losses(self, h_BTD, input_ids_BT, targets_BT, ctx, loss_weights_BT) -> list[torch.Tensor]:
        losses = []
        next_ids_BT = targets_BT
        tgt_BT = targets_BT
        for k, module in enumerate(self.mtp):
            # Depth k+1 at position i sees t_{i+k+1} and predicts t_{i+k+2}; both must be real targets.
            shifted = torch.full_like(tgt_BT, IGNORE)
            shifted[:, :-1] = tgt_BT[:, 1:]
            shifted = shifted.masked_fill(next_ids_BT == IGNORE, IGNORE)
            emb_BTD = self.tok_emb(next_ids_BT.clamp_min(0))
            h_BTD = module(h_BTD, emb_BTD, ctx, k)
            loss, _ = self._head_loss(module.norm_out(h_BTD), shifted, loss_weights_BT)
            losses.append(loss)
            next_ids_BT, tgt_BT = shifted, shifted
        return losses

    def _head_loss(
        self, hn_BTD: torch.Tensor, targets_BT: torch.Tensor, weights_BT: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted mean NLL of the text head and the per-position NLL (0 without a target)."""
        loss, nll_N = linear_cross_entropy(
            hn_BTD.flatten(0, 1),
            self.head.weight,
            targets_BT.flatten(),
            None if weights_BT is None else weights_BT.flatten(),
        )
        return loss, nll_N.view_as(targets_BT)

    def mtp_draft(
        self, h_BTD: torch.Tensor, next_ids_BT: torch.Tensor, mtp_cache: KVCache, positions_3BT: torch.Tensor
    ) -> torch.Tensor:
        """Logits of the first MTP depth for positions whose next token is known (decoding).

        ``h_BTD`` are backbone hidden states at those positions and ``next_ids_BT`` the tokens that
        follow them; the MTP block's cache advances by ``T``.
        """
        b, t, _ = h_BTD.shape
        start = mtp_cache.length
        blk = torch.arange(start, start + t, device=h_BTD.device).expand(b, t)
        doc = torch.zeros(b, t, dtype=torch.long, device=h_BTD.device)
        ctx = self._context(positions_3BT, doc, blk, mtp_cache)
        module = self.mtp[0]
        x = module(h_BTD, self.tok_emb(next_ids_BT), ctx, 0)
        mtp_cache.commit()
        return self.head(module.norm_out(x))
