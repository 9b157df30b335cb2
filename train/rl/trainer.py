"""Unified multimodal RL on the elastic MoE: rollouts, verifier rewards, MISC + WPSM + AHRL, U-RB.

Over 500 lines: one class, whose rollout, reward and learner phases share the iteration's state (query
cache, success and pass rates, buffer, optimizer); the per-output work lives in the rollout modules.

One iteration ``t``:
  1. The replay buffer (:mod:`train.rl.buffer`: ``urb``, ``april`` or ``sync``) hands over one batch of
     query groups, ``G`` finished responses each, sampled by the rollout engines (one module per output,
     each owning its prompts and learner batches: :mod:`train.rl.rollout_text`, ``rollout_image``,
     ``rollout_audio``) from the policy's compute copy under the group's elastic sub-model (one sub-model
     per query group, sampled like pretraining's, so the post-trained model stays elastic).
  2. Rewards: each task's verifier (``evals.verifiers`` through ``ernie5 rl``: the harness's own scorer).
  3. GRPO group advantages; optional DAPO dynamic sampling (groups without signal are dropped and more
     are sampled to refill the batch, up to ``objective.dynamic_max_batches`` batches).
  4. The learner recomputes every response token's log-prob at the rollout weights (``logp_old``), with
     the rollout's expert routing replayed (``objective.routing_replay``), and its entropy. Rollouts come
     from an inference replica (``rollout.engine``: bf16 weights synced after every step, bf16 KV
     cache, fused decoding), so ``logp_old`` and the behaviour ``logp_infer`` differ as between two
     engines; the record logs that mismatch per output and modality and the routing disagreement (the
     share of text-token routing decisions whose top-k set differs between the engine and the learner
     routing afresh).
  5. WPSM: each query's success rate (EMA over its visits) and the responses' entropies mask well-learned
     positives; AHRL hints were chosen at launch from the initial policy's pass rate on the query.
  6. ``objective.minibatches`` optimizer steps on the MISC loss (token IcePop mask from
     ``logp_old`` vs the behaviour ``logp_infer`` x sequence clip), or the report's comparison arms
     (GRPO-IcePop, GSPO-IcePop) or the mismatch-blind GSPO / GRPO baselines, each with the WPSM (and
     dynamic-sampling) weight; plus ``objective.kl_coef`` x the KL to the starting policy when asked.
  7. One ``metrics.jsonl`` record: reward, entropy, length, clip and mask fractions, hint fraction, the
     learner's idle time (generation time since the last update), the engine's slot use, per modality
     and per sampled sub-model.

Extending a run (``--resume`` with a larger ``rl.steps``) re-evaluates AHRL's decay ``gamma`` (a function
of ``rl.steps``) for the queries launched after the resume point, as pretraining's schedules are.

Exact resume: the model, optimizer, replay buffer (partial rollouts with their log-probs, versions and
routing), success rates and pass rates are checkpointed; sampling is a pure function of ``(seed, round)``
and the rollouts given, so a run killed and resumed reproduces the uninterrupted one.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §4 (UMRL: U-RB, MISC, WPSM, AHRL) and §5.4 (router
    replay). algorithms.md §6 (three policies, GSPO-token form, the recommended actor loss).

Deviations:
  1. AHRL's ``pass_init`` is the initial full model's success rate over ``G`` samples (a pass@1
     estimate) measured once over a finite query pool (``rollout.pool_size``) before the first update;
     the hint is the first ``round(p_hint x n)`` of the query's ``n`` thinking-skeleton steps
     (``evals.hints``: partial reasoning, never the answer; queries without a skeleton get none), and
     ``pass_init`` is floored at ``1 / G`` in the decay so that every hint decays, solved or not (the
     report's formula keeps a never-solved query's hint forever). The same measure after the last
     update (``pass_final``, no hints) gives the accuracy on the queries that were hard (``pass_init <
     ahrl_pass_cutoff``), sparse (``pass_init <= 0.1``) and easy at the start.
  2. The aux-free router bias is frozen during RL (no balancing updates: RL should not move routing by
     a rule of its own).
  3. A response is a success for WPSM when its reward is 1 (the best a verifier gives).
  4. See :mod:`train.rl.buffer`, :mod:`train.rl.rollout_text` and :mod:`train.rl.rollout_image` for the
     engines' deviations. A query whose ``output`` is ``"image"`` (``t2i_shapes``) is rolled out by the image
     engine (NFSP with the task's guidance scale) and rewarded on the decoded image; its "tokens" are
     generated positions (``D`` bits each), learned in batches of their own (no routing replay), and its
     entropy is the positions' bit entropy summed over their bits (``image_bit_entropy``: per bit).
     A query whose ``output`` is ``"audio"`` (``tts_dtmf``, ``tts_digits``) is rolled out by the speech
     engine (NCP at ``rollout.audio_temperature``; the harness decodes argmax) and rewarded on the
     decoded waveform by the task's judge (``1 - min(1, WER)``); its "tokens" are generated frames (and
     END), learned in batches of their own (no routing replay), and its entropy is the frames' entropy
     summed over their levels (``audio_level_entropy``: per level).
  5. Elastic sub-model sampling during RL is available (``elastic.enabled``) but off by default: on the
     shipped reference, 80 RL steps with it on moved no harness score, the same budget without it
     raised ``reverse_l8`` by 0.16; the nightly's sub-models are swept after RL instead, to measure
     what they keep.
  6. Dynamic sampling trains on at most ``rollout.queries_per_step`` groups with signal (a surplus from
     the last batch sampled is dropped, as DAPO does); when every batch sampled had none, the iteration
     trains on the last batch as it is (all advantages 0). The dropped groups update no WPSM success
     rate. The KL's reference policy is the starting checkpoint (``rl.init_from``), loaded again on
     resume, in the policy's compute dtype, with the rollout's routing replayed as the learner's.
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from ernie5.config import ConfigError, dump, from_dict, read_yaml
from ernie5.fast import apply_fast_paths
from ernie5.model.elastic import Subnet
from ernie5.model.inputs import Inputs
from ernie5.runtime.distributed import pick_device
from ernie5.runtime.preempt import Preempted, Preemption, preemptible
from ernie5.store.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    load_train_state,
    resolve_checkpoint,
    save_checkpoint,
)
from ernie5.store.runs import append_jsonl, provenance, read_jsonl, write_atomic, write_json
from ernie5.store.trackers import Trackers, parse_log_with
from train.common.nonfinite import DivergedError, NonFinitePolicy, first_nonfinite, last_good, nonfinite_grad
from train.common.optim import make_optimizer
from train.common.run_folder import (
    RunError,
    cut_metrics,
    drop_old_checkpoints,
    hold_run_folder,
    load_start,
    open_run_dir,
)
from train.pretrain.elastic import sample_subnet
from train.pretrain.precision import MixedPrecision
from train.rl.buffer import BatchStats, ReplayBuffer, Rollout
from train.rl.config import RLRunConfig
from train.rl.objectives import (
    ahrl_hint_fraction,
    dynamic_sampling_keep,
    group_advantages,
    grpo_icepop_loss,
    grpo_loss,
    gspo_icepop_loss,
    gspo_loss,
    kl_to_reference,
    misc_loss,
    update_success_ema,
    wpsm_mask,
)
from train.rl.rollout_audio import AudioRollouts
from train.rl.rollout_image import ImageRollouts
from train.rl.rollout_text import TextRollouts

SPARSE_PASS = 0.1
"""A pool query whose starting pass rate is at most this has sparse rewards (AHRL's target)."""
OUTPUTS = ("text", "image", "audio")
"""What a query asks for (``Query.output``), in the order the engines run and the learner's batches
are built."""


def _on_device(batch, device: torch.device):
    """A learner batch (a rollout module's ``LearnerBatch``, ``ImageLearnerBatch``, ``AudioLearnerBatch``:
    built on CPU)
    with its tensors, inputs and routing ids on ``device``; the same object on CPU."""
    if device.type == "cpu":
        return batch
    moved = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor | Inputs):
            moved[f.name] = value.to(device)
        elif isinstance(value, dict):
            moved[f.name] = {k: v.to(device) for k, v in value.items()}
    return replace(batch, **moved)


