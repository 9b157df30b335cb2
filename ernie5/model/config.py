"""Model configuration: frozen dataclasses, validated on construction.

Derived values are properties; nothing is mutated after construction. Field docstrings are the
documentation of every YAML key under ``model:``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ernie5.config import check


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    """Mixture-of-experts FFN with modality-agnostic routing (one router, one pool, all tokens)."""

    RETIRED: ClassVar[dict[str, object]] = {"dispatch": "auto"}
    """``dispatch`` chose the expert compute path; that is a fast path (``ernie5.fast``), not the
    model's maths, and every checkpoint written before holds its default, ``auto``."""

    n_experts: int = 64
    """Routed experts per MoE layer."""
    n_shared_experts: int = 0
    """Always-on shared experts (each of width ``d_expert``), never masked by a subnet."""
    d_expert: int = 256
    """Hidden width of one routed (and one shared) SwiGLU expert."""
    top_k: int = 2
    """Routed experts per token (the default, full-model sparsity)."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router affinity: softmax over experts (ERNIE 4.5) or per-expert sigmoid (DeepSeek-V3)."""
    norm_topk: bool = True
    """Renormalise the selected gates to sum to one, so shrinking top-k or width keeps the scale."""
    route_scale: float = 1.0
    """Multiplier on the routed mixture (DeepSeek-V3 uses 2.5 with sigmoid scores)."""
    aux_loss_coef: float = 0.0
    """Sequence-wise balance loss coefficient (DeepSeek-V3 complementary loss, 1e-4 there). 0 = off."""
    z_loss_coef: float = 0.0
    """Router z-loss coefficient (ST-MoE, 1e-3 there). 0 = off."""

    def __post_init__(self) -> None:
        check(self.n_experts >= 1, f"n_experts={self.n_experts} must be >= 1")
        check(self.n_shared_experts >= 0, f"n_shared_experts={self.n_shared_experts} must be >= 0")
        check(self.d_expert >= 1, f"d_expert={self.d_expert} must be >= 1")
        check(
            1 <= self.top_k <= self.n_experts,
            f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]",
        )
        check(self.route_scale > 0, f"route_scale={self.route_scale} must be > 0")
        check(self.aux_loss_coef >= 0, f"aux_loss_coef={self.aux_loss_coef} must be >= 0")
        check(self.z_loss_coef >= 0, f"z_loss_coef={self.z_loss_coef} must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class MTPConfig:
    """DeepSeek-V3-style multi-token prediction (sequential modules sharing embedding and head)."""

    n_depth: int = 1
    """Number of sequential MTP modules D (DeepSeek-V3 and our default: 1; 0 disables MTP)."""

    def __post_init__(self) -> None:
        check(0 <= self.n_depth <= 4, f"n_depth={self.n_depth} must be in [0, 4]")


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionConfig:
    """Image and video in the backbone: dual-path understanding inputs and bitwise NFSP generation."""

    enabled: bool = False
    """Build the vision input embeddings and the bitwise head."""
    image_size: int = 32
    """Pixels per side of a frame."""
    latent_size: int = 8
    """Latent grid per side (the tokenizer's h = w)."""
    latent_bits: int = 10
    """Bits per visual token (the tokenizer's code dims D)."""
    scales: tuple[int, ...] = (1, 2, 4, 8)
    """Multi-scale schedule (side of each scale's grid; the last equals ``latent_size``)."""
    cnn_channels: int = 64
    """Channels of the tokenizer's pre-quantisation feature map (the CNN path)."""
    vit_dim: int = 64
    """Width of the small ViT (the semantic path) and of the patch merger."""
    vit_layers: int = 2
    """ViT encoder layers."""
    vit_heads: int = 4
    """ViT attention heads (also the patch merger's)."""
    merge: int = 2
    """Adjacent latent patches merged per side (2 x 2 for images)."""
    merge_frames: int = 4
    """Adjacent frames merged for video understanding (2 x 2 x 4)."""
    max_frames: int = 16
    """Longest clip."""
    vit_stem: str = "patch"
    """How the ViT embeds pixels: ``patch`` (one linear map per ``patch`` x ``patch`` patch, as ViT) or
    ``conv`` (three 3x3 convolutions, two of stride 2, as the early-convolution ViTs)."""
    merger_positions: bool = False
    """Learned embeddings of a token's frame and cell inside its merge group, added before the merger's
    attention (without them the mean-pooled group cannot tell the order of its frames)."""

    def __post_init__(self) -> None:
        check(
            self.image_size % self.latent_size == 0,
            f"image_size={self.image_size} must be a multiple of latent_size={self.latent_size}",
        )
        check(self.latent_bits >= 1, f"latent_bits={self.latent_bits} must be >= 1")
        check(
            len(self.scales) >= 1
            and list(self.scales) == sorted(self.scales)
            and self.scales[-1] == self.latent_size,
            f"scales={list(self.scales)} must be increasing and end at latent_size={self.latent_size}",
        )
        check(
            self.latent_size % self.merge == 0,
            f"merge={self.merge} must divide latent_size={self.latent_size}",
        )
        check(
            self.vit_dim % self.vit_heads == 0,
            f"vit_heads={self.vit_heads} must divide vit_dim={self.vit_dim}",
        )
        check(self.merge_frames >= 1 and self.max_frames >= 1, "merge_frames and max_frames must be >= 1")
        check(self.vit_stem in ("patch", "conv"), f"vit_stem={self.vit_stem!r}: expected patch|conv")
        check(
            self.vit_stem == "patch" or self.patch == 4,
            f"vit_stem='conv' needs a patch of 4 pixels, got image_size/latent_size={self.patch}",
        )

    @property
    def patch(self) -> int:
        """Pixels per side of one latent cell (the ViT patch size, so both paths share the grid)."""
        return self.image_size // self.latent_size

    @property
    def tokens_per_frame(self) -> int:
        """Generation positions per frame: the sum of the scales' grid areas."""
        return sum(n * n for n in self.scales)


@dataclass(frozen=True, kw_only=True, slots=True)
class AudioConfig:
    """Audio in the backbone: summed RVQ-level input embeddings and Next-Codec Prediction heads."""

    enabled: bool = False
    """Build the audio input embeddings and the NCP heads."""
    n_levels: int = 4
    """Q: RVQ levels of the codec (one NCP head per level, in the top Q kept layers)."""
    codebook_size: int = 256
    """K: codes per level (level 1 predicts one extra code, END, that closes an audio segment)."""
    n_speakers: int = 8
    """Rows of the speaker-embedding table (the TTS conditioning context)."""
    level_weights: tuple[float, ...] = ()
    """Per-level weights of the NCP loss; empty = all 1."""
    content_dim: int = 0
    """Width of the speech-content features added to understanding frames (0 = none: frames are the
    paper's summed code embeddings only). With ``> 0``, an understanding frame's embedding also gets a
    learned projection of the frozen speech-content encoder's features of that frame
    (:mod:`ernie5.tokenizers.speech_content`); generated frames never have them."""

    def __post_init__(self) -> None:
        check(self.content_dim >= 0, f"content_dim={self.content_dim} must be >= 0")
        check(1 <= self.n_levels <= 16, f"n_levels={self.n_levels} must be in [1, 16]")
        check(self.codebook_size >= 2, f"codebook_size={self.codebook_size} must be >= 2")
        check(self.n_speakers >= 1, f"n_speakers={self.n_speakers} must be >= 1")
        check(
            not self.level_weights
            or (len(self.level_weights) == self.n_levels and all(w >= 0 for w in self.level_weights)),
            f"level_weights={list(self.level_weights)} must be empty or {self.n_levels} weights >= 0",
        )

    @property
    def end_code(self) -> int:
        """The level-1 code that ends an audio segment."""
        return self.codebook_size


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The unified decoder-only backbone."""

    vocab_size: int = 4096
    """Text vocabulary (special tokens included). Other modalities bring their own embeddings/heads."""
    d_model: int = 256
    """Residual stream width."""
    n_layers: int = 8
    """Transformer layers."""
    n_heads: int = 8
    """Query heads."""
    n_kv_heads: int = 2
    """Key/value heads (GQA); must divide ``n_heads``."""
    head_dim: int = 0
    """Per-head width; 0 means ``d_model // n_heads``."""
    qk_norm: bool = True
    """RMSNorm on each head's queries and keys before RoPE."""
    rope_theta: float = 1_000_000.0
    """RoPE base (ERNIE 5.0 uses 1e6 from the 8K stage on)."""
    rope_sections: tuple[int, ...] = ()
    """Frequency pairs given to the (t, h, w) axes of Uni-RoPE; empty = ERNIE-4.5-VL-like split."""
    max_seq_len: int = 2048
    """Longest sequence (positions and KV cache)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the text input embedding with the text output head."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    n_dense_layers: int = 0
    """The first ``n_dense_layers`` layers use a dense SwiGLU FFN instead of MoE (paper: all MoE)."""
    d_ff: int = 1024
    """Width of the dense SwiGLU FFN (dense layers and the MTP block)."""
    attn_impl: Literal["sdpa", "flex"] = "sdpa"
    """Attention kernel: SDPA with a dense boolean mask, or flex_attention with a block mask."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts settings."""
    mtp: MTPConfig = field(default_factory=MTPConfig)
    """Multi-token prediction settings."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """Image/video inputs and outputs (off unless ``vision.enabled``)."""
    audio: AudioConfig = field(default_factory=AudioConfig)
    """Speech/audio inputs and outputs (off unless ``audio.enabled``)."""

    def __post_init__(self) -> None:
        check(self.vocab_size >= 16, f"vocab_size={self.vocab_size} must be >= 16")
        check(self.d_model >= 8, f"d_model={self.d_model} must be >= 8")
        check(self.n_layers >= 1, f"n_layers={self.n_layers} must be >= 1")
        check(self.n_heads >= 1, f"n_heads={self.n_heads} must be >= 1")
        check(
            self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0,
            f"n_kv_heads={self.n_kv_heads} must be >= 1 and divide n_heads={self.n_heads}",
        )
        check(self.head_dim >= 0, f"head_dim={self.head_dim} must be >= 0")
        check(
            self.head_dim > 0 or self.d_model % self.n_heads == 0,
            f"d_model={self.d_model} must be divisible by n_heads={self.n_heads} when head_dim=0",
        )
        check(self.dim_head % 2 == 0, f"head_dim={self.dim_head} must be even (rotary pairs)")
        if self.rope_sections:
            check(
                len(self.rope_sections) == 3 and sum(self.rope_sections) == self.dim_head // 2,
                f"rope_sections={list(self.rope_sections)} must be 3 ints summing to head_dim/2="
                f"{self.dim_head // 2}",
            )
        check(self.rope_theta > 1, f"rope_theta={self.rope_theta} must be > 1")
        check(self.max_seq_len >= 2, f"max_seq_len={self.max_seq_len} must be >= 2")
        check(0 < self.norm_eps < 1, f"norm_eps={self.norm_eps} must be in (0, 1)")
        check(self.init_std > 0, f"init_std={self.init_std} must be > 0")
        check(
            0 <= self.n_dense_layers <= self.n_layers,
            f"n_dense_layers={self.n_dense_layers} must be in [0, n_layers={self.n_layers}]",
        )
        check(self.d_ff >= 1, f"d_ff={self.d_ff} must be >= 1")

    @property
    def dim_head(self) -> int:
        """Resolved per-head width."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def sections(self) -> tuple[int, int, int]:
        """Resolved (t, h, w) frequency-pair split of Uni-RoPE."""
        if self.rope_sections:
            t, h, w = self.rope_sections
            return t, h, w
        pairs = self.dim_head // 2
        hw = round(pairs * 22 / 64)  # ERNIE-4.5-VL splits 64 pairs as h=22, w=22, t=20
        return pairs - 2 * hw, hw, hw

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has an MoE FFN."""
        return layer >= self.n_dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))
