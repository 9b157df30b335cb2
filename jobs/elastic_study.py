"""``ernie5 study elastic``: one elastic pre-training run against the controls the paper lacks.

Every model is trained on the same tokens (same data mixture, seed and steps), and every trained
model and every evaluation is a resumable unit under ``OUT``; a killed study continues where it
stopped (a finished unit is skipped, an interrupted training run resumes from its newest checkpoint,
a sweep keeps its finished units). The report is :func:`reports.elastic_study.write_report`.

Layout of ``OUT``::

    study.yaml                 the study config (a rerun with another config is refused)
    study.json                 shapes, variants, arms and per-unit wall times (what the report reads)
    train/elastic              elastic pre-training (elastic sampling on)
    train/static               the static full model (elastic sampling off), same tokens
    train/static-<shape>       a static model trained from scratch at a sub-model's exact shape
    pruned/<shape>             the static full model physically sliced to <shape> (extract_subnet),
                               by the same deploy selection the elastic sub-model uses
    train/recover-<shape>      the pruned model fine-tuned for ``recovery_steps`` (train.init_from)
    suites/<arm>.yaml          the study suite with that arm's sub-models
    sweeps/<arm>               ``ernie5 sweep`` run folders
    loss/<arm>.json            held-out loss per sub-model on fixed batches
    report.md, report.html, summary.json, loss.png

Which sub-models each arm is evaluated as:
  * ``elastic`` and ``static``: ``full``, every shape, and each shape with the other deploy
    selections: ``importance`` (ShortGPT layers, most-routed experts) and ``random:SEED`` for each
    of ``random_seeds``. The shapes of ``static`` are the *pruned* rows without recovery: slicing is
    exact (``extract_subnet``'s plain forward equals the masked forward), so the masked sub-model of
    the static checkpoint is the pruned model, for every selection, without writing a checkpoint.
  * ``static-<shape>`` and ``recover-<shape>``: ``full`` (they are that shape).

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §3.3 (elastic training), §6.4.2 (Tables 9-12).
  * Minitron (arXiv 2407.14679): pruning a trained model plus a short distillation/fine-tune, the
    post-hoc compression baseline the report argues against.
  * ShortGPT block influence (arXiv 2403.03853): importance-based layer selection.

Deviations:
  1. The paper reports no static model at a reduced shape, no pruned model and no deploy-time
     selection; these are the controls of this study, not reproductions.
  2. Recovery is a plain continued pre-training (same mixture, the base config's schedule over
     ``recovery_steps``), not Minitron's logit distillation; its tokens come on top of the static
     full model's, so the recovered rows have seen more tokens than the others (the report says how
     many).
  3. Held-out loss is measured on ``val_batches`` fixed batches of the training mixture drawn with a
     seed no training run uses: new procedural documents, but the same text corpora (a Shakespeare
     passage may have been trained on). The harness's ``shakespeare_bpb`` (its held-out tail) is
     the uncontaminated held-out loss.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from ernie5.config import check, dump, load, read_yaml, to_dict
from ernie5.data.root import resolve_data_dir
from ernie5.model.inputs import Targets
from ernie5.presets import resolve_config_path
from ernie5.store.checkpoint import checkpoint_dir, checkpoint_dirs, load_checkpoint
from ernie5.store.runs import provenance, write_atomic, write_json
from ernie5.subnets.extract import extract_checkpoint, subnet_config
from ernie5.subnets.spec import SubnetError, parse_subnet, resolve, resolve_specs
from evals.suite import load_suite, resolve_suite_path
from evals.sweep import run_sweep, subnet_identity
from reports.elastic_study import write_report
from train.common.run_folder import RunError
from train.pretrain.config import RunConfig
from train.pretrain.data import MixtureStream, open_sources
from train.pretrain.loop import pretrain

DEFAULT_SHAPES = ("d0.75", "w0.5", "k1", "d0.75-w0.5-k0.5")
"""The nightly's one-dimension sub-models and the paper's EA point (depth, width and top-k together)."""
ELASTIC, STATIC = "elastic", "static"


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticStudyConfig:
    """What the study trains and evaluates (``ernie5/presets/study_*.yaml``)."""

    base: str = "micro"
    """Run config of every model: a preset name or a run-config YAML file."""
    overrides: tuple[str, ...] = ()
    """``dotted.key=value`` overrides of the base run config, for every model."""
    steps: int = 40
    """Optimizer steps of every model trained from scratch (the same tokens for all of them)."""
    shapes: tuple[str, ...] = DEFAULT_SHAPES
    """Sub-model specs studied (default deploy selection: layers even, experts random:0)."""
    suite: str = "elastic_study"
    """Suite name or YAML file of the sweeps (its ``subnets`` section is replaced per arm)."""
    recovery_steps: int = 10
    """Fine-tuning steps of each pruned model (0 = no recovery arm)."""
    random_seeds: tuple[int, ...] = (1,)
    """Seeds of the ``random:SEED`` layer and expert selections compared with the default and importance."""
    importance: bool = True
    """Also evaluate importance-based selection (calibrated on each model)."""
    val_batches: int = 8
    """Fixed held-out batches of the held-out loss."""
    val_seed: int = 1_000_003
    """Data seed of the held-out batches (never a training seed)."""

    def __post_init__(self) -> None:
        check(self.steps >= 1, f"steps={self.steps} must be >= 1")
        check(self.recovery_steps >= 0, f"recovery_steps={self.recovery_steps} must be >= 0")
        check(self.val_batches >= 2, f"val_batches={self.val_batches} must be >= 2 (paired intervals)")
        check(bool(self.shapes), "shapes must name at least one sub-model")
        for s in self.shapes:
            try:
                spec = parse_subnet(s)
            except SubnetError as e:
                raise ValueError(f"shapes: {s!r}: {e}") from None
            check(not spec.is_full, f"shapes: {s!r} is the full model, not a reduced shape")
        names = [parse_subnet(s).compact() for s in self.shapes]
        check(len(set(names)) == len(names), f"shapes={list(self.shapes)} name one shape twice")
        check(all(s >= 0 for s in self.random_seeds), f"random_seeds={list(self.random_seeds)} must be >= 0")


def load_study_config(config: str | Path, overrides: list[str] = ()) -> ElasticStudyConfig:
    """The study config of a preset name (``study_micro``) or YAML file, with ``--set`` overrides."""
    return load(ElasticStudyConfig, resolve_config_path(config), list(overrides))


# ---------------------------------------------------------------------------- plan
def variants(shape: str, cfg: ElasticStudyConfig) -> dict[str, str]:
    """Selection label -> compact spec of ``shape`` under each deploy selection (``default`` first).

    A selection along a dimension the shape does not reduce is dropped (``k1`` has only ``default``)."""
    spec = parse_subnet(shape)
    out = {"default": spec.compact()}
    choices = [("importance", "importance", "importance")] if cfg.importance else []
    choices += [(f"random:{s}", f"random:{s}", f"random:{s}") for s in cfg.random_seeds]
    for label, layers, experts in choices:
        name = replace(spec, layers=layers, experts=experts).compact()
        if name not in out.values():
            out[label] = name
    return out


def all_specs(cfg: ElasticStudyConfig) -> list[str]:
    """``full`` then every shape under every selection (what ``elastic`` and ``static`` are swept as)."""
    specs = ["full"]
    for shape in cfg.shapes:
        specs += [s for s in variants(shape, cfg).values() if s not in specs]
    return specs


def shape_name(shape: str) -> str:
    """The compact name of a shape (folder names use it)."""
    return parse_subnet(shape).compact()


def run_config(cfg: ElasticStudyConfig, data_dir: str | None = None) -> RunConfig:
    """The base run config with the study's overrides and ``steps``."""
    run = load(RunConfig, resolve_config_path(cfg.base), list(cfg.overrides))
    return replace(run, train=replace(run.train, steps=cfg.steps))


