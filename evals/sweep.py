"""``ernie5 sweep``: evaluate every (sub-model, task) unit of a suite on one checkpoint.

Flow: load the suite and the checkpoint once; resolve the sub-models against it
(:func:`ernie5.subnets.spec.resolve_specs`); for each unit, skip it if
``units/<subnet>/<task>.json`` holds the same fingerprint, else run the task's requests through the
cached model, score, aggregate and write the unit atomically; then measure each sub-model's
efficiency and rebuild the tables (``evals.results`` documents the folder). ``events.jsonl`` gets a
``unit_done`` line per computed unit with the process's resident memory after it (``rss_mb``), so a
long sweep's footprint can be read back (it stays flat over hundreds of units: tested).

The fingerprint of a unit is a hash of the checkpoint hash, the concrete sub-model (kept layers,
kept experts, top-k), the task name, version and options, the hash of its data files, the limit,
the seed, the batch size and the adapter version. ``--resume`` and running again into the same
folder are the same thing: matching units are skipped, others recomputed (an ``error`` unit is
always recomputed: a fixed bug does not change a fingerprint). A task whose data is missing is
recorded as ``skipped`` with the reason; a task that raises is recorded as ``error`` with the
message, the sweep goes on, and :attr:`SweepSummary.failed` lists it (``ernie5 sweep`` then exits 3).

One sweep writes a run folder at a time: it holds the folder's lock (``ernie5.store.runs.RunLock``) from
before its first write to its last, and first removes the temp files a killed run left. The tables,
the efficiency rows and the routing records are built from this sweep's units only (the manifest
lists them); unit files of an earlier sweep with another suite stay on disk, outside every table.

Hugging Face targets: ``checkpoint="hf:PATH"`` sweeps a local Hugging Face causal LM and its elastic
sub-models (:mod:`evals.hf_model`): the target's hash (the folder's content hash) stands for the
checkpoint hash in every fingerprint, its random twin is the same architecture initialised from the
suite seed, and its efficiency rows hold the analytic counts of each cut and timings of the masked
model (:func:`evals.hf_model.efficiency_rows`).

Over 500 lines for one reason: planning, evaluating and recording the units of one run folder is one
flow under one lock, whose steps share the unit plan and the summary (the task pipeline, the cache and
the results tables live in their own modules).

Random baseline: with ``subnets.random_baseline: true`` every task is also evaluated on the
pseudo-subnet ``random`` (``evals.results.RANDOM_BASELINE``), planned after the sub-models: a twin
of the checkpoint's model freshly initialised from the suite seed (:func:`random_twin`), with the
full architecture and the checkpoint's tokenizers and frozen side models. Its fingerprint adds
``{"baseline": {"kind": "random", "seed": <suite seed>}}`` to a full-model unit's, so it never equals
a checkpoint unit's, a resumed sweep reuses it and another seed recomputes it; units without the
baseline keep their fingerprints. Its units count in :class:`SweepSummary` (``n_units``, ``computed``,
...) like any other and are sharded across processes like any other (every process that needs it
builds the same twin); it gets no efficiency row and no routing record.

Data parallel: under ``accelerate launch --multi_gpu --num_processes N`` unit ``i`` runs on
process ``i mod N`` (each with its own response-cache connection); process 0 then measures
efficiency and merges, so the tables equal a one-process run's. Process 0 takes the lock and the
others learn from it whether it got it, so the processes of one launch write together and a second
launch fails on every process before writing anything.

Preemption: ``SIGTERM`` (or a first Ctrl-C) stops the sweep between units (:mod:`ernie5.runtime.preempt`):
the unit in progress is finished and written, or abandoned with nothing of it written if it does not
end within :data:`PREEMPT_GRACE_S`; the sweep then exits 143 without tables or manifest, and the same
command continues from the finished units. Under several processes each stops on its own signal
(torchrun and Slurm signal every rank).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ernie5.config import ConfigError, to_dict
from ernie5.data.root import resolve_data_dir
from ernie5.model.elastic import Subnet
from ernie5.model.model import Ernie5Model
from ernie5.runtime.distributed import check_device, init_dist, pick_device
from ernie5.runtime.memory import resident_mb
from ernie5.runtime.preempt import Preempted, preemptible
from ernie5.store.checkpoint import Checkpoint, checkpoint_hash, load_checkpoint
from ernie5.store.runs import RunLock, append_jsonl, provenance, write_json
from ernie5.store.trackers import Trackers, parse_log_with
from ernie5.subnets.spec import SubnetError, resolve_specs
from evals.adapter import ADAPTER_VERSION, Ernie5EvalModel
from evals.cache import CachedModel, ResponseCache
from evals.efficiency import MEASURE_VERSION, measure
from evals.hf_model import HFTarget, efficiency_rows, is_hf_target, load_hf_target
from evals.results import (
    RANDOM_BASELINE,
    read_unit,
    remove_leftovers,
    unit_path,
    write_tables,
    write_unit,
)
from evals.suite import LoadedSuite, distinct_subnets, load_suite, subnet_specs
from evals.task import TASKS, Evaluable

PREEMPT_GRACE_S = 60.0
"""Seconds the unit in progress may take to finish after ``SIGTERM`` before the sweep exits at once."""


@dataclass
class UnitPlan:
    """One (sub-model, task) unit to evaluate."""

    subnet: Subnet
    name: str
    task: Evaluable
    limit: int | None
    seed: int
    fingerprint: str
    data_hash: str
    available: bool
    reason: str
    baseline: dict | None = None
    """``{"kind": "random", "seed": S}`` for a unit of the random baseline (``name`` is ``random``)."""


@dataclass
class SweepSummary:
    """What a sweep did (the units of the random baseline count like any other)."""

    run_dir: Path
    n_units: int
    computed: int = 0
    reused: int = 0
    skipped: int = 0
    errors: int = 0
    wall_s: float = 0.0
    model_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    failed: list[str] = field(default_factory=list)
    """``subnet/task: reason`` of every unit of the sweep recorded as an error (all processes)."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """Task -> why it was skipped (missing data, a modality the model lacks, ...) with how to supply it,
    for every task of the suite that was not evaluated, reused or not (the console names them)."""

    @property
    def overhead_share(self) -> float:
        """Share of the unit wall time spent outside model forward passes."""
        return 1.0 - self.model_s / self.wall_s if self.wall_s > 0 else 0.0


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def subnet_identity(s: Subnet) -> list:
    """JSON-able identity of a concrete sub-model."""
    return [list(s.layers), [list(e) if e is not None else None for e in s.experts], s.top_k]


def model_capabilities(ckpt) -> set[str]:
    """What a checkpoint can do beyond text: ``vision``, ``refiner``, ``audio``."""
    caps = set()
    if getattr(ckpt, "audio_codec", None) is not None and getattr(ckpt.model, "audio", None) is not None:
        caps.add("audio")
    if ckpt.vision_tokenizer is not None and ckpt.model.vision is not None:
        caps.add("vision")
    if getattr(ckpt, "refiner", None) is not None:
        caps.add("refiner")
    return caps


def plan_units(
    loaded: LoadedSuite,
    ckpt_hash: str,
    subnets: list[Subnet],
    data_dir,
    limit: int | None,
    capabilities: set[str] | None = None,
    *,
    allow_code: bool = False,
    random_baseline: Subnet | None = None,
) -> list[UnitPlan]:
    """Every unit of the sweep with its fingerprint, sub-model-major. ``allow_code`` lets lm-eval
    tasks that run Python from their task folder (``!function``) be planned. ``random_baseline``,
    the checkpoint's full sub-model, adds a last block of units named ``random`` evaluated on the
    random twin (:func:`random_twin`) with the same tasks, availability and skip reasons."""
    cfg = loaded.cfg
    tasks = []
    for entry in cfg.tasks:
        task = TASKS.get(entry.task)(**entry.kwargs)
        ok, reason = task.available(data_dir)
        missing = [
            c for c in getattr(task, "requires", ()) if capabilities is not None and c not in capabilities
        ]
        if ok and missing:
            ok, reason = (
                False,
                (
                    f"the checkpoint has no {' or '.join(missing)} module; to get it: evaluate a checkpoint "
                    f"trained with {' and '.join(missing)} (the preset mini_all trains every modality)"
                ),
            )
        data_hash = task.fingerprint_data(data_dir) if ok else ""
        lim = entry.limit if limit is None else min(limit, entry.limit or limit)
        seed = cfg.seed if entry.seed is None else entry.seed
        tasks.append((task, lim, seed, ok, reason, data_hash))
    if cfg.lm_eval:
        from evals.lm_eval.unit import lm_eval_units

        for entry in cfg.lm_eval:
            for unit in lm_eval_units(entry, loaded.path.parent, allow_code=allow_code):
                ok, reason = unit.available(data_dir)
                data_hash = unit.fingerprint_data(data_dir) if ok else ""
                lim = entry.limit if limit is None else min(limit, entry.limit or limit)
                tasks.append((unit, lim, cfg.seed, ok, reason, data_hash))
    blocks: list[tuple[Subnet, str, dict | None]] = [(sub, sub.name, None) for sub in subnets]
    if random_baseline is not None:
        blocks.append((random_baseline, RANDOM_BASELINE, {"kind": RANDOM_BASELINE, "seed": cfg.seed}))
    units = []
    for sub, name, baseline in blocks:
        for task, lim, seed, ok, reason, data_hash in tasks:
            ident = {
                "checkpoint": ckpt_hash,
                "subnet": subnet_identity(sub),
                "task": task.name,
                "version": task.version,
                "kwargs": task.kwargs,
                "data": data_hash,
                "available": ok,
                "limit": lim,
                "seed": seed,
                "batch_size": cfg.batch_size,
                "adapter": ADAPTER_VERSION,
            }
            if baseline is not None:  # only then: the sub-models' fingerprints stay as they were
                ident["baseline"] = baseline
            fp = _hash(ident)
            units.append(UnitPlan(sub, name, task, lim, seed, fp, data_hash, ok, reason, baseline))
    return units


def random_twin(ckpt: Checkpoint, seed: int) -> Checkpoint:
    """``ckpt`` with its model replaced by a freshly initialised one of the same ModelConfig
    (``torch.manual_seed(seed)`` then ``Ernie5Model(cfg)``, in eval mode), each tensor on the device
    and in the dtype of the checkpoint's, with the checkpoint model's fast paths if it has them. The
    tokenizers and frozen side models (vision tokenizer, audio codec, refiner) are the checkpoint's.
    The global RNG state is left as it was."""
    import torch

    from ernie5.fast import apply_fast_paths, is_fast

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Ernie5Model(ckpt.cfg)  # on the CPU, so every device draws the same twin
    model.to(ckpt.model.tok_emb.weight.device)
    ref = ckpt.model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            r = ref.get(name)
            if r is not None and t.dtype != r.dtype:
                t.data = t.data.to(dtype=r.dtype)
    if is_fast(ckpt.model):
        apply_fast_paths(model)
    return dataclasses.replace(ckpt, model=model.eval())


def _random_hash(ckpt_hash: str, seed: int) -> str:
    """The identity the random twin's adapter answers under (so the response cache never mixes its
    answers with the checkpoint's)."""
    return _hash({"checkpoint": ckpt_hash, "baseline": RANDOM_BASELINE, "seed": seed})


