"""Configuration of the RL stage (``ernie5 rl``): tasks, rollouts, the replay buffer and the objective.

The defaults below are the RL recipe (there is no preset file); the model is the checkpoint's own.
``--config FILE`` (a YAML of these fields) and ``--set dotted.key=value`` override fields as for
``ernie5 train``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ernie5.config import check
from ernie5.model.config import ModelConfig
from train.common.optim import OptimConfig
from train.pretrain.config import ElasticConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """Sampling and the scheduling of rollouts (U-RB, APRIL or synchronous)."""

    scheduler: Literal["urb", "april", "sync"] = "urb"
    """``urb``: the Unbiased Replay Buffer (iteration t trains exactly query group D_t); ``april``: train on
    the first groups to finish; ``sync``: generate D_t to the end, then train (train.rl.buffer)."""
    queries_per_step: int = 12
    """Queries per iteration group D_t (the train batch, in queries)."""
    group_size: int = 16
    """Responses per query (GRPO's G)."""
    lookahead: int = 2
    """U-RB: groups D_t..D_{t+lookahead-1} in flight (the inference pool holds lookahead x the batch)."""
    over_provision: float = 2.0
    """APRIL: queries in flight as a multiple of ``queries_per_step``."""
    chunk: int = 8
    """Decode steps per engine round (U-RB and APRIL check for finished groups between rounds)."""
    temperature: float = 1.0
    """Sampling temperature of the behaviour policy (its log-probs are taken at this temperature)."""
    max_new_tokens: int = 0
    """Cap on text response tokens (0 = each task's own generation budget); images and speech are
    generated whole (speech within its task's frame budget)."""
    audio_temperature: float = 0.5
    """Sampling temperature of speech rollouts (its log-probs are taken at it). The TTS tasks' harness
    decodes argmax (temperature 0), which has no log-probs: RL trains the sampled distribution at this
    temperature, over every code (no top-k), and the sweep scores its argmax (train.rl.rollout_audio).
    0.5 is measured: on the shipped reference (GRPO, 100 steps) it lowered the argmax WER of tts_dtmf
    and tts_digits more than 1.0 did, and 1.0 cost tts_dtmf exact matches (README, Post-training)."""
    image_cfg_scale: float = -1.0
    """Guidance scale of image rollouts (< 0: each image task's own, the scale the harness samples with)."""
    engine: Literal["inference", "learner"] = "inference"
    """Who samples the rollouts. ``inference``: an inference replica of the policy, as production RL
    has (a separate engine): bf16 weights refreshed from the master after every optimizer step, a bf16
    KV cache and the fused decoding kernels (the path ``ernie5 generate`` serves), while the learner
    scores with the training path at ``rl.dtype``; the two disagree in their log-probs and, at times,
    their expert choices, which IcePop, MISC and routing replay exist to correct. ``learner``: the
    learner's own compute copy samples (no train/inference mismatch on fresh tokens). Measured on a
    micro model (README, Post-training): with ``rl.dtype=fp32`` the fresh-token mismatch is a mean
    |log-prob gap| of 0.004 and about 1 % of routing decisions differ; with ``rl.dtype=bf16`` the
    replica computes exactly what the learner does (this project's fused decoding reproduces the
    training path bit for bit), so a real mismatch needs the fp32 learner."""
    pool_size: int = 0
    """Distinct queries, cycled in order (0 = an endless stream of fresh queries). A finite pool lets
    WPSM's success rate and AHRL's pass rate refer to queries seen before."""

    def __post_init__(self) -> None:
        check(self.queries_per_step >= 1, f"queries_per_step={self.queries_per_step} must be >= 1")
        check(self.group_size >= 2, f"group_size={self.group_size} must be >= 2 (group advantages)")
        check(self.lookahead >= 1, f"lookahead={self.lookahead} must be >= 1")
        check(self.over_provision >= 1, f"over_provision={self.over_provision} must be >= 1")
        check(self.chunk >= 1, f"chunk={self.chunk} must be >= 1")
        check(self.temperature > 0, f"temperature={self.temperature} must be > 0 (sampling)")
        check(
            self.audio_temperature > 0,
            f"audio_temperature={self.audio_temperature} must be > 0 (sampling; the harness's argmax "
            "has no log-probs)",
        )
        check(self.max_new_tokens >= 0, f"max_new_tokens={self.max_new_tokens} must be >= 0")
        check(self.pool_size >= 0, f"pool_size={self.pool_size} must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveConfig:
    """The actor loss and its masks (train.rl.objectives)."""

    loss: Literal["misc", "grpo_icepop", "gspo_icepop", "gspo", "grpo"] = "misc"
    """``misc``: token IcePop mask x sequence clip (the report's Eq. 3); ``grpo_icepop`` (Eq. 1: token
    mask x token clip) and ``gspo_icepop`` (Eq. 2: sequence mask x sequence clip), the arms the report
    argues MISC against; ``gspo`` / ``grpo``: the mismatch-blind baselines (``grpo`` as DAPO's token-mean)."""
    clip_low: float = 3e-4
    """Sequence-ratio clip ``[1 - clip_low, 1 + clip_high]`` (misc, gspo_icepop, gspo)."""
    clip_high: float = 4e-4
    grpo_clip_low: float = 0.2
    """Token-ratio clip ``[1 - grpo_clip_low, 1 + grpo_clip_high]`` (grpo, grpo_icepop); DAPO's
    clip-higher is ``grpo_clip_high=0.28``."""
    grpo_clip_high: float = 0.2
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    minibatches: int = 2
    """Optimizer steps per iteration (the batch is split; ratios move away from 1 after the first)."""
    routing_replay: bool = True
    """Recompute the learner's log-probs with the rollout's expert selections (R3)."""
    wpsm: bool = True
    """Well-learned Positive Sample Mask."""
    wpsm_threshold: float = 0.75
    wpsm_quantile: float = 0.2
    wpsm_alpha: float = 1.0
    wpsm_decay: float = 0.0
    """EMA decay of each query's success rate (0 = the current iteration's rate, the report's acc_x^t)."""
    ahrl: bool = False
    """Adaptive hints: the first steps of each hard query's thinking skeleton (evals.hints: partial
    reasoning, never the answer) appended to its prompt, their share decaying for every query (needs a
    finite query pool, ``rollout.pool_size > 0``, for the starting model's pass rates)."""
    ahrl_max_fraction: float = 0.5
    ahrl_pass_cutoff: float = 0.5
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: groups whose rewards are all equal (no advantage signal) are dropped and
    more groups are sampled until the batch holds ``rollout.queries_per_step`` groups with signal, or
    ``dynamic_max_batches`` batches were sampled (then it trains on the groups it has)."""
    dynamic_max_batches: int = 3
    """Most batches sampled per iteration under dynamic sampling (DAPO's ``max_num_gen_batches``)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the starting policy (``rl.init_from``) added to the loss; 0 = none
    (DAPO and the report's MISC use none). The starting policy is kept as a frozen copy."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """``k1``: ``log pi/pi_ref``; ``k3``: ``pi_ref/pi - log(pi_ref/pi) - 1`` (low variance, verl's
    ``low_var_kl``; train.rl.objectives.kl_to_reference)."""

    def __post_init__(self) -> None:
        check(0 <= self.clip_low < 1 and self.clip_high >= 0, "clip_low must be in [0, 1), clip_high >= 0")
        check(0 < self.grpo_clip_low < 1, f"grpo_clip_low={self.grpo_clip_low} must be in (0, 1)")
        check(self.grpo_clip_high > 0, f"grpo_clip_high={self.grpo_clip_high} must be > 0")
        check(self.dynamic_max_batches >= 1, f"dynamic_max_batches={self.dynamic_max_batches} must be >= 1")
        check(self.kl_coef >= 0, f"kl_coef={self.kl_coef} must be >= 0")
        check(0 < self.icepop_low <= 1 <= self.icepop_high, "need icepop_low <= 1 <= icepop_high, low > 0")
        check(self.minibatches >= 1, f"minibatches={self.minibatches} must be >= 1")
        check(0 <= self.wpsm_threshold <= 1, f"wpsm_threshold={self.wpsm_threshold} must be in [0, 1]")
        check(0 < self.wpsm_quantile < 1, f"wpsm_quantile={self.wpsm_quantile} must be in (0, 1)")
        check(0 <= self.wpsm_alpha <= 1, f"wpsm_alpha={self.wpsm_alpha} must be in [0, 1]")
        check(0 <= self.wpsm_decay < 1, f"wpsm_decay={self.wpsm_decay} must be in [0, 1)")
        check(
            0 <= self.ahrl_max_fraction < 1, f"ahrl_max_fraction={self.ahrl_max_fraction} must be in [0, 1)"
        )
        check(0 < self.ahrl_pass_cutoff <= 1, f"ahrl_pass_cutoff={self.ahrl_pass_cutoff} must be in (0, 1]")


@dataclass(frozen=True, kw_only=True, slots=True)
class RLLoopConfig:
    """The loop."""

    steps: int = 150
    """RL iterations (one query group each)."""
    seed: int = 0
    """Seeds the query stream, sampling and elastic sub-models."""
    init_from: str = ""
    """The checkpoint RL starts from (``ernie5 rl --checkpoint``)."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype of the policy (rollouts and learner): bf16 replica with fp32 master weights, or fp32."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the policy rolls out and learns: ``auto`` = CUDA when a GPU is visible, else CPU. Judges,
    the vision tokenizer and the audio codec decode on CPU (rewards need the rollouts' codes only)."""
    threads: int = 0
    log_every: int = 1
    ckpt_every: int = 10
    keep_ckpts: int = 2
    lr_warmup_steps: int = 0
    nonfinite: Literal["skip", "stop"] = "skip"
    """A minibatch whose loss or gradient norm is not finite: ``skip`` its optimizer step (noted in
    ``metrics.jsonl``) and stop after ``nonfinite_patience`` in a row, or ``stop`` at the first (one
    line, exit 4; train.common.nonfinite)."""
    nonfinite_patience: int = 5
    preempt_grace_s: float = 60.0
    """After ``SIGTERM`` (or a first Ctrl-C) RL checkpoints at the end of the iteration and exits 143;
    an iteration that does not end within this many seconds exits at once (ernie5.runtime.preempt)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RLRunConfig:
    """Everything an RL run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    tasks: dict[str, float] = field(default_factory=lambda: {"reverse_l8": 1.0, "shapes_vqa_attr": 1.0})
    """Harness task -> sampling weight of its queries (evals.verifiers supplies queries and rewards)."""
    data_dir: str = ""
    rl: RLLoopConfig = field(default_factory=RLLoopConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-5, weight_decay=0.0))
    elastic: ElasticConfig = field(default_factory=lambda: ElasticConfig(enabled=False))
    """Sub-model sampling, one sub-model per query group (rollouts and learner use the same). Off by
    default: RL trains the full model and the sweep measures what its sub-models keep (train.rl.trainer,
    Deviation 5)."""

    def __post_init__(self) -> None:
        check(bool(self.tasks), "tasks must name at least one task")
        check(all(w > 0 for w in self.tasks.values()), f"tasks={self.tasks}: weights must be > 0")