def arm_configs(cfg: ElasticStudyConfig) -> dict[str, RunConfig]:
    """The from-scratch training arms: ``elastic``, ``static`` and ``static-<shape>``."""
    base = run_config(cfg)
    out = {
        ELASTIC: replace(base, elastic=replace(base.elastic, enabled=True)),
        STATIC: replace(base, elastic=replace(base.elastic, enabled=False)),
    }
    for shape in cfg.shapes:
        sub = resolve(shape, base.model)
        model = subnet_config(base.model, sub)
        out[f"static-{shape_name(shape)}"] = replace(
            base, model=model, elastic=replace(base.elastic, enabled=False)
        )
    return out


def recovery_config(cfg: ElasticStudyConfig, shape: str, pruned: Path) -> RunConfig:
    """The recovery fine-tune of ``pruned`` (a checkpoint of ``shape``): its own model config, started
    from its weights (``train.init_from`` needs the model config equal to the checkpoint's)."""
    base = run_config(cfg)
    model = subnet_config(base.model, resolve(shape, base.model))
    return replace(
        base,
        model=model,
        elastic=replace(base.elastic, enabled=False),
        train=replace(base.train, steps=cfg.recovery_steps, init_from=str(pruned)),
    )


# ---------------------------------------------------------------------------- units
def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


