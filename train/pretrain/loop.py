"""Pretraining loop: elastic sub-model sampling, aux-free balancing, MTP, exact resume, DP.

Over 500 lines: one class, whose setup, micro-step, checkpoint and record share the run's state; the
run folder, optimizer and schedule live in :mod:`train.common`, the frozen media models in
:mod:`train.pretrain.media`.

Mixed precision: fp32 master weights (optimizer, checkpoints) and a bf16 compute replica
(``train.pretrain.precision``). One optimizer step = ``grad_accum`` micro-batches, each with its own
sampled sub-model; all of them are optimised with the same objective:

    loss = weighted next-token NLL (per-modality weights) + lambda_MTP * mean_k L_MTP^k + aux

After the step the router biases move by the aux-free rule from the step's summed expert loads
(all-reduced across processes), and ``metrics.jsonl`` gets one record every ``log_every`` steps.

Exact resume: model, optimizer, step and the loss-balance state are checkpointed; data and
sub-model sampling are pure functions of ``(seed, step)``, so a resumed run reproduces the losses
of an uninterrupted one. A run folder's newest *complete* checkpoint is the resume point (an
interrupted checkpoint write is never complete), and ``metrics.jsonl`` is cut back to it.

Extending a run: ``--resume`` needs the run's own config, except that ``train.steps`` may grow (a
smaller value is a :class:`RunError`). The schedules (``train.common.schedule.lr_at``, and ``staged`` for the
MTP weight and the router-bias speed) are functions of ``(step, train.steps)``: the steps before the
resume point keep the values they were trained with, and from the resume point on they are
re-evaluated over the new total, so an extended run is not the run it would have been with the larger
``train.steps`` from the start. With ``wsd`` the decay moves to the end of the new total: a run resumed
after its decay began goes back up to the peak learning rate until the new decay starts (extend from
a checkpoint taken before the decay to avoid that); ``cosine`` jumps to the point of the longer curve.
An extension is recorded in ``meta.json`` (``extensions``: one ``{at_step, from_steps, to_steps}``
per extension, kept across later resumes) and as a note in ``metrics.jsonl``
(``{"step": at_step, "event": "extended", "from_steps": ..., "to_steps": ...}``; records with an
``event`` key are notes, not measurements), and ``config.yaml`` then holds the new ``train.steps``.

Several processes: under ``accelerate launch --multi_gpu --num_processes N`` or ``torchrun``
(gloo on a CPU-only machine; on GPUs NCCL, with gloo for CPU tensors), the model is spread over
the processes by :func:`train.pretrain.parallel.shard.parallelize` (FSDP2 over a device mesh, expert
parallelism with ``train.parallel.ep``), with fp32 sharded master weights and, for ``train.dtype: bf16``, bf16
compute. Micro-batch ``a`` of process ``r`` is global micro-batch ``g = a * N + r``, with its own
data; FSDP2 averages the gradients over the processes, so N processes compute the update of one
process accumulating N times as many micro-batches. The elastic sub-model of global micro-batch
``g`` is sampled from ``(seed, step, g // train.parallel.subnet_group)`` (group 0 = N): the
micro-batches that run at the same time share one sub-model, so every process runs the same
layers and joins the same collectives; one process with ``subnet_group: N`` and ``N * A``
micro-batches reproduces the run. Checkpoints of such a run are sharded
(:mod:`train.pretrain.parallel.checkpoint`) and resume at any world size, one process included.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ernie5.bench.timing import machine_peak
from ernie5.config import dump
from ernie5.data.root import resolve_data_dir
from ernie5.fast import apply_fast_paths
from ernie5.model.inputs import IGNORE, Targets
from ernie5.model.model import Ernie5Model
from ernie5.model.moe import MoE, update_router_bias
from ernie5.runtime.distributed import init_dist, pick_device
from ernie5.runtime.preempt import Preempted, Preemption, preemptible
from ernie5.sequence.segments import MODALITIES
from ernie5.store.checkpoint import (
    checkpoint_dir,
    load_checkpoint,
    load_train_state,
    save_checkpoint,
)
from ernie5.store.runs import append_jsonl, provenance, write_atomic, write_json
from ernie5.store.trackers import Trackers, parse_log_with
from ernie5.subnets.params import ParamReport, count_params
from ernie5.tokenizers.text import TextTokenizer
from train.common.nonfinite import (
    DivergedError,
    NonFinitePolicy,
    first_nonfinite,
    last_good,
    loss_problem,
    nonfinite_grad,
)
from train.common.optim import make_optimizer
from train.common.run_folder import (
    RunError,
    cut_metrics,
    drop_old_checkpoints,
    hold_run_folder,
    load_start,
    open_run_dir,
)
from train.common.schedule import lr_at, staged
from train.pretrain.config import RunConfig
from train.pretrain.data import MixtureStream, open_sources, tokenizer_corpus
from train.pretrain.elastic import sample_subnet
from train.pretrain.media import load_audio_codec, load_refiner, load_vision_tokenizer, with_speech_encoder
from train.pretrain.parallel import checkpoint as parallel_ckpt
from train.pretrain.parallel.init import init_shards, meta_model, one_process_model
from train.pretrain.parallel.shard import make_sharded_optimizer, parallelize
from train.pretrain.precision import MixedPrecision
from train.pretrain.prefetch import PrefetchStream, TrainKeys


def _train_flops(rep: ParamReport, mtp_ran: bool, mtp_trained: bool) -> float:
    """Model FLOPs per token of a micro-batch (``ernie5.subnets.params``: ``train_flops_per_token``), less
    the MTP modules' backward when their loss weight is 0, or all of them when they did not run."""
    return rep.train_flops_per_token - (0 if mtp_trained else 2 if mtp_ran else 3) * rep.mtp_flops_per_token


