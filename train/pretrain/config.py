"""Run configuration for pretraining: model, optimisation, schedule, elastic sampling and data.

A preset (``ernie5/presets/*.yaml``) is one YAML file of this shape; ``--set dotted.key=value``
overrides any field (``--set train.steps=100``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ernie5.config import check
from ernie5.model.config import ModelConfig
from train.common.optim import OptimConfig
from train.common.schedule import ScheduleConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticConfig:
    """Training-time sampling of sub-models, independently per dimension, per micro-batch."""

    enabled: bool = True
    """Sample sub-models at all (False = always the full model)."""
    p_full_depth: float = 0.75
    """Probability of running all layers (paper: 0.75)."""
    min_depth: float = 0.5
    """Smallest sampled depth, as a fraction of the layers (the reduced depth is uniform above it)."""
    p_full_width: float = 0.8
    """Probability that all routed experts are available (paper: 0.8)."""
    width_fraction: float = 0.5
    """Fraction of routed experts available in a reduced-width sample (paper's small run: 64 -> 32)."""
    p_default_top_k: float = 0.8
    """Probability of the default top-k (paper: 0.8); otherwise top-k ~ U{min_top_k .. k-1}."""
    min_top_k: int = 1
    """Smallest sampled top-k."""

    def __post_init__(self) -> None:
        for name in ("p_full_depth", "p_full_width", "p_default_top_k"):
            v = getattr(self, name)
            check(0 <= v <= 1, f"{name}={v} must be in [0, 1]")
        check(0 < self.min_depth <= 1, f"min_depth={self.min_depth} must be in (0, 1]")
        check(0 < self.width_fraction <= 1, f"width_fraction={self.width_fraction} must be in (0, 1]")
        check(self.min_top_k >= 1, f"min_top_k={self.min_top_k} must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """The pretraining mixture: packed documents streamed from weighted sources."""

    seq_len: int = 256
    """Tokens per packed row."""
    batch_size: int = 8
    """Rows per micro-batch (per process)."""
    sources: dict[str, float] = field(default_factory=lambda: {"shakespeare": 0.5, "procedural": 0.5})
    """Source name -> sampling weight. Sources needing the data root are skipped (renormalised)
    when their files are missing, and named on the console at the end; ``procedural`` always works."""
    strict: bool = False
    """A source skipped for missing data is an error before any step (``--strict``), not a skip."""
    data_dir: str = ""
    """Data root ('' = ``--data-dir`` or ``$ERNIE5_DATA_DIR``)."""
    tokenizer_chars: int = 2_000_000
    """Characters of training text the BPE tokenizer is trained on."""
    vision_tokenizer: str = ""
    """Folder of the frozen vision tokenizer (``ernie5 train-vision-tokenizer``), or a checkpoint whose
    tokenizer to reuse (``reference`` = the shipped one; a checkpoint folder); needed by media sources."""
    audio_codec: str = ""
    """Folder of the frozen audio codec (``ernie5 train-audio-codec`` writes DIR/codec), or a checkpoint
    whose codec to reuse (``reference``; a checkpoint folder); needed by audio sources."""
    speech_encoder: str = ""
    """Folder of a trained speech-content encoder (``train.side.speech_content`` writes DIR/encoder), or
    a checkpoint whose encoder to reuse; attached to the codec for models with ``audio.content_dim > 0``
    ('' = the one the codec's checkpoint carries)."""
    refiner: str = ""
    """Folder of a trained cascaded refiner (``ernie5 train-refiner``) shipped in every checkpoint."""
    cfg_dropout: float = 0.1
    """Probability of dropping a generation prompt (trains the unconditional branch of guidance)."""
    vision_flip_max: float = 0.1
    """Bitwise self-correction: each micro-batch flips history bits with p ~ U(0, vision_flip_max)."""
    media_understanding: float = 0.5
    """Probability that an image/clip document is an understanding document (image then question or
    caption) rather than a generation document (prompt then image)."""
    format: Literal["packed", "chat"] = "packed"
    """``packed``: pretraining documents, loss on every text token; ``chat``: instruction turns in the
    harness's prompt formats (supervised fine-tuning, ``ernie5 sft``), loss on answers only (see
    :mod:`ernie5.sequence.chat`)."""

    workers: int = 0
    """Data-loader worker processes that build the micro-batches (text packing and media
    tokenization) ahead of the trainer (:mod:`train.pretrain.prefetch`); 0 builds each in the trainer's
    process when it is needed. The batches are the same for every value."""
    prefetch: int = 2
    """Micro-batches each worker builds ahead (the loader's ``prefetch_factor``; unused with 0 workers)."""

    def __post_init__(self) -> None:
        check(self.seq_len >= 8, f"seq_len={self.seq_len} must be >= 8")
        check(self.workers >= 0, f"workers={self.workers} must be >= 0")
        check(self.prefetch >= 1, f"prefetch={self.prefetch} must be >= 1")
        check(self.batch_size >= 1, f"batch_size={self.batch_size} must be >= 1")
        check(bool(self.sources), "sources must name at least one source")
        check(all(w >= 0 for w in self.sources.values()), f"sources={self.sources} weights must be >= 0")
        check(sum(self.sources.values()) > 0, f"sources={self.sources} needs a positive weight")
        check(self.tokenizer_chars >= 1000, f"tokenizer_chars={self.tokenizer_chars} must be >= 1000")
        check(0 <= self.cfg_dropout <= 1, f"cfg_dropout={self.cfg_dropout} must be in [0, 1]")
        check(
            0 <= self.media_understanding <= 1,
            f"media_understanding={self.media_understanding} must be in [0, 1]",
        )
        check(0 <= self.vision_flip_max <= 0.5, f"vision_flip_max={self.vision_flip_max} must be in [0, 0.5]")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """How a run started on several processes (``accelerate launch`` / ``torchrun``) spreads over them
    (``train.parallel``; :mod:`train.pretrain.parallel`). One process ignores everything here but the memory
    switches and ``subnet_group``."""

    dp_shard: int = -1
    """Processes over which FSDP2 shards the parameters, gradients and optimizer state; the world size
    divided by it replicates them (HSDP). -1: all processes (plain FSDP); 1: replicate (DDP-like)."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's routed experts are split over groups of ``ep``
    processes (each owns ``n_experts / ep`` of them); tokens reach their experts by all-to-all."""
    subnet_group: int = 0
    """Consecutive global micro-batches that share one sampled elastic sub-model (0: the world size,
    so the micro-batches that run at the same time on every process share theirs). Must be a
    multiple of the world size."""
    activation_checkpoint: bool = False
    """Recompute each backbone block's activations in the backward instead of keeping them."""
    activation_offload: bool = False
    """Keep saved activations in host memory (``torch.autograd.graph.save_on_cpu``): frees device
    memory on GPU, changes nothing on CPU."""

    def __post_init__(self) -> None:
        check(self.dp_shard == -1 or self.dp_shard >= 1, f"dp_shard={self.dp_shard} must be -1 or >= 1")
        check(self.ep >= 1, f"ep={self.ep} must be >= 1")
        check(self.subnet_group >= 0, f"subnet_group={self.subnet_group} must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """The loop."""

    steps: int = 1000
    """Optimizer steps. The one field that may change on ``--resume``, and only grow (extending a run
    moves the schedules' decay to the new end: see :mod:`train.pretrain.loop` and
    :mod:`train.common.schedule`)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    seed: int = 0
    """Seeds init, data, and elastic sampling (a pure function of seed and step)."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype: ``bf16`` (a bf16 compute replica with fp32 master weights) or plain ``fp32``."""
    threads: int = 0
    """torch CPU threads (0 = leave torch's default)."""
    log_every: int = 10
    """Steps between metrics.jsonl records."""
    ckpt_every: int = 200
    """Steps between checkpoints (the final step is always checkpointed)."""
    keep_ckpts: int = 2
    """Newest checkpoints kept."""
    bias_speed: float = 1e-3
    """Aux-loss-free bias update speed gamma (paper: 1e-4 at 8K, then 1e-5)."""
    bias_speed_final: float = 1e-4
    """Gamma after ``stage2_frac`` of the steps (the paper's mid-training value, relative)."""
    mtp_weight: float = 0.3
    """MTP loss weight lambda (paper and DeepSeek-V3: 0.3, then 0.1)."""
    mtp_weight_final: float = 0.1
    """MTP weight after ``stage2_frac`` of the steps."""
    stage2_frac: float = 0.8
    """Where the 8K-stage values switch to the mid-training values."""
    modality_loss_weights: dict[str, float] = field(default_factory=dict)
    """Static per-modality loss weights (missing = 1)."""
    loss_balance: Literal["none", "posterior"] = "none"
    """``posterior``: rescale each modality's loss by the inverse EMA of its own value, so the
    modalities' losses sit on a comparable scale (our reading of the report's posterior weighting)."""
    vision_gen_weight: float = 1.0
    """Weight of the bitwise NFSP generation loss next to the text cross-entropy."""
    audio_gen_weight: float = 1.0
    """Weight of the Next-Codec-Prediction loss (mean over levels) next to the text cross-entropy."""
    peak_flops: float = 0.0
    """Peak FLOP/s for the MFU estimate (0 = measure the best matmul rate in the run's dtype at start)."""
    nonfinite: Literal["skip", "stop"] = "skip"
    """A step whose loss or gradient norm is not finite: ``skip`` it (no update; noted in
    ``metrics.jsonl``) and stop after ``nonfinite_patience`` such steps in a row, or ``stop`` at the
    first; stopping is one line naming the step, the quantity and the last good checkpoint, exit 4
    (train.common.nonfinite)."""
    nonfinite_patience: int = 5
    """Consecutive non-finite steps ``skip`` tolerates before it stops the run."""
    preempt_grace_s: float = 60.0
    """After ``SIGTERM`` (or a first Ctrl-C) the run checkpoints at the next step boundary and exits
    143; a step that does not end within this many seconds exits at once (ernie5.runtime.preempt)."""
    init_from: str = ""
    """A checkpoint (or run folder: its newest) whose weights, text tokenizer and frozen media
    models start this run: continued pretraining on another mixture, later SFT. The optimizer, the
    schedule and the step count start fresh; its model config must equal ``model``."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: ``auto`` = CUDA when a GPU is visible, else CPU. Under several processes on
    CUDA each process takes the GPU of its local rank."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Sharding, expert parallelism and memory switches (:class:`ParallelConfig`)."""
    fp8: bool = False
    """FP8 training of the blocks' dense projections (torchao; CUDA, compute capability >= 8.9:
    :mod:`train.pretrain.parallel.fp8`). A one-line error where it cannot run."""
    fp8_emulate: bool = False
    """With ``fp8``: emulate the FP8 casts, on any device (CPU included). FP8's numerics without its
    speed, for tests and for checking a recipe's losses before a GPU run (torchtitan's
    ``float8.emulate``)."""

    def __post_init__(self) -> None:
        check(self.steps >= 1, f"steps={self.steps} must be >= 1")
        check(self.grad_accum >= 1, f"grad_accum={self.grad_accum} must be >= 1")
        check(self.threads >= 0, f"threads={self.threads} must be >= 0")
        check(self.log_every >= 1, f"log_every={self.log_every} must be >= 1")
        check(self.ckpt_every >= 1, f"ckpt_every={self.ckpt_every} must be >= 1")
        check(self.keep_ckpts >= 1, f"keep_ckpts={self.keep_ckpts} must be >= 1")
        check(self.nonfinite_patience >= 1, f"nonfinite_patience={self.nonfinite_patience} must be >= 1")
        check(self.preempt_grace_s > 0, f"preempt_grace_s={self.preempt_grace_s} must be > 0")
        check(self.bias_speed >= 0 and self.bias_speed_final >= 0, "bias_speed values must be >= 0")
        check(self.mtp_weight >= 0 and self.mtp_weight_final >= 0, "mtp_weight values must be >= 0")
        check(0 <= self.stage2_frac <= 1, f"stage2_frac={self.stage2_frac} must be in [0, 1]")
        check(self.peak_flops >= 0, f"peak_flops={self.peak_flops} must be >= 0")
        check(self.fp8 or not self.fp8_emulate, "fp8_emulate=true needs fp8=true (it emulates FP8 training)")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything a pretraining run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        check(
            self.data.seq_len <= self.model.max_seq_len,
            f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}",
        )