class _Ledger:
    """``study.json``: the units done (with the key they were done for) and their wall times."""

    def __init__(self, out: Path, header: dict) -> None:
        self.path = out / "study.json"
        try:
            old = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            old = {}
        self.data = {**header, "units": old.get("units", {}) if isinstance(old, dict) else {}}
        self.save()

    def done(self, unit: str, key: str) -> bool:
        rec = self.data["units"].get(unit)
        return isinstance(rec, dict) and rec.get("key") == key

    def finish(self, unit: str, key: str, wall_s: float, reused: bool = False, **extra) -> None:
        """Record ``unit`` as done for ``key``; a unit that found its work already done (a run
        config whose schema grew a field, say) keeps the wall time it was measured with."""
        prev = self.data["units"].get(unit, {})
        total = wall_s + (prev.get("wall_s", 0.0) if prev.get("key") == key or reused else 0.0)
        self.data["units"][unit] = {"key": key, "wall_s": round(total, 3), **extra}
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)


def _trained(run_dir: Path, steps: int) -> bool:
    return checkpoint_dir(run_dir, steps) in checkpoint_dirs(run_dir)


def _train(run: RunConfig, run_dir: Path, data_dir, quiet: bool) -> dict | None:
    """Train (or continue) ``run`` in ``run_dir``; ``{"reused": True}`` when it had already finished."""
    if _trained(run_dir, run.train.steps):
        return {"reused": True}
    pretrain(run, run_dir, resume=(run_dir / "config.yaml").exists(), data_dir=data_dir, quiet=quiet)
    return None


def _extract(checkpoint: Path, shape: str, out: Path, data_dir) -> None:
    """Slice ``shape`` out of ``checkpoint`` into ``out`` (written whole or not at all)."""
    if (out / "meta.json").is_file():
        return
    extract_checkpoint(checkpoint, shape, out, data_dir)


def _suite_file(cfg: ElasticStudyConfig, out: Path, arm: str, specs: list[str], baseline: bool) -> Path:
    """The study suite with ``arm``'s sub-models (the tasks, seed and settings unchanged)."""
    data = read_yaml(resolve_suite_path(cfg.suite))
    data["name"] = f"{data.get('name', 'elastic_study')}-{arm}"
    data["subnets"] = {"specs": specs, "random_baseline": baseline}
    path = out / "suites" / f"{arm}.yaml"
    write_atomic(path, yaml.safe_dump(data, sort_keys=False))
    load_suite(path)  # a bad study suite fails here, before any evaluation
    return path


@torch.no_grad()
def heldout_loss(
    checkpoint: Path, specs: list[str], run: RunConfig, data_dir, cfg: ElasticStudyConfig
) -> dict:
    """Mean next-token loss of each sub-model of ``checkpoint`` on ``val_batches`` fixed batches.

    Returns ``{"tokenizer": hash, "subnets": {spec: {"identity", "batches": [loss per batch], "mean"}}}``
    (a multimodal model adds ``vision_batches`` (NFSP bit BCE) and ``audio_batches`` (NCP cross-entropy),
    ``None`` for a batch without such rows);
    the batches are the same for every checkpoint with the same tokenizer, so arms pair batch by batch."""
    ckpt = load_checkpoint(checkpoint)
    subnets = resolve_specs(specs, ckpt, data_dir)
    sources = open_sources(run.data, data_dir, ckpt.cfg.vision.image_size)
    stream = MixtureStream(
        run.data,
        sources,
        ckpt.tokenizer,
        cfg.val_seed,
        ckpt.vision_tokenizer,
        ckpt.cfg.vision,
        ckpt.audio_codec,
    )
    batches = [stream.batch(0, i) for i in range(cfg.val_batches)]
    model = ckpt.model.eval()
    out = {}
    for spec, sub in zip(specs, subnets):
        losses, parts = [], {"vision": [], "audio": []}
        for b in batches:
            res = model(
                b.inputs,
                targets=Targets(b.targets.ids_BT, b.targets.weights_BT),
                subnet=sub,
                return_logits=False,
            )
            losses.append(float(res.losses.text))
            for part in parts:  # the media generation losses (None when no batch row generates media)
                value = getattr(res.losses, part)
                parts[part].append(None if value is None else float(value))
        out[spec] = {
            "identity": subnet_identity(sub),
            "batches": losses,
            "mean": sum(losses) / len(losses),
            **{f"{part}_batches": v for part, v in parts.items() if any(x is not None for x in v)},
        }
    tok = (ckpt.path / "tokenizer.json").read_bytes() if (ckpt.path / "tokenizer.json").is_file() else b""
    return {"checkpoint": str(ckpt.path), "tokenizer": hashlib.sha256(tok).hexdigest()[:16], "subnets": out}