def _routing_entropy(counts_E: torch.Tensor, avail_E: torch.Tensor) -> float:
    c = counts_E[avail_E].double()
    n = int(avail_E.sum())
    if n <= 1 or c.sum() == 0:
        return 0.0
    p = c / c.sum()
    h = -(p[p > 0] * p[p > 0].log()).sum()
    return float(h / math.log(n))


class Trainer:
    """State of one pretraining run; :meth:`run` does the work."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        *,
        resume: bool,
        data_dir: str | None,
        quiet: bool = False,
        log_with: Sequence[str] = (),
    ):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.dist = init_dist()
        self.quiet = quiet
        self.log_with = parse_log_with(log_with)
        self.trackers = Trackers((), self.run_dir, self.run_dir.name)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.data_dir = resolve_data_dir(data_dir or cfg.data.data_dir or None)
        self.start_step = 0
        self.extended_from: int | None = None
        """The stored ``train.steps`` when this resume extends the run (see the module docstring)."""
        self.resume_dir = self._prepare_run_dir(resume)

    # ---------------------------------------------------------------- setup
    def _prepare_run_dir(self, resume: bool) -> Path | None:
        """The checkpoint to resume (``train.common.run_folder``'s contract): how the run is spread
        (processes, micro-batches per process, sharding, expert split, memory switches, device) may
        change at a resume, keeping the global batch; what it computes may not."""
        t, d = self.cfg.train, self.cfg.data

        def may_change(stored: RunConfig) -> RunConfig:
            return replace(
                stored,
                train=replace(
                    stored.train, steps=t.steps, parallel=t.parallel, device=t.device, grad_accum=t.grad_accum
                ),
                data=replace(stored.data, workers=d.workers, prefetch=d.prefetch),
            )

        def same_global_batch(stored: RunConfig) -> None:
            old_world = _stored_world(self.run_dir)
            if t.grad_accum * self.dist.world != stored.train.grad_accum * old_world:
                raise RunError(
                    f"--resume with train.grad_accum={t.grad_accum} x {self.dist.world} process(es): the "
                    f"run's global batch is {stored.train.grad_accum} x {old_world} micro-batches; "
                    "keep the product"
                )

        ckpt, stored = open_run_dir(
            self.run_dir,
            self.cfg,
            resume=resume,
            steps_key="train.steps",
            may_change=may_change,
            check_stored=same_global_batch,
        )
        if stored is not None and t.steps > stored.train.steps:
            self.extended_from = stored.train.steps
        return ckpt

    def _setup(self) -> None:
        cfg = self.cfg
        # Where the run cannot go (no GPU for train.device=cuda, FP8 without its hardware) is a
        # one-line error before anything is written.
        try:
            self.device = pick_device(cfg.train.device)
        except ValueError as e:
            raise RunError(f"train.device: {e}") from None
        if cfg.train.fp8:
            from train.pretrain.parallel.fp8 import fp8_supported

            why = fp8_supported(self.device, cfg.train.fp8_emulate)
            if why is not None:
                raise RunError(why)
        self.sources = open_sources(cfg.data, self.data_dir, cfg.model.vision.image_size)
        if cfg.data.strict and self.sources.skipped:
            name, why = next(iter(self.sources.skipped.items()))
            raise RunError(
                f"data.strict: {len(self.sources.skipped)} source(s) have no data (first: {name}: {why})"
            )
        tok_path = self.run_dir / "tokenizer.json"
        if self.resume_dir is not None:
            # A parallel run resuming its own shards reads them into its shards (in _resume_train_state):
            # the model stays on the meta device until then.
            sharded = self.dist.world > 1 and (self.resume_dir / parallel_ckpt.DCP_DIR).is_dir()
            resumed = load_checkpoint(self.resume_dir, fast=False, weights=not sharded)
            self._adopt(resumed)
        elif cfg.train.init_from:
            self._init_from(cfg.train.init_from, tok_path)
        else:
            self.vision_tokenizer = load_vision_tokenizer(self.cfg)
            self.audio_codec = load_audio_codec(self.cfg)
            self.refiner = load_refiner(self.cfg)
            if self.dist.main and not tok_path.exists():
                corpus = tokenizer_corpus(self.sources, cfg.data.tokenizer_chars, cfg.train.seed)
                tok = TextTokenizer.train(corpus, cfg.model.vocab_size)
                self.run_dir.mkdir(parents=True, exist_ok=True)
                tok.save(tok_path)
            self._barrier()
            self.tokenizer = TextTokenizer.load(tok_path)
            # Made on the meta device and initialised from the seed: in one process here, in a
            # parallel run shard by shard after parallelize (train.pretrain.parallel.init).
            self.model = (
                meta_model(cfg.model) if self.dist.world > 1 else one_process_model(cfg.model, cfg.train.seed)
            )
        self.model.train()
        on_meta = next(self.model.parameters()).is_meta
        if not on_meta:
            self.model.to(self.device)
        self.balance_ema: dict[str, float] = {}
        pcfg = cfg.train.parallel
        self.bf16 = cfg.train.dtype == "bf16"
        self.par = None
        if self.dist.world > 1:
            apply_fast_paths(self.model)
            self._apply_fp8(self.model)
            self.par = parallelize(
                self.model,
                pcfg,
                rank=self.dist.rank,
                world=self.dist.world,
                device=self.device.type,
                param_dtype=torch.bfloat16 if self.bf16 else None,
            )
            if on_meta:  # each process materialises and initialises (or resumes) its own shards only
                self.model.to_empty(device=self.device)
                if self.resume_dir is None:
                    init_shards(self.model, cfg.model, cfg.train.seed, self.par.meshes.experts)
                else:
                    self.model.reset_buffers()  # the RoPE table; the shards hold the rest
            self.compute = self.model
            self.optimizer = make_sharded_optimizer(self.model, cfg.optim)
        else:
            self.optimizer = make_optimizer(self.model, cfg.optim)
        if self.resume_dir is not None:
            state = self._resume_train_state(resumed.meta)
            self.start_step = int(state["step"])
            self.balance_ema = dict(state.get("balance_ema", {}))
        stream = MixtureStream(
            cfg.data,
            self.sources,
            self.tokenizer,
            cfg.train.seed,
            self.vision_tokenizer,
            cfg.model.vision,
            self.audio_codec,
        )
        # Tokenizer disaggregation: data.workers processes build the micro-batches this process will
        # ask for, in its order (forked, they get this stream; its tokenizer and codec stay on CPU).
        t, d = cfg.train, self.dist
        keys = TrainKeys(self.start_step, t.steps, t.grad_accum, d.world, d.rank)
        self.stream = PrefetchStream.from_config(lambda: stream, cfg.data, keys)
        self.moe_layers = {i: b.ffn for i, b in enumerate(self.model.layers) if isinstance(b.ffn, MoE)}
        if self.par is None:
            self.precision = MixedPrecision(self.model, cfg.train.dtype)
            apply_fast_paths(self.precision.compute, grad_squares=self.precision.grad_squares)
            self._apply_fp8(self.precision.compute)
            self.compute = self.precision.compute
            if pcfg.activation_checkpoint:
                from torch.distributed._composable import checkpoint

                for block in self.compute.layers:
                    checkpoint(block)
        self.subnet_group = pcfg.subnet_group or self.dist.world
        if self.subnet_group % self.dist.world:
            raise RunError(
                f"train.parallel.subnet_group={pcfg.subnet_group} is not a multiple of the world size "
                f"{self.dist.world}: the processes would run different sub-models at the same time"
            )
        self.peak = cfg.train.peak_flops or machine_peak(
            torch.bfloat16 if self.bf16 else torch.float32, str(self.device)
        )
        if self.dist.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            extensions = self._extensions()
            write_atomic(self.run_dir / "config.yaml", dump(self.cfg))
            meta = provenance(self.cfg.train.seed)
            meta.update(
                {
                    "world_size": self.dist.world,
                    "data_dir": str(self.data_dir) if self.data_dir else None,
                    "data_sources": self.sources.names,
                    "data_sources_skipped": self.sources.skipped,
                    "resumed_from": str(self.resume_dir) if self.resume_dir else None,
                    "peak_flops": self.peak,
                    "extensions": extensions,
                    "fp8_linears": self.fp8_linears,
                }
            )
            write_json(self.run_dir / "meta.json", meta)
            extended = self.extended_from is not None
            notes = [{"step": self.start_step, "event": "extended", **extensions[-1]}] if extended else []
            cut_metrics(self.run_dir, self.start_step, notes)

    def _resume_train_state(self, meta: dict) -> dict:
        """Load the optimizer state of the checkpoint being resumed (the model's weights are loaded
        already) and return its train state (``step``, ``balance_ema``), whichever world size wrote
        it: a parallel run's shards (any world size, one process included), or a one-process run's
        full state (into one process directly; into several, each keeping its slices)."""
        dcp_dir = self.resume_dir / parallel_ckpt.DCP_DIR
        mesh = self.par.meshes.experts if self.par is not None else None
        if dcp_dir.is_dir():
            parallel_ckpt.load_train_state(dcp_dir, self.model, self.optimizer, mesh)
            return meta["train_state"]
        if self.par is None:
            return load_train_state(self.resume_dir, optimizer=self.optimizer)[1]
        plain = Ernie5Model(self.cfg.model)  # the one-process optimizer's parameter order
        optimizer = make_optimizer(plain, self.cfg.optim)
        _, state = load_train_state(self.resume_dir, optimizer=optimizer)
        full = {name: dict(optimizer.state[p]) for name, p in plain.named_parameters() if optimizer.state[p]}
        parallel_ckpt.load_full_optimizer_state(full, self.model, self.optimizer, mesh)
        return state

    def _apply_fp8(self, model: Ernie5Model) -> None:
        """``train.fp8``: the blocks' dense projections in FP8 (where it can run was checked at the
        start of :meth:`_setup`); ``self.fp8_linears`` counts them."""
        self.fp8_linears = 0
        if self.cfg.train.fp8:
            from train.pretrain.parallel.fp8 import apply_fp8

            self.fp8_linears = apply_fp8(model, self.device, emulate=self.cfg.train.fp8_emulate)

    def _extensions(self) -> list[dict]:
        """``meta.json``'s record of the run's extensions: the earlier ones (those at or before the
        resume point; the file is rewritten at every start), then this one if this resume extends."""
        try:
            old = json.loads((self.run_dir / "meta.json").read_text(encoding="utf-8")).get("extensions")
        except (OSError, ValueError, AttributeError):
            old = None
        kept = [e for e in old or [] if isinstance(e, dict) and e.get("at_step", math.inf) <= self.start_step]
        if self.extended_from is not None:
            kept.append(
                {
                    "at_step": self.start_step,
                    "from_steps": self.extended_from,
                    "to_steps": self.cfg.train.steps,
                }
            )
        return kept

    def _adopt(self, ckpt) -> None:
        """Take model, tokenizer and the frozen media models from a checkpoint (those it does not
        ship come from ``data.*``)."""
        self.model, self.tokenizer = ckpt.model, ckpt.tokenizer
        self.vision_tokenizer = ckpt.vision_tokenizer or load_vision_tokenizer(self.cfg)
        self.audio_codec = with_speech_encoder(ckpt.audio_codec, self.cfg) or load_audio_codec(self.cfg)
        self.refiner = ckpt.refiner or load_refiner(self.cfg)

    def _init_from(self, path: str, tok_path: Path) -> None:
        """Start from another run's weights, tokenizer and frozen media models (fresh optimizer)."""
        ckpt = load_start(path, self.cfg.model, "train.init_from")
        self._adopt(ckpt)
        if self.dist.main and not tok_path.exists():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.tokenizer.save(tok_path)

    def _barrier(self) -> None:
        self.dist.barrier()

    # ---------------------------------------------------------------- loop
    def _modality_weights(self) -> dict[str, float]:
        """Per-modality loss weights (text/image/video/audio cross-entropy, ``vision_gen`` the bitwise
        generation loss, ``audio_gen`` the NCP loss): static weights, times the posterior balance."""
        keys = (*MODALITIES, "vision_gen", "audio_gen")
        w = {m: self.cfg.train.modality_loss_weights.get(m, 1.0) for m in keys}
        if self.cfg.train.loss_balance == "posterior" and self.balance_ema:
            ref = sum(self.balance_ema.values()) / len(self.balance_ema)
            for m, ema in self.balance_ema.items():
                w[m] *= ref / max(ema, 1e-6)
        return w

    def _micro_step(self, step: int, micro: int, weights: dict[str, float]) -> dict:
        cfg = self.cfg
        # Global micro-batch index: W processes x A micro-batches see exactly the batches that one
        # process with W*A accumulation steps would; concurrent ones share their sub-model.
        index = micro * self.dist.world + self.dist.rank
        batch = self.stream.batch(step, index)
        if self.device.type != "cpu":
            batch = batch.to(self.device)
        subnet, dims = sample_subnet(cfg.elastic, cfg.model, cfg.train.seed, step, index // self.subnet_group)
        mod_w = torch.tensor([weights[m] for m in MODALITIES], device=self.device)[batch.modality.long()]
        targets = Targets(batch.targets.ids_BT, batch.targets.weights_BT * mod_w)
        with self._forward_context():
            out = self.compute(batch.inputs, targets=targets, subnet=subnet, return_logits=False)
        losses = out.losses
        mtp_w = staged(
            step, cfg.train.steps, cfg.train.mtp_weight, cfg.train.mtp_weight_final, cfg.train.stage2_frac
        )
        mtp = torch.stack(losses.mtp).mean() if losses.mtp else None
        total = losses.text
        if mtp is not None and mtp_w > 0:
            total = total + mtp_w * mtp
        if losses.aux is not None:
            total = total + losses.aux
        if losses.vision is not None:
            total = total + cfg.train.vision_gen_weight * weights.get("vision_gen", 1.0) * losses.vision
        if losses.audio is not None:
            total = total + cfg.train.audio_gen_weight * weights.get("audio_gen", 1.0) * losses.audio
        if self.par is not None:
            self.par.touch_root(total / cfg.train.grad_accum).backward()
        else:
            (total / cfg.train.grad_accum).backward()
            self.precision.accumulate_grads(only_micro_batch=cfg.train.grad_accum == 1)
        with torch.no_grad():
            valid = batch.targets.ids_BT != IGNORE
            per_mod = {}
            for i, m in enumerate(MODALITIES):
                sel = valid & (batch.modality == i)
                if sel.any():
                    per_mod[m] = float(losses.nll_BT[sel].mean())
        counts = {i: r.counts_E.detach().cpu() for i, r in out.routing.items()}
        avail = {}
        for i in self.moe_layers:
            mask = subnet.expert_mask(i, cfg.model.moe.n_experts, torch.device("cpu"))
            avail[i] = mask if mask is not None else torch.ones(cfg.model.moe.n_experts, dtype=torch.bool)
        rep = count_params(cfg.model, subnet, cfg.data.seq_len)
        return {
            "loss": float(losses.text.detach()),
            "total": float(total.detach()),
            "mtp": float(mtp.detach()) if mtp is not None else None,
            "aux": float(losses.aux.detach()) if losses.aux is not None else None,
            "vision_gen": float(losses.vision.detach()) if losses.vision is not None else None,
            "audio_gen": float(losses.audio.detach()) if losses.audio is not None else None,
            "audio_levels": [float(x.detach()) for x in losses.audio_levels],
            "per_mod": per_mod,
            "dims": dims,
            "counts": counts,
            "avail": avail,
            "tokens": int(valid.sum()),
            "active": rep.active_params_no_embedding,
            "flops": _train_flops(rep, mtp is not None, mtp is not None and mtp_w > 0),
            "data_wait_s": self.stream.wait_s,  # seconds this micro-batch's batch() waited
        }

    def _forward_context(self):
        """A micro-batch's forward context: the parallel model's (activation offload), or for one
        process the same switch (``train.parallel.activation_offload``: saved activations in host
        memory on a GPU; nothing to do on the CPU)."""
        if self.par is not None:
            return self.par.forward_context()
        if self.cfg.train.parallel.activation_offload and self.device.type == "cuda":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return nullcontext()

    def _gather_micros(self, micros: list[dict]) -> list[dict]:
        """Every process's micro-batch records, in global micro-batch order (for logging and the
        loss-balance state, which must be identical on every process)."""
        light = [{k: v for k, v in m.items() if k not in ("counts", "avail")} for m in micros]
        gathered: list = [None] * self.dist.world
        torch.distributed.all_gather_object(gathered, light)
        out = []
        for a in range(len(micros)):
            for r in range(self.dist.world):
                rec = dict(gathered[r][a])
                if r == self.dist.rank:
                    rec.update(counts=micros[a]["counts"], avail=micros[a]["avail"])
                else:
                    rec.update(counts={}, avail={})
                out.append(rec)
        return out

    def _update_biases(self, step: int, micros: list[dict]) -> None:
        speed = staged(
            step,
            self.cfg.train.steps,
            self.cfg.train.bias_speed,
            self.cfg.train.bias_speed_final,
            self.cfg.train.stage2_frac,
        )
        n_exp = self.cfg.model.moe.n_experts
        for i, moe in self.moe_layers.items():
            counts = torch.zeros(n_exp, dtype=torch.long)
            avail = torch.zeros(n_exp, dtype=torch.bool)
            for m in micros:
                if i in m["counts"]:  # the layer ran in this micro-batch
                    counts += m["counts"][i]
                    avail |= m["avail"][i]
            if self.dist.world > 1:  # every process joins, whichever layers it ran
                torch.distributed.all_reduce(counts)
                avail_i = avail.to(torch.int32)
                torch.distributed.all_reduce(avail_i, op=torch.distributed.ReduceOp.MAX)
                avail = avail_i.bool()
            dev = moe.router_bias.device  # the loads were summed on the CPU; the bias lives with the model
            update_router_bias(moe, counts.to(dev), speed, avail.to(dev))

    def _checkpoint(self, step: int) -> None:
        if self.par is not None:
            self._checkpoint_sharded(step)
            return
        if not self.dist.main:
            return
        path = checkpoint_dir(self.run_dir, step)
        bad = first_nonfinite(self.model.named_parameters())
        if bad is not None:  # never a checkpoint of non-finite weights
            raise DivergedError(
                f"step {step}: weight {bad} is not finite; not saved; {last_good(self.run_dir)}"
            )
        state = {"step": step, "balance_ema": self.balance_ema}
        tensors = {"torch_rng": torch.get_rng_state()}
        save_checkpoint(
            path,
            self.model,
            tokenizer=self.tokenizer,
            meta={**provenance(self.cfg.train.seed), "step": step, "subnet": None, "run": str(self.run_dir)},
            train_state=(self.optimizer, tensors, state),
            vision_tokenizer=self.vision_tokenizer,
            refiner=self.refiner,
            audio_codec=self.audio_codec,
        )
        self._drop_old_checkpoints()

    def _checkpoint_sharded(self, step: int) -> None:
        """Every process writes its shards (``train.pretrain.parallel.checkpoint``) into a hidden folder;
        the main process then publishes the checkpoint around them, atomically. Nothing is gathered:
        the weights are the shards (``ernie5 export`` consolidates them)."""
        root = self.run_dir / "checkpoints"
        shards = root / f".step_{step:08d}.dcp-tmp"
        if self.dist.main:
            shutil.rmtree(shards, ignore_errors=True)
        self._barrier()
        mesh = self.par.meshes.experts
        parallel_ckpt.save_train_state(shards, self.model, self.optimizer, mesh)
        if self.dist.main:
            state = {"step": step, "balance_ema": self.balance_ema, "world_size": self.dist.world}
            save_checkpoint(
                checkpoint_dir(self.run_dir, step),
                self.model,  # its config only: the weights are the shards
                weights=False,
                tokenizer=self.tokenizer,
                meta={
                    **provenance(self.cfg.train.seed),
                    "step": step,
                    "subnet": None,
                    "run": str(self.run_dir),
                    "train_state": state,
                },
                vision_tokenizer=self.vision_tokenizer,
                refiner=self.refiner,
                audio_codec=self.audio_codec,
                extra_dirs={parallel_ckpt.DCP_DIR: shards},
            )
            self._drop_old_checkpoints()
        self._barrier()

    def _drop_old_checkpoints(self) -> None:
        drop_old_checkpoints(self.run_dir, self.cfg.train.keep_ckpts)

    def run(self) -> dict:
        """Train to ``train.steps``; returns the last logged record. The first process holds the run
        folder's lock throughout (a second run into the same folder is a one-line error)."""
        with hold_run_folder(self.run_dir):
            self._setup()
            try:
                self.trackers = Trackers(
                    self.log_with, self.run_dir, self.run_dir.name, asdict(self.cfg), main=self.dist.main
                )
                return self._train()
            finally:
                self.trackers.close()
                self.stream.close()  # the data-loader workers, if any

    def _train(self) -> dict:
        with preemptible(self.cfg.train.preempt_grace_s) as stop:
            return self._steps(stop)

    def _stop_requested(self, stop: Preemption) -> bool:
        """Whether any process was asked to stop (every process stops at the same step)."""
        if self.dist.world == 1:
            return stop.requested
        flag = torch.tensor(
            [float(stop.requested)], device=self.device if self.device.type != "cpu" else None
        )
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _steps(self, stop: Preemption) -> dict:
        self._barrier()
        cfg = self.cfg
        steps = cfg.train.steps
        last: dict = {}
        bar = None
        if self.dist.main and not self.quiet:
            from tqdm import tqdm

            bar = tqdm(total=steps, initial=self.start_step, desc="train", unit="step", dynamic_ncols=True)
        self._steps_since_record = 0
        guard = NonFinitePolicy(
            cfg.train.nonfinite, cfg.train.nonfinite_patience, self.run_dir, write=self.dist.main
        )
        for step in range(self.start_step, steps):
            t0 = time.perf_counter()
            lr = lr_at(step, steps, cfg.optim.lr, cfg.schedule)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            weights = self._modality_weights()
            micros = [self._micro_step(step, m, weights) for m in range(cfg.train.grad_accum)]
            if self.par is not None:
                micros = self._gather_micros(micros)
            keys = ("total", "loss", "mtp", "aux", "vision_gen", "audio_gen")
            problem = next((x for m in micros if (x := loss_problem({k: m[k] for k in keys}))), None)
            grad_norm = math.nan
            if problem is None:
                if self.par is not None:
                    grad_norm = self.par.finish_grads(cfg.optim.grad_clip)
                    if math.isfinite(grad_norm):
                        self.optimizer.step()
                else:
                    grad_norm = self.precision.step(self.optimizer, cfg.optim.grad_clip, skip_nonfinite=True)
                if not math.isfinite(grad_norm):
                    problem = (
                        f"gradient norm ({grad_norm}; first in {nonfinite_grad(self.model, self.compute)})"
                    )
            done = step + 1
            if problem is not None:  # nothing learned from this step (train.nonfinite)
                self.optimizer.zero_grad(set_to_none=True)
                if self.par is None:
                    self.precision.discard_grads()
                if bar is not None:
                    bar.update(1)
                guard.skipped(done, problem)  # raises when the policy says stop
                if done == steps:
                    self._checkpoint(done)
                continue
            guard.ok()
            self.optimizer.zero_grad(set_to_none=True)
            self._update_biases(step, micros)
            if self.par is None:
                self.precision.sync()
            self._update_balance(micros)
            dt = time.perf_counter() - t0
            self._steps_since_record += 1
            if done % cfg.train.log_every == 0 or done == steps:
                last = self._record(done, lr, grad_norm, micros, dt)
                self._steps_since_record = 0
                if self.dist.main:
                    append_jsonl(self.run_dir / "metrics.jsonl", last)
                    self.trackers.log(last, step=done)
            if done % cfg.train.ckpt_every == 0 or done == steps:
                self._checkpoint(done)
                self._barrier()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{micros[0]['loss']:.3f}", lr=f"{lr:.2e}")
            if done < steps and self._stop_requested(stop):
                if done % cfg.train.ckpt_every != 0:
                    self._checkpoint(done)
                    self._barrier()
                if bar is not None:
                    bar.close()
                raise Preempted(
                    f"{stop.signal or 'stop requested'} at step {done} of {steps}: checkpoint "
                    f"{checkpoint_dir(self.run_dir, done)}; continue with --resume"
                )
        if bar is not None:
            bar.close()
        return last

    def _update_balance(self, micros: list[dict]) -> None:
        for m in micros:
            items = dict(m["per_mod"])
            for key in ("vision_gen", "audio_gen"):
                if m.get(key) is not None:
                    items[key] = m[key]
            for mod, v in items.items():
                old = self.balance_ema.get(mod)
                self.balance_ema[mod] = v if old is None else 0.98 * old + 0.02 * v

    def _record(self, step: int, lr: float, grad_norm: float, micros: list[dict], dt: float) -> dict:
        n = len(micros)
        tokens = sum(m["tokens"] for m in micros)
        active = sum(m["active"] for m in micros) / n
        flops = sum(m["flops"] for m in micros) / n
        rec = {
            "step": step,
            "loss": sum(m["loss"] for m in micros) / n,
            "loss_total": sum(m["total"] for m in micros) / n,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "tokens_per_s": tokens / dt,
            "mfu": 6 * active * tokens / dt / (self.peak * self.dist.world),
            "mfu_model_flops": flops * tokens / dt / (self.peak * self.dist.world),
            "subnets": [{**m["dims"], "loss": m["loss"]} for m in micros],
            "data_wait_s": sum(m["data_wait_s"] for m in micros) / self.dist.world,
        }
        if self.par is not None:
            sent = torch.tensor([self.par.take_a2a_bytes()], dtype=torch.float64)
            torch.distributed.all_reduce(sent)
            rec["a2a_bytes_per_step"] = float(sent) / self._steps_since_record
            rec["memory_per_process"] = self.par.memory(self.optimizer)
        mtps = [m["mtp"] for m in micros if m["mtp"] is not None]
        if mtps:
            rec["loss_mtp"] = sum(mtps) / len(mtps)
        auxs = [m["aux"] for m in micros if m["aux"] is not None]
        if auxs:
            rec["loss_aux"] = sum(auxs) / len(auxs)
        gens = [m["vision_gen"] for m in micros if m["vision_gen"] is not None]
        if gens:
            rec["loss_vision_gen"] = sum(gens) / len(gens)
        agens = [m for m in micros if m.get("audio_gen") is not None]
        if agens:
            rec["loss_audio_gen"] = sum(m["audio_gen"] for m in agens) / len(agens)
            levels = [m["audio_levels"] for m in agens]
            rec["loss_audio_levels"] = [sum(x) / len(levels) for x in zip(*levels, strict=True)]
        for mod in MODALITIES:
            vals = [m["per_mod"][mod] for m in micros if mod in m["per_mod"]]
            if vals:
                rec[f"loss_{mod}"] = sum(vals) / len(vals)
        full = {
            "depth": self.cfg.model.n_layers,
            "width": self.cfg.model.moe.n_experts,
            "top_k": self.cfg.model.moe.top_k,
        }
        for dim, full_v in full.items():
            for tag, pick in (("full", lambda v, f=full_v: v == f), ("reduced", lambda v, f=full_v: v != f)):
                vals = [m["loss"] for m in micros if pick(m["dims"][dim])]
                if vals:
                    rec[f"loss_{dim}_{tag}"] = sum(vals) / len(vals)
        ent = []
        for i in self.moe_layers:
            got = [(m["counts"][i], m["avail"][i]) for m in micros if i in m["counts"]]
            if got:
                ent.append(_routing_entropy(sum(c for c, _ in got), got[0][1]))
        if ent:
            rec["routing_entropy"] = sum(ent) / len(ent)
            rec["routing_entropy_per_layer"] = ent
        return rec


def _stored_world(run_dir: Path) -> int:
    """The number of processes that wrote a run folder's newest start (``meta.json``), 1 if unknown."""
    try:
        return int(json.loads((run_dir / "meta.json").read_text(encoding="utf-8")).get("world_size", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def pretrain(
    cfg: RunConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    data_dir: str | None = None,
    quiet: bool = False,
    log_with: Sequence[str] = (),
) -> dict:
    """Train ``cfg`` into ``run_dir`` (continuing its newest checkpoint with ``resume``); ``log_with``
    names experiment trackers that mirror ``metrics.jsonl`` (:mod:`ernie5.store.trackers`)."""
    trainer = Trainer(cfg, Path(run_dir), resume=resume, data_dir=data_dir, quiet=quiet, log_with=log_with)
    return trainer.run()