class Verifier(Protocol):
    """What the RL loop needs of a task (``evals.verifiers.TaskVerifier`` is one)."""

    name: str
    modality: str

    def query(self, index: int, seed: int) -> Any:
        """Query ``index`` of the seeded training stream (``context``, ``max_new_tokens``, ``stop``,
        ``skeleton``: AHRL's steps, with ``text(k)`` the hint of the first ``k``)."""

    def reward(self, query: Any, text: str) -> float:
        """The reward of response ``text`` (cut at the query's stop strings)."""


def subnet_key(dims: dict) -> str:
    """``d6-w64-k4``: a sampled sub-model's depth, width and top-k."""
    return f"d{dims['depth']}-w{dims['width']}-k{dims['top_k']}"


class RLTrainer:
    """State of one RL run; :meth:`run` does the work."""

    def __init__(
        self,
        cfg: RLRunConfig,
        run_dir: str | Path,
        verifiers: dict[str, Verifier],
        *,
        resume: bool = False,
        quiet: bool = False,
        log_with: Sequence[str] = (),
    ) -> None:
        log_with = parse_log_with(log_with)
        missing = sorted(set(cfg.tasks) - set(verifiers))
        if missing:
            raise RunError(f"no verifier for rl task(s) {', '.join(missing)}")
        if cfg.objective.ahrl and cfg.rollout.pool_size == 0:
            raise RunError(
                "objective.ahrl needs rollout.pool_size > 0 "
                "(the initial pass rates are measured over the pool)"
            )
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.verifiers = verifiers
        self.quiet = quiet
        self.log_with = log_with
        self.trackers = Trackers((), self.run_dir, self.run_dir.name)
        if cfg.rl.threads:
            torch.set_num_threads(cfg.rl.threads)
        self.resume_dir = self._prepare_run_dir(resume)
        self._queries: dict[int, Any] = {}
        self.rollouts: dict[str, TextRollouts | ImageRollouts | AudioRollouts] = {}
        """Output -> the rollouts of that output (its prompts, engine, answers and learner batches)."""

    # ---------------------------------------------------------------- setup
    def _prepare_run_dir(self, resume: bool) -> Path | None:
        """The checkpoint to resume (``train.common.run_folder``'s contract; only ``rl.steps`` may
        change, and only grow)."""
        steps = self.cfg.rl.steps
        ckpt, _ = open_run_dir(
            self.run_dir,
            self.cfg,
            resume=resume,
            steps_key="rl.steps",
            may_change=lambda stored: replace(stored, rl=replace(stored.rl, steps=steps)),
        )
        return ckpt

    def _setup(self) -> None:
        cfg = self.cfg
        source = self.resume_dir or cfg.rl.init_from
        if not source:
            raise RunError("rl.init_from: no checkpoint to start from")
        ckpt = load_start(source, cfg.model, "rl.init_from")
        self.ckpt = ckpt
        for task in cfg.tasks:
            need = self.verifiers[task].modality
            if need in ("image", "video") and (ckpt.vision_tokenizer is None or ckpt.model.vision is None):
                raise RunError(
                    f"rl task {task} asks about {need}s; {source} has no vision tokenizer or module"
                )
            if need == "audio" and (ckpt.audio_codec is None or ckpt.model.audio is None):
                raise RunError(f"rl task {task} asks about audio; {source} has no audio codec or module")
        self.model, self.tokenizer = ckpt.model, ckpt.tokenizer
        try:
            self.device = pick_device(cfg.rl.device)
        except ValueError as e:
            raise RunError(f"rl.device: {e}") from None
        self.model.train().to(self.device)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        ro = cfg.rollout
        self.buffer = ReplayBuffer(
            ro.scheduler,
            ro.queries_per_step,
            ro.group_size,
            lookahead=ro.lookahead,
            over_provision=ro.over_provision,
            chunk=ro.chunk,
        )
        self.start_step = 0
        self.success: dict[int, float] = {}
        self.pass_init: dict[int, float] = {}
        if self.resume_dir is not None:
            tensors, state = load_train_state(self.resume_dir, optimizer=self.optimizer)
            self.start_step = int(state["step"])
            self.buffer.load_state(
                state["buffer"], {k: v for k, v in tensors.items() if k.startswith("routing/")}
            )
            self.success = {int(k): v for k, v in state["success"].items()}
            self.pass_init = {int(k): v for k, v in state["pass_init"].items()}
        self.precision = MixedPrecision(self.model, cfg.rl.dtype)
        apply_fast_paths(self.precision.compute, grad_squares=self.precision.grad_squares)
        policy, seed = self.precision.compute, cfg.rl.seed
        self.reference = self._reference_policy(policy) if cfg.objective.kl_coef > 0 else None
        self.nonfinite = NonFinitePolicy(cfg.rl.nonfinite, cfg.rl.nonfinite_patience, self.run_dir, key="rl")
        self.inference = self._inference_replica() if ro.engine == "inference" else None

        def query_of(q: int) -> Any:
            return self._query(q)[1]

        self.rollouts["text"] = TextRollouts(
            policy,
            self.tokenizer,
            query_of,
            vision_tokenizer=ckpt.vision_tokenizer,
            vision_cfg=cfg.model.vision,
            audio_codec=ckpt.audio_codec,
            max_new_tokens=ro.max_new_tokens,
            temperature=ro.temperature,
            seed=seed,
        )
        if ckpt.model.vision is not None and ckpt.vision_tokenizer is not None:
            self.rollouts["image"] = ImageRollouts(
                policy,
                self.tokenizer,
                ckpt.vision_tokenizer,
                cfg.model.vision,
                query_of,
                cfg_scale=ro.image_cfg_scale,
                temperature=ro.temperature,
                seed=seed,
            )
        if ckpt.model.audio is not None and ckpt.audio_codec is not None:
            self.rollouts["audio"] = AudioRollouts(
                policy,
                self.tokenizer,
                ckpt.audio_codec,
                cfg.model.audio,
                query_of,
                temperature=ro.audio_temperature,
                seed=seed,
            )
        if self.inference is not None:
            for rollouts in self.rollouts.values():
                rollouts.engine.model = self.inference  # the engines sample; the learner keeps `policy`
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.run_dir / "config.yaml", dump(cfg))
        meta = provenance(cfg.rl.seed)
        meta.update(
            {
                "init_from": str(cfg.rl.init_from),
                "resumed_from": str(self.resume_dir) if self.resume_dir else None,
            }
        )
        write_json(self.run_dir / "meta.json", meta)
        cut_metrics(self.run_dir, self.start_step)

    def _reference_policy(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The KL's reference: the starting checkpoint, frozen, in the policy's dtype, device and mode."""
        ref = load_start(self.cfg.rl.init_from, self.cfg.model, "rl.init_from").model
        dtype = next(policy.parameters()).dtype
        ref = ref.to(device=self.device, dtype=dtype).train(policy.training).requires_grad_(False)
        apply_fast_paths(ref)
        return ref

    def _inference_replica(self) -> torch.nn.Module:
        """The rollout engine's own copy of the policy: bf16, fused decoding, no gradients; its
        parameters and buffers are paired with the master's for :meth:`_sync_inference`."""
        master = self.model
        replica = copy.deepcopy(master).to(torch.bfloat16).requires_grad_(False)
        self._inference_pairs = (
            [*replica.parameters(), *replica.buffers()],
            [*master.parameters(), *master.buffers()],
        )
        apply_fast_paths(replica)
        return replica

    @torch.no_grad()
    def _sync_inference(self) -> None:
        """Weight sync: the master's weights into the inference replica (after every optimizer step)."""
        if self.inference is not None:
            dst, src = self._inference_pairs
            torch._foreach_copy_(dst, src)

    # ---------------------------------------------------------------- queries
    def _key(self, q: int) -> int:
        """The pool entry of stream query ``q`` (``q`` itself for an endless stream)."""
        pool = self.cfg.rollout.pool_size
        return q % pool if pool else q

    def _query(self, q: int):
        if q not in self._queries:
            key = self._key(q)
            names = list(self.cfg.tasks)
            rng = random.Random(f"rl-task/{self.cfg.rl.seed}/{key}")
            task = rng.choices(names, weights=[self.cfg.tasks[n] for n in names])[0]
            self._queries[q] = (task, self.verifiers[task].query(key, self.cfg.rl.seed))
        return self._queries[q]

    def _output(self, q: int) -> str:
        """What query ``q`` asks for: ``text``, ``image`` or ``audio`` (``Query.output``; a verifier's query
        without that field asks for text)."""
        return getattr(self._query(q)[1], "output", "text")

    def _subnet(self, q: int) -> tuple[Subnet, dict]:
        return sample_subnet(
            self.cfg.elastic, self.cfg.model, self.cfg.rl.seed, q // self.cfg.rollout.queries_per_step, 0
        )

    def _hint_ids(self, q: int, step: int) -> list[int]:
        obj = self.cfg.objective
        key = self._key(q)
        if not obj.ahrl or key not in self.pass_init:
            return []
        gamma = math.log(2) / (0.125 * self.cfg.rl.steps)
        frac = float(
            ahrl_hint_fraction(
                torch.tensor(self.pass_init[key]),
                obj.ahrl_max_fraction,
                step=step,
                gamma=gamma,
                pass_cutoff=obj.ahrl_pass_cutoff,
                pass_floor=1.0 / self.cfg.rollout.group_size,
            )
        )
        skeleton = self._query(q)[1].skeleton
        text = skeleton.text(int(round(frac * len(skeleton.steps))))
        return self.tokenizer.encode(text) if text else []

    def _launch(self, q: int) -> list[Rollout]:
        hint = self._hint_ids(q, self.buffer.step)
        return [Rollout(q, s, hint=list(hint)) for s in range(self.cfg.rollout.group_size)]

    def _advance(self, rollouts: list[Rollout], budget: int, round_: int) -> tuple[int, int]:
        """One engine round, split by sub-model (rollouts of different groups may differ) and by output
        (text responses to the text engine, images to the image engine)."""
        by_subnet: dict[str, list[Rollout]] = defaultdict(list)
        subnets = {}
        for r in rollouts:
            sub, dims = self._subnet(r.query)
            by_subnet[subnet_key(dims)].append(r)
            subnets[subnet_key(dims)] = sub
        steps = tokens = 0
        for j, key in enumerate(sorted(by_subnet)):
            s, n = self._advance_on(by_subnet[key], budget, round_ * 1009 + j, subnets[key])
            steps, tokens = steps + s, tokens + n
        return steps, tokens

    def _advance_on(
        self, rollouts: list[Rollout], budget: int, round_: int, subnet: Subnet
    ) -> tuple[int, int]:
        """One round of the engines under one sub-model (text first; an image or an utterance is generated
        whole)."""
        steps = tokens = 0
        for output in OUTPUTS:
            rows = [r for r in rollouts if self._output(r.query) == output]
            if rows:  # _setup checked that the checkpoint has the parts each task's output needs
                s, n = self.rollouts[output].advance(rows, budget, round_, subnet, self.buffer.step)
                steps, tokens = steps + s, tokens + n
        return steps, tokens

    def _measure_pass(self, salt: int) -> dict[int, float]:
        """Success rate of the full model on every pool query (``G`` samples at the rollout temperature,
        no hint): AHRL's ``pass_init`` before the first update, and ``pass_final`` after the last."""
        pool, G = self.cfg.rollout.pool_size, self.cfg.rollout.group_size
        full = Subnet.full(self.cfg.model)
        out = {}
        for start in range(0, pool, 64):
            rollouts = [Rollout(q, s) for q in range(start, min(pool, start + 64)) for s in range(G)]
            self._advance_on(rollouts, 1 << 30, -(salt * 1_000_003 + start + 1), full)
            rewards = self._rewards(rollouts)
            for q in range(start, min(pool, start + 64)):
                out[q] = sum(w for r, w in zip(rollouts, rewards, strict=True) if r.query == q) / G
        self._queries.clear()
        for rollouts in self.rollouts.values():
            rollouts.forget(None)
        return out

    def _pass_event(self, name: str, values: dict[int, float], seconds: float) -> dict:
        cut = self.cfg.objective.ahrl_pass_cutoff
        hard = [values[k] for k, v in self.pass_init.items() if v < cut]
        sparse = [values[k] for k, v in self.pass_init.items() if v <= SPARSE_PASS]
        easy = [values[k] for k, v in self.pass_init.items() if v >= cut]
        return {
            "step": self.start_step if name == "pass_init" else self.cfg.rl.steps,
            "event": name,
            "seconds": seconds,
            "mean": sum(values.values()) / len(values),
            "hard_mean": sum(hard) / len(hard) if hard else None,
            "easy_mean": sum(easy) / len(easy) if easy else None,
            "sparse_mean": sum(sparse) / len(sparse) if sparse else None,
            "n_sparse": len(sparse),
            "n_hard": len(hard),
            "n_easy": len(easy),
        }

    def _rewards(self, rows: list[Rollout]) -> list[float]:
        """Each finished rollout's reward: its verifier on the response text, the decoded image or the
        decoded waveform."""
        answers: dict[int, Any] = {}
        for output, rollouts in self.rollouts.items():
            done = [r for r in rows if self._output(r.query) == output]
            if done:
                answers.update(zip(map(id, done), rollouts.answers(done), strict=True))
        out = []
        for r in rows:
            task, query = self._query(r.query)
            out.append(float(self.verifiers[task].reward(query, answers[id(r)])))
        return out

    # ---------------------------------------------------------------- learner
    def _loss(self, logp_new, logp_old, logp_infer, adv, mask, weight, logp_ref=None):
        """The configured objective on one learner batch (every arm with the same sequence weight), plus
        the KL to the reference policy when ``objective.kl_coef > 0``."""
        obj = self.cfg.objective
        seq_clip = {"clip_low": obj.clip_low, "clip_high": obj.clip_high}
        tok_clip = {"clip_low": obj.grpo_clip_low, "clip_high": obj.grpo_clip_high}
        icepop = {"icepop_low": obj.icepop_low, "icepop_high": obj.icepop_high}
        if obj.loss in ("misc", "grpo_icepop", "gspo_icepop"):
            fn = {"misc": misc_loss, "grpo_icepop": grpo_icepop_loss, "gspo_icepop": gspo_icepop_loss}
            clip = tok_clip if obj.loss == "grpo_icepop" else seq_clip
            loss, stats = fn[obj.loss](
                logp_new, logp_old, logp_infer, adv, mask, **clip, **icepop, seq_weight_B=weight
            )
        else:
            fn = gspo_loss if obj.loss == "gspo" else grpo_loss
            clip = seq_clip if obj.loss == "gspo" else tok_clip
            loss, stats = fn(logp_new, logp_old, adv, mask, **clip, seq_weight_B=weight)
            stats["mismatch_masked_frac"] = torch.tensor(0.0)
        if logp_ref is not None:
            kl = kl_to_reference(logp_new, logp_ref, mask, obj.kl_estimator)
            loss = loss + obj.kl_coef * kl
            stats["kl"] = kl.detach()
        return loss, stats

    def _sample_batch(self) -> tuple[list[list[Rollout]], torch.Tensor, BatchStats, dict]:
        """The iteration's groups and their ``(groups, G)`` rewards: one batch from the buffer, or under
        DAPO dynamic sampling, the groups with signal from as many batches as it takes to fill one
        (at most ``objective.dynamic_max_batches``; Deviation 6)."""
        obj, want = self.cfg.objective, self.cfg.rollout.queries_per_step
        total = BatchStats()
        kept: list[list[Rollout]] = []
        kept_rewards: list[torch.Tensor] = []
        dropped: set[int] = set()
        n_batches = n_sampled = 0
        while True:
            groups, stats = self.buffer.next_batch(self._launch, self._advance)
            for f in fields(BatchStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
            rows = [r for g in groups for r in g]
            rewards = torch.tensor(self._rewards(rows)).view(len(groups), -1)
            n_batches += 1
            n_sampled += len(groups)
            if not obj.dynamic_sampling:
                return groups, rewards, total, {}
            signal = dynamic_sampling_keep(rewards).tolist()
            for g, r, keep in zip(groups, rewards, signal, strict=True):
                if keep and len(kept) < want:
                    kept.append(g)
                    kept_rewards.append(r)
                else:
                    dropped.update(x.query for x in g)
            if len(kept) >= want or n_batches >= obj.dynamic_max_batches:
                break
        info = {"dynamic_batches": n_batches, "dynamic_dropped_frac": 1 - len(kept) / n_sampled}
        if not kept:  # nothing with signal in any batch: the last one, as it is (advantages all 0)
            kept, kept_rewards = groups, list(rewards)
        self._forget(dropped - {x.query for g in kept for x in g})
        return kept, torch.stack(kept_rewards), total, info

    def _forget(self, queries: set[int]) -> None:
        """Drop finished queries' cached prompts and state."""
        for q in queries:
            self._queries.pop(q, None)
        for rollouts in self.rollouts.values():
            rollouts.forget(queries)

    def _learn(self, step: int, groups: list[list[Rollout]], rewards: torch.Tensor) -> dict:
        cfg, obj = self.cfg, self.cfg.objective
        rows = [r for g in groups for r in g]
        adv_B = group_advantages(rewards).reshape(-1)
        reward_B = rewards.reshape(-1)
        # Sub-model of each row (its query group's), and the learner's view at the rollout weights.
        parts: dict[str, list[int]] = defaultdict(list)
        subnets, dims_of = {}, {}
        for k, r in enumerate(rows):
            sub, dims = self._subnet(r.query)
            key = subnet_key(dims)
            parts[key].append(k)
            subnets[key], dims_of[key] = sub, dims
        # One learner batch per (minibatch, sub-model, output): it gives the log-probs at the rollout
        # weights first, then the gradient of its optimizer step.
        n_mb = min(obj.minibatches, len(rows))
        output_B = [self._output(r.query) for r in rows]
        chunks = []  # (minibatch, sub-model key, row indices, the output's rollouts, batch)
        for mb in range(n_mb):
            for key, idx in parts.items():
                for output in OUTPUTS:
                    rows_idx = [k for k in idx if k % n_mb == mb and output_B[k] == output]
                    if not rows_idx:
                        continue
                    ro = self.rollouts[output]
                    batch = ro.learner_batch([rows[k] for k in rows_idx], obj.routing_replay)
                    chunks.append((mb, key, rows_idx, ro, _on_device(batch, self.device)))  # moved once
        n_max = max(len(r.tokens) for r in rows)
        logp_old = torch.zeros(len(rows), n_max)
        logp_ref = torch.zeros(len(rows), n_max) if self.reference is not None else None
        ent = torch.zeros(len(rows), n_max)
        for _, key, rows_idx, ro, batch in chunks:
            with torch.no_grad():
                lp, en = ro.logprobs(batch, subnets[key])
                if logp_ref is not None:
                    lr, _ = ro.logprobs(batch, subnets[key], model=self.reference)
                    logp_ref[rows_idx, : lr.shape[1]] = lr.float().cpu()
            logp_old[rows_idx, : lp.shape[1]] = lp.float().cpu()
            ent[rows_idx, : en.shape[1]] = en.float().cpu()
        flips = [0, 0]  # routing decisions that differ, all decisions (text rows: the ones with routing)
        for _, key, rows_idx, ro, _batch in chunks:
            if isinstance(ro, TextRollouts):
                n_diff, n_all = ro.routing_disagreement(
                    [rows[k] for k in rows_idx], subnets[key], self.device
                )
                flips[0], flips[1] = flips[0] + n_diff, flips[1] + n_all
        mask = torch.zeros(len(rows), n_max, dtype=torch.bool)
        logp_infer = torch.zeros(len(rows), n_max)
        for k, r in enumerate(rows):
            mask[k, : len(r.tokens)] = True
            logp_infer[k, : len(r.tokens)] = torch.tensor(r.logp)
        ent_B = (ent * mask).sum(-1) / mask.sum(-1).clamp_min(1)
        # WPSM: success-rate state per pool query, then the mask of well-learned positives.
        keys = [self._key(r.query) for r in rows]
        uniq = sorted(set(keys))
        local = torch.tensor([uniq.index(k) for k in keys])
        ema = torch.tensor([self.success.get(k, 0.0) for k in uniq])
        seen = torch.tensor([k in self.success for k in uniq])
        success_B = (reward_B >= 1.0).float()
        fresh = update_success_ema(ema, local, success_B, 0.0)
        ema = torch.where(seen, update_success_ema(ema, local, success_B, obj.wpsm_decay), fresh)
        for k, v in zip(uniq, ema.tolist(), strict=True):
            self.success[k] = v
        masked_B = torch.zeros(len(rows), dtype=torch.bool)
        if obj.wpsm:
            masked_B = wpsm_mask(ema, local, adv_B, ent_B, obj.wpsm_threshold, obj.wpsm_quantile)
        weight_B = 1.0 - obj.wpsm_alpha * masked_B.float()
        # Optimizer steps over the minibatches (rows k with k % n_mb == mb).
        stats_acc: dict[str, list[float]] = defaultdict(list)
        grad_norms = []
        loss_sum, loss_rows = 0.0, 0
        t0 = time.perf_counter()
        for mb in range(n_mb):
            total = len(range(mb, len(rows), n_mb))
            for _, key, rows_idx, ro, batch in (c for c in chunks if c[0] == mb):
                lp_new, _ = ro.logprobs(batch, subnets[key])
                w, dev = lp_new.shape[1], lp_new.device
                loss, st = self._loss(
                    lp_new.float(),
                    logp_old[rows_idx, :w].to(dev),
                    logp_infer[rows_idx, :w].to(dev),
                    adv_B[rows_idx].to(dev),
                    mask[rows_idx, :w].to(dev),
                    weight_B[rows_idx].to(dev),
                    None if logp_ref is None else logp_ref[rows_idx, :w].to(dev),
                )
                value = float(loss.detach())
                if not math.isfinite(value):
                    problem = f"loss ({value}) in minibatch {mb + 1}"
                    break
                loss_sum, loss_rows = loss_sum + value * len(rows_idx), loss_rows + len(rows_idx)
                (loss * len(rows_idx) / total).backward()
                self.precision.accumulate_grads()
                for name, v in st.items():
                    stats_acc[name].append(float(v))
            else:
                problem = None
            if problem is None:
                norm = self.precision.step(self.optimizer, cfg.optim.grad_clip, skip_nonfinite=True)
                if not math.isfinite(norm):
                    first = nonfinite_grad(self.model, self.precision.compute)
                    problem = f"gradient norm ({norm}; first in {first}) in minibatch {mb + 1}"
            self.optimizer.zero_grad(set_to_none=True)
            if problem is not None:  # nothing learned from this minibatch (rl.nonfinite)
                self.precision.discard_grads()
                self.nonfinite.skipped(step + 1, problem)  # raises when the policy says stop
                continue
            self.nonfinite.ok()
            grad_norms.append(norm)
            self.precision.sync()
            self._sync_inference()
        train_s = time.perf_counter() - t0
        # Record.
        lens = torch.tensor([len(r.tokens) for r in rows], dtype=torch.float)
        rec: dict[str, Any] = {
            "loss": loss_sum / loss_rows if loss_rows else None,
            "response_tokens": int(lens.sum()),
            "reward": float(reward_B.mean()),
            "entropy": float((ent * mask).sum() / mask.sum()),
            "response_len": float(lens.mean()),
            "truncated_frac": sum(r.truncated for r in rows) / len(rows),
            "clip_frac": sum(stats_acc["clip_frac"]) / max(1, len(stats_acc["clip_frac"])),
            "mismatch_masked_frac": sum(stats_acc["mismatch_masked_frac"])
            / max(1, len(stats_acc["mismatch_masked_frac"])),
            "logp_mismatch": float(((logp_old - logp_infer).abs() * mask).sum() / mask.sum()),
            "routing_disagreement": flips[0] / flips[1] if flips[1] else None,
            "wpsm_masked_frac": float(masked_B.float().mean()),
            "hint_frac": sum(bool(r.hint) for r in rows) / len(rows),
            "staleness": float(
                sum(step - v for r in rows for v in r.versions) / max(1, sum(len(r.versions) for r in rows))
            ),
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else None,
            "train_s": train_s,
            **({"kl": sum(stats_acc["kl"]) / len(stats_acc["kl"])} if stats_acc.get("kl") else {}),
            "queries": sorted({r.query for r in rows}),
        }
        by_task, by_mod, by_out = defaultdict(list), defaultdict(list), defaultdict(list)
        ent_task, ent_mod, ent_out = defaultdict(list), defaultdict(list), defaultdict(list)
        gap_mod, gap_out = defaultdict(list), defaultdict(list)  # per-token |logp_old - logp_infer|
        gap_BT = (logp_old - logp_infer).abs()
        for k, r in enumerate(rows):
            task, _ = self._query(r.query)
            gap = gap_BT[k, : len(r.tokens)].tolist()
            gap_mod[self.verifiers[task].modality].extend(gap)
            gap_out[output_B[k]].extend(gap)
        for k, r in enumerate(rows):
            task, _ = self._query(r.query)
            mod = self.verifiers[task].modality
            output = output_B[k]
            for table, name in ((by_task, task), (by_mod, mod), (by_out, output)):
                table[name].append(float(reward_B[k]))
            for table, name in ((ent_task, task), (ent_mod, mod), (ent_out, output)):
                table[name].append(float(ent_B[k]))

        def means(table: dict) -> dict:
            return {name: sum(v) / len(v) for name, v in sorted(table.items())}

        rec["reward_by_task"] = means(by_task)
        rec["rows_by_task"] = {t: len(v) for t, v in sorted(by_task.items())}
        rec["reward_by_modality"] = means(by_mod)
        rec["entropy_by_modality"] = means(ent_mod)
        rec["entropy_by_task"] = means(ent_task)
        rec["reward_by_output"] = means(by_out)
        rec["logp_mismatch_by_modality"] = means(gap_mod)
        rec["logp_mismatch_by_output"] = means(gap_out)
        rec["entropy_by_output"] = means(ent_out)
        if "image" in output_B:
            bits = self.cfg.model.vision.latent_bits
            rec["image_bit_entropy"] = rec["entropy_by_output"]["image"] / bits
        if "audio" in output_B:
            rec["audio_level_entropy"] = rec["entropy_by_output"]["audio"] / self.cfg.model.audio.n_levels
        rec["by_subnet"] = {
            key: {**dims_of[key], "n": len(idx), "reward": float(reward_B[idx].mean())}
            for key, idx in sorted(parts.items())
        }
        self._forget({r.query for r in rows})
        return rec

    # ---------------------------------------------------------------- loop
    def _checkpoint(self, step: int) -> None:
        path = checkpoint_dir(self.run_dir, step)
        bad = first_nonfinite(self.model.named_parameters())
        if bad is not None:  # never a checkpoint of non-finite weights
            raise DivergedError(
                f"step {step}: weight {bad} is not finite; not saved; {last_good(self.run_dir)}"
            )
        buf_state, routing = self.buffer.state()
        state = {
            "step": step,
            "buffer": buf_state,
            "success": {str(k): v for k, v in self.success.items()},
            "pass_init": {str(k): v for k, v in self.pass_init.items()},
        }
        save_checkpoint(
            path,
            self.model,
            tokenizer=self.tokenizer,
            meta={**provenance(self.cfg.rl.seed), "step": step, "subnet": None, "run": str(self.run_dir)},
            train_state=(self.optimizer, {"torch_rng": torch.get_rng_state(), **routing}, state),
            vision_tokenizer=self.ckpt.vision_tokenizer,
            refiner=self.ckpt.refiner,
            audio_codec=self.ckpt.audio_codec,
        )
        drop_old_checkpoints(self.run_dir, self.cfg.rl.keep_ckpts)

    def run(self, until: int | None = None) -> dict:
        """Train to ``rl.steps`` (or stop after step ``until``, as an interrupted run would, leaving its
        checkpoint to resume from); returns the last record. The run folder's lock is held throughout."""
        with hold_run_folder(self.run_dir):
            self.trackers = Trackers(self.log_with, self.run_dir, self.run_dir.name, asdict(self.cfg))
            try:
                return self._run(until)
            finally:
                self.trackers.close()

    def _run(self, until: int | None) -> dict:
        self._setup()
        cfg = self.cfg
        if cfg.rollout.pool_size and not self.pass_init:
            t0 = time.perf_counter()
            self.pass_init = self._measure_pass(0)
            event = self._pass_event("pass_init", self.pass_init, time.perf_counter() - t0)
            append_jsonl(self.run_dir / "metrics.jsonl", event)
            self.trackers.log(event, step=self.start_step, prefix="pass_init/")
        bar = None
        if not self.quiet:
            from tqdm import tqdm

            bar = tqdm(
                total=cfg.rl.steps, initial=self.start_step, desc="rl", unit="step", dynamic_ncols=True
            )
        stop = cfg.rl.steps if until is None else min(until, cfg.rl.steps)
        with preemptible(cfg.rl.preempt_grace_s) as signal_stop:
            last = self._iterate(stop, bar, signal_stop)
        if bar is not None:
            bar.close()
        recorded = read_jsonl(self.run_dir / "metrics.jsonl")
        if (
            stop == cfg.rl.steps
            and cfg.rollout.pool_size
            and not any(r.get("event") == "pass_final" and r.get("step") == cfg.rl.steps for r in recorded)
        ):
            t0 = time.perf_counter()
            final = self._pass_event("pass_final", self._measure_pass(1), time.perf_counter() - t0)
            append_jsonl(self.run_dir / "metrics.jsonl", final)
            self.trackers.log(final, step=cfg.rl.steps, prefix="pass_final/")
        return last

    def _iterate(self, stop: int, bar, signal_stop: Preemption) -> dict:
        """Iterations ``start_step .. stop``; on a stop request, checkpoint at the iteration's end and
        raise :class:`Preempted`."""
        cfg = self.cfg
        last: dict = {}
        for step in range(self.start_step, stop):
            lr = (
                cfg.optim.lr * min(1.0, (step + 1) / cfg.rl.lr_warmup_steps)
                if cfg.rl.lr_warmup_steps
                else cfg.optim.lr
            )
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            t0 = time.perf_counter()
            groups, rewards, stats, dynamic = self._sample_batch()
            gen_s = time.perf_counter() - t0
            rec = self._learn(step, groups, rewards)
            rec = {"step": step + 1, "lr": lr, **rec, **dynamic, **_batch_stats(stats, gen_s)}
            rec["tokens_per_s"] = rec["response_tokens"] / max(gen_s + rec["train_s"], 1e-9)
            last = rec
            if (step + 1) % cfg.rl.log_every == 0 or step + 1 == cfg.rl.steps:
                append_jsonl(self.run_dir / "metrics.jsonl", rec)
                self.trackers.log(rec, step=step + 1)
            if (step + 1) % cfg.rl.ckpt_every == 0 or step + 1 in (cfg.rl.steps, stop):
                self._checkpoint(step + 1)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{rec['reward']:.3f}", ent=f"{rec['entropy']:.3f}")
            if step + 1 < stop and signal_stop.requested:
                if not ((step + 1) % cfg.rl.ckpt_every == 0 or step + 1 in (cfg.rl.steps, stop)):
                    self._checkpoint(step + 1)
                raise Preempted(
                    f"{signal_stop.signal} at step {step + 1} of {cfg.rl.steps}: checkpoint "
                    f"{checkpoint_dir(self.run_dir, step + 1)}; continue with --resume"
                )
        return last


def _batch_stats(stats: BatchStats, gen_s: float) -> dict:
    return {
        "idle_s": gen_s,
        "engine_rounds": stats.rounds,
        "decode_steps": stats.decode_steps,
        "slot_utilisation": stats.slot_utilisation,
    }


def rl_config(checkpoint: str, config: str | None, overrides: list[str]) -> RLRunConfig:
    """The run's config: :class:`~train.rl.config.RLRunConfig`'s defaults, then the YAML file ``config``,
    then ``overrides`` (``dotted.key=value``); the model is the checkpoint's and ``rl.init_from`` the
    checkpoint's folder."""
    from ernie5.config import apply_overrides

    try:
        path = resolve_checkpoint(checkpoint)
    except CheckpointError as e:
        raise RunError(f"--checkpoint: {str(e).splitlines()[0]}") from None
    data = read_yaml(config) if config else {}
    if "model" in data:
        raise ConfigError(f"{config}: no model section (the model is the checkpoint's)")
    data["model"] = read_yaml(path / "config.yaml")
    rl_section = data.setdefault("rl", {})
    if not isinstance(rl_section, dict):
        raise ConfigError("rl: expected a mapping")
    rl_section["init_from"] = str(path)
    return from_dict(RLRunConfig, apply_overrides(data, overrides))


def rl(
    cfg: RLRunConfig,
    run_dir: str | Path,
    verifiers: dict[str, Verifier],
    *,
    resume: bool = False,
    quiet: bool = False,
    log_with: Sequence[str] = (),
) -> dict:
    """Run RL from ``cfg.rl.init_from`` into ``run_dir`` (``log_with``: experiment trackers that mirror
    ``metrics.jsonl``, :mod:`ernie5.store.trackers`)."""
    return RLTrainer(cfg, run_dir, verifiers, resume=resume, quiet=quiet, log_with=log_with).run()