def run_study(
    cfg: ElasticStudyConfig,
    out: str | Path,
    *,
    data_dir: str | Path | None = None,
    resume: bool = False,
    quiet: bool = False,
    argv: list[str] | None = None,
) -> Path:
    """Run (or continue) every unit of the study into ``out`` and write its report; returns ``report.md``.

    Raises:
        RunError: ``out`` holds another study (a different config) or a non-study folder without
            ``resume``; a training unit that fails.
    """
    out = Path(out)
    data_dir = resolve_data_dir(data_dir)
    text = dump(cfg)
    stored = out / "study.yaml"
    if stored.is_file():
        if stored.read_text() != text:
            raise RunError(f"{out} holds a study with another config ({stored}); choose a new --out")
    elif out.exists() and any(out.iterdir()) and not resume:
        raise RunError(f"--out {out} exists and is not an elastic study folder; choose a new folder")
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(stored, text)
    arms = arm_configs(cfg)
    shapes = {shape_name(s): variants(s, cfg) for s in cfg.shapes}
    specs = all_specs(cfg)
    ledger = _Ledger(
        out,
        {
            "config": to_dict(cfg),
            "shapes": shapes,
            "specs": specs,
            "tokens_per_step": run_config(cfg).data.seq_len
            * run_config(cfg).data.batch_size
            * run_config(cfg).train.grad_accum,
            "provenance": provenance(run_config(cfg).train.seed, argv),
            "data_dir": str(data_dir) if data_dir else None,
        },
    )

    def unit(name: str, key: str, fn, **extra) -> None:
        if ledger.done(name, key):
            return
        t0 = time.perf_counter()
        result = fn()
        ledger.finish(name, key, time.perf_counter() - t0, **extra, **(result or {}))

    # 1-2: the from-scratch models, the same tokens for each
    for arm, run in arms.items():
        unit(
            f"train/{arm}",
            _key(to_dict(run)),
            lambda run=run, arm=arm: _train(run, out / "train" / arm, data_dir, quiet),
        )
    # 3: pruning (default selection) and recovery
    recovered = {}
    if cfg.recovery_steps > 0:
        static_ckpt = checkpoint_dirs(out / "train" / STATIC)[-1]
        for shape in cfg.shapes:
            name = shape_name(shape)
            pruned = out / "pruned" / name
            unit(
                f"prune/{name}",
                _key([str(static_ckpt), name]),
                lambda shape=shape, pruned=pruned: _extract(static_ckpt, shape, pruned, data_dir),
            )
            run = recovery_config(cfg, shape, pruned)
            unit(
                f"train/recover-{name}",
                _key(to_dict(run)),
                lambda run=run, name=name: _train(run, out / "train" / f"recover-{name}", data_dir, quiet),
            )
            recovered[f"recover-{name}"] = run
    # 4-5: held-out loss and the harness on every model and sub-model
    eval_arms = {ELASTIC: (specs, True), STATIC: (specs, True)}
    for arm in [*arms, *recovered]:
        eval_arms.setdefault(arm, (["full"], False))
    for arm, (arm_specs, baseline) in eval_arms.items():
        ckpt = checkpoint_dirs(out / "train" / arm)[-1]
        run = recovered.get(arm) or arms[arm]
        loss_key = _key([str(ckpt), arm_specs, cfg.val_batches, cfg.val_seed])
        unit(
            f"loss/{arm}",
            loss_key,
            lambda ckpt=ckpt, arm_specs=arm_specs, run=run, arm=arm: write_json(
                out / "loss" / f"{arm}.json", heldout_loss(ckpt, arm_specs, run, data_dir, cfg)
            ),
        )
        suite = _suite_file(cfg, out, arm, arm_specs, baseline)
        sweep_key = _key([str(ckpt), suite.read_text()])

        def sweep(ckpt=ckpt, suite=suite, arm=arm) -> dict:
            s = run_sweep(ckpt, suite, out / "sweeps" / arm, data_dir=data_dir, quiet=quiet, argv=argv)
            if s.failed:
                raise RunError(f"sweep of {arm}: {len(s.failed)} units failed (first: {s.failed[0]})")
            return {"units": s.n_units, "computed": s.computed, "reused": s.reused, "skipped": s.skipped}

        unit(f"sweep/{arm}", sweep_key, sweep)
    ledger.data["arms"] = {arm: str(out / "train" / arm) for arm in eval_arms}
    ledger.data["recovery_tokens"] = cfg.recovery_steps * ledger.data["tokens_per_step"]
    ledger.save()
    return write_report(out)