def _record(plan: UnitPlan, status: str, reason: str = "", **extra) -> dict:
    return {
        "fingerprint": plan.fingerprint,
        "subnet": plan.name,
        "task": plan.task.name,
        "task_version": plan.task.version,
        "modality": plan.task.modality,
        "capability": plan.task.capability,
        "status": status,
        "reason": reason,
        "metrics": {},
        "n_examples": 0,
        "limit": plan.limit,
        "seed": plan.seed,
        "kwargs": plan.task.kwargs,
        "wall_s": 0.0,
        "model_s": 0.0,
        **extra,
    }


def run_sweep(
    checkpoint: str | Path,
    suite: str | Path,
    out: str | Path,
    *,
    data_dir: str | Path | None = None,
    limit: int | None = None,
    cache_path: str | Path | None = None,
    quiet: bool = False,
    argv: list[str] | None = None,
    confirm_run_unsafe_code: bool = False,
    log_with: Sequence[str] = (),
    device: str = "auto",
) -> SweepSummary:
    """Evaluate every unit of ``suite`` on ``checkpoint`` into ``out`` (resuming what matches).

    ``confirm_run_unsafe_code`` allows lm-eval tasks whose folder holds code they run. ``log_with``
    names experiment trackers (:mod:`ernie5.store.trackers`) that get every unit's scores and wall time
    once the tables are written (:func:`log_units`). ``device`` is where the model runs
    (:func:`ernie5.runtime.distributed.pick_device`: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; under
    several processes ``cuda`` is each process's ``LOCAL_RANK`` GPU).

    Raises:
        ConfigError: a bad suite, sub-model, ``limit`` or ``device`` (nothing written).
        RunLocked: another sweep is writing ``out`` (nothing written).
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"limit={limit}: expected an integer >= 1")
    log_with = parse_log_with(log_with)
    try:
        check_device(device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    t_start = time.perf_counter()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    loaded = load_suite(suite)
    cfg = loaded.cfg
    data_dir = resolve_data_dir(data_dir)
    hf = is_hf_target(checkpoint)  # a Hugging Face folder (evals.hf_model) instead of an ERNIE5 checkpoint
    ckpt = load_hf_target(checkpoint) if hf else load_checkpoint(checkpoint)
    ckpt_hash = ckpt.hash if hf else checkpoint_hash(ckpt.path)
    try:
        specs = subnet_specs(cfg.subnets)
        resolved = ckpt.resolve_specs(specs, data_dir) if hf else resolve_specs(specs, ckpt, data_dir)
        subnets = distinct_subnets(resolved, ckpt.cfg)
    except SubnetError as e:
        raise ConfigError(f"{loaded.path}: {e}") from None
    units = plan_units(
        loaded,
        ckpt_hash,
        subnets,
        data_dir,
        limit,
        model_capabilities(ckpt),
        allow_code=confirm_run_unsafe_code,
        random_baseline=Subnet.full(ckpt.cfg) if cfg.subnets.random_baseline else None,
    )
    n_blocks = len(subnets) + bool(cfg.subnets.random_baseline)
    dist = init_dist()
    on = pick_device(device)
    ckpt.model.to(on)  # the backbone only: tokenizers and frozen media models stay on the CPU
    run_dir = Path(out)
    lock = _lock(run_dir, dist)
    try:
        summary = _evaluate_units(ckpt, ckpt_hash, cfg, units, data_dir, run_dir, dist, cache_path, quiet)
        summary.unavailable = {u.task.name: u.reason for u in units if not u.available}
        if dist.main:
            names = [(u.name, u.task.name) for u in units]
            efficiency = (
                _efficiency(ckpt, subnets, cfg, run_dir, ckpt_hash, names) if cfg.efficiency.enabled else None
            )
            _write_routing(run_dir, subnets, ckpt.cfg.moe.n_experts, names)
            write_tables(run_dir, efficiency, names)
            manifest = {
                **provenance(cfg.seed, argv),
                "suite": cfg.name,
                "suite_hash": loaded.hash,
                "suite_yaml": loaded.text,
                "checkpoint": f"hf:{ckpt.path}" if hf else str(ckpt.path),
                "checkpoint_hash": ckpt_hash,
                "model_config": to_dict(ckpt.cfg),
                "subnets": [
                    {
                        "name": s.name,
                        "layers": list(s.layers),
                        "top_k": s.top_k,
                        "experts_per_layer": [
                            len(e) if e is not None else ckpt.cfg.moe.n_experts for e in s.experts
                        ],
                    }
                    for s in subnets
                ],
                "tasks": [
                    {
                        "name": u.task.name,
                        "version": u.task.version,
                        "modality": u.task.modality,
                        "capability": u.task.capability,
                        "data_hash": u.data_hash,
                        "available": u.available,
                    }
                    for u in units[: len(units) // max(1, n_blocks)]
                ],
                "units": [
                    {"subnet": u.name, "task": u.task.name, "fingerprint": u.fingerprint} for u in units
                ],
                "baseline": RANDOM_BASELINE if cfg.subnets.random_baseline else None,
                "data_dir": str(data_dir) if data_dir else None,
                "seeds": sorted({u.seed for u in units}),
                "world_size": dist.world,
                "device": on.type if dist.world > 1 else str(on),
                "started": started,
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "wall_s": time.perf_counter() - t_start,
            }
            write_json(run_dir / "manifest.json", manifest)
            if log_with:
                hparams = {k: manifest[k] for k in ("suite", "suite_hash", "checkpoint", "checkpoint_hash")}
                log_units(log_with, run_dir, units, summary, {**hparams, "world_size": dist.world})
    finally:
        if lock is not None:
            lock.release()
    return summary


def log_units(
    log_with: Sequence[str], run_dir: Path, units: list[UnitPlan], summary: SweepSummary, hparams: dict
) -> None:
    """Every finished unit of the sweep (computed by any process, or reused) to the trackers: its scores
    as ``TASK/METRIC/SUBNET`` at step 0 (one sweep, one point per cell), its wall and model time as
    ``unit/wall_s`` and ``unit/model_s`` at the unit's index; then the sweep's counts as ``sweep/*``."""
    with Trackers(log_with, run_dir, run_dir.name, hparams) as trackers:
        for i, plan in enumerate(units):
            rec = read_unit(unit_path(run_dir, plan.name, plan.task.name))
            if rec is None or rec.get("status") != "ok":
                continue
            scores = {f"{plan.task.name}/{m}/{plan.name}": v["value"] for m, v in rec["metrics"].items()}
            trackers.log(scores, step=0)
            trackers.log({"wall_s": rec["wall_s"], "model_s": rec["model_s"]}, step=i, prefix="unit/")
        counts = ("n_units", "computed", "reused", "skipped", "errors", "wall_s", "model_s")
        trackers.log({k: getattr(summary, k) for k in counts}, step=0, prefix="sweep/")


def _lock(run_dir: Path, dist) -> RunLock | None:
    """Process 0 locks ``run_dir`` and removes a killed run's leftovers; every process of the launch
    then learns whether it could, so all of them go on or all of them raise its error
    (``ernie5.store.runs.RunLocked`` when another sweep holds the folder)."""
    lock, error = None, None
    if dist.main:
        try:
            lock = RunLock(run_dir)
            remove_leftovers(run_dir)
        except Exception as e:  # noqa: BLE001 - every process raises it below
            error = e
    error = dist.broadcast(error)
    if error is not None:
        if lock is not None:
            lock.release()
        raise error
    return lock


def _evaluate_units(
    ckpt, ckpt_hash: str, cfg, units: list[UnitPlan], data_dir, run_dir: Path, dist, cache_path, quiet: bool
) -> SweepSummary:
    """Evaluate this process's share of ``units`` (reusing the done ones), wait for the others, and
    list every unit of the sweep recorded as an error."""
    cache = ResponseCache(cache_path or run_dir / "cache.sqlite")
    models = {}  # subnet name -> the cached adapter bound to it (one supernet in memory)
    summary = SweepSummary(run_dir, len(units))
    mine = units[dist.rank :: dist.world]
    bar = None
    if dist.main and not quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(mine), desc=f"sweep {cfg.name}", unit="unit", dynamic_ncols=True)
    done = 0
    with preemptible(PREEMPT_GRACE_S) as stop:  # checked between units (the module docstring)
        for plan in mine:
            if stop.requested:
                break
            existing = read_unit(unit_path(run_dir, plan.name, plan.task.name))
            if (
                existing is not None
                and existing["fingerprint"] == plan.fingerprint
                and existing["status"] != "error"
            ):
                summary.reused += 1
            elif not plan.available:
                write_unit(run_dir, _record(plan, "skipped", plan.reason), [])
                summary.skipped += 1
            else:
                if plan.name not in models:
                    if isinstance(ckpt, HFTarget):  # the twin: same architecture, seeded init, no routing
                        twin = ckpt.random_twin(plan.baseline["seed"]) if plan.baseline is not None else None
                        adapter = (twin or ckpt).adapter(
                            plan.subnet, cfg.batch_size, routing=cfg.routing and twin is None
                        )
                    elif plan.baseline is not None:  # the random twin: no routing (it has no routing record)
                        seed = plan.baseline["seed"]
                        adapter = Ernie5EvalModel(
                            random_twin(ckpt, seed),
                            plan.subnet,
                            cfg.batch_size,
                            routing=False,
                            ckpt_hash=_random_hash(ckpt_hash, seed),
                        )
                    else:
                        adapter = Ernie5EvalModel(
                            ckpt, plan.subnet, cfg.batch_size, routing=cfg.routing, ckpt_hash=ckpt_hash
                        )
                    models[plan.name] = CachedModel(adapter, cache)
                _compute(models[plan.name], plan, data_dir, run_dir, summary)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(subnet=plan.name, task=plan.task.name)
            done += 1
    if bar is not None:
        bar.close()
    summary.cache_hits = sum(m.hits for m in models.values())
    summary.cache_misses = sum(m.misses for m in models.values())
    cache.close()
    if done < len(mine):
        raise Preempted(
            f"sweep {cfg.name}: stopped by {stop.signal} after {done} of {len(mine)} units (each finished "
            f"unit is kept in {run_dir}); rerun the same command to continue"
        )
    dist.barrier()
    for plan in units:
        rec = read_unit(unit_path(run_dir, plan.name, plan.task.name))
        if rec is not None and rec.get("status") == "error":
            summary.failed.append(f"{plan.name}/{plan.task.name}: {rec.get('reason', '')}")
    return summary


def _compute(model: CachedModel, plan: UnitPlan, data_dir, run_dir: Path, summary: SweepSummary) -> None:
    """Evaluate one unit, record it (an exception becomes an ``error`` unit) and count it."""
    t0 = time.perf_counter()
    try:
        result = plan.task.evaluate(
            model, data_dir=data_dir, limit=plan.limit, seed=plan.seed, work_dir=run_dir / "lm_eval_tasks"
        )
        status, reason, samples = "ok", "", result.samples
        fields = {"metrics": result.metrics, "n_examples": result.n_examples, "model_s": result.model_s}
    except Exception as e:  # noqa: BLE001 - a failing task is recorded and the sweep goes on
        result, samples = None, []
        fields = {"traceback": traceback.format_exc()}
        status, reason = "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        summary.errors += 1
    wall = time.perf_counter() - t0
    if result is not None and result.routing:
        counts = result.routing
        n_real = sum(sum(c) for c in counts.values()) // max(1, plan.subnet.top_k) // max(1, len(counts))
        fields["routing"] = {"tokens": n_real, "counts": {str(k): v for k, v in sorted(counts.items())}}
    record = _record(plan, status, reason, wall_s=wall, **fields)
    write_unit(run_dir, record, samples)
    append_jsonl(
        run_dir / "events.jsonl",
        {
            "event": "unit_done",
            "subnet": plan.name,
            "task": plan.task.name,
            "fingerprint": plan.fingerprint,
            "status": status,
            "rss_mb": round(resident_mb(), 1),
        },
    )
    summary.computed += status == "ok"
    summary.wall_s += wall
    summary.model_s += fields.get("model_s", 0.0)


def _efficiency(
    ckpt, subnets: list[Subnet], cfg, run_dir: Path, ckpt_hash: str, names: list[tuple[str, str]]
) -> list[dict]:
    from evals.results import all_units

    if isinstance(ckpt, HFTarget):
        return efficiency_rows(ckpt, subnets, cfg.efficiency)
    units = all_units(run_dir, names)
    rows = []
    for sub in subnets:
        fp = _hash(
            {
                "checkpoint": ckpt_hash,
                "subnet": subnet_identity(sub),
                "cfg": to_dict(cfg.efficiency),
                "method": MEASURE_VERSION,
            }
        )
        path = run_dir / "efficiency" / f"{sub.name}.json"
        try:
            cached = json.loads(path.read_text())
            # A failed measurement is taken again, as an error unit is (the machine may be quieter now).
            if cached.get("fingerprint") == fp and cached["row"].get("status") == "ok":
                rows.append(cached["row"])
                continue
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            pass
        counts: dict[int, list[int]] = {}
        tokens = 0
        for u in units:
            if u["subnet"] == sub.name and u.get("routing"):
                tokens += u["routing"]["tokens"]
                for layer, c in u["routing"]["counts"].items():
                    old = counts.get(int(layer), [0] * len(c))
                    counts[int(layer)] = [a + b for a, b in zip(old, c)]
        row = measure(ckpt.model, sub, cfg.efficiency, counts, tokens)
        write_json(path, {"fingerprint": fp, "row": row})
        rows.append(row)
    return rows


def _write_routing(
    run_dir: Path, subnets: list[Subnet], n_experts: int, names: list[tuple[str, str]]
) -> None:
    """``routing/<subnet>.json`` of this sweep's sub-models from this sweep's units; a routing record
    of a sub-model not in the sweep (or one without routing now) is removed, as it is a table."""
    from evals.results import all_units

    units = all_units(run_dir, names)
    keep = {f"{sub.name}.json" for sub in subnets}
    if (run_dir / "routing").is_dir():
        for path in (run_dir / "routing").glob("*.json"):
            if path.name not in keep:
                path.unlink()
    for sub in subnets:
        tasks = {}
        for u in units:
            if u["subnet"] == sub.name and u.get("routing"):
                tasks[u["task"]] = {
                    "modality": u["modality"],
                    "tokens": u["routing"]["tokens"],
                    "counts": u["routing"]["counts"],
                }
        path = run_dir / "routing" / f"{sub.name}.json"
        if tasks:
            write_json(path, {"n_experts": n_experts, "layers": [i for i in sub.layers], "tasks": tasks})
        else:
            path.unlink(missing_ok=True)
