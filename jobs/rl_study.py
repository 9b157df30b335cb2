"""``ernie5 rl-study STUDY``: the RL ablations, each one command and one report section.

Every arm is ``--seeds`` (default 3) ``ernie5 rl`` runs in ``OUT/<arm>/seed_<s>`` from the same
checkpoint, with the same queries and budget; seed ``s`` is ``rl.seed`` (the query stream, sampling and
sub-models), the same seeds for every arm, so that only the arm's own settings differ. The report gives
each figure as a mean with its 95 % interval over seeds and tests every arm against the first. A killed
study continues where it stopped (a finished run is kept, an interrupted one resumes from its newest
checkpoint). The section
(``OUT/report.md``, ``OUT/report.html``, ``OUT/curves.png``, ``OUT/summary.json``) is
:func:`reports.rl.write_report`.

Held-out scores: once a run has finished, its last checkpoint's full model is swept over the run's
harness tasks (``ernie5 sweep``, the harness's own evaluation items, which RL never trains on:
:mod:`evals.verifiers`) into ``RUN/heldout/``, and so is the starting checkpoint into
``OUT/start/heldout/``; the report sets each arm's scores (mean and interval over seeds) beside the
start's and tests them as it tests the claims. ``--heldout-limit`` caps the items per task (default
:data:`HELDOUT_LIMIT`); tasks the harness does not know (a test's toy verifier) are left out.

Studies:
  * ``objective``: MISC + WPSM (the report's recipe), with and without routing replay, against MISC
    without WPSM, the report's comparison arms GRPO-IcePop (token mismatch mask x token clip, Eq. 1)
    and GSPO-IcePop (sequence mask x sequence clip, Eq. 2), and the mismatch-blind GSPO and GRPO:
    entropy and reward curves, and the train/inference mismatch each leaves.
  * ``ahrl``: with and without adaptive hints: the no-hint success rate on the pool queries that were
    hard for the starting model, before and after.
  * ``scheduler``: U-RB, APRIL and synchronous rollouts on a long-tailed response-length mixture
    (short arithmetic answers and long reversals): trained length against the data's, the learner's
    idle time and the engine's slot use.
"""

from __future__ import annotations

from pathlib import Path

from ernie5.store.checkpoint import checkpoint_dir, checkpoint_dirs
from ernie5.store.runs import read_jsonl, write_atomic
from reports.rl import HELDOUT_DIR, write_report
from train.common.run_folder import RunError
from train.rl.trainer import rl, rl_config

HELDOUT_LIMIT = 200
"""Items per task of the held-out sweep after RL (the harness's first items, as ``--limit``)."""

STUDIES: dict[str, dict] = {
    "objective": {
        "title": "RL objective: MISC and WPSM against GRPO-IcePop, GSPO-IcePop, GSPO and GRPO",
        "intro": (
            "Same queries and budget per arm; entropy collapse shows as a falling entropy curve. "
            "Rollouts come from the bf16 inference replica and the learner scores in fp32, so there is "
            "a real train/inference mismatch for IcePop and MISC to correct."
        ),
        "common": ["rollout.engine=inference", "rl.dtype=fp32"],
        "arms": {
            "misc+wpsm": ["objective.wpsm=true"],
            "misc+wpsm-no-replay": ["objective.wpsm=true", "objective.routing_replay=false"],
            "misc": ["objective.wpsm=false"],
            "grpo-icepop": ["objective.loss=grpo_icepop", "objective.wpsm=false"],
            "gspo-icepop": ["objective.loss=gspo_icepop", "objective.wpsm=false"],
            "gspo": ["objective.loss=gspo", "objective.wpsm=false"],
            "grpo": ["objective.loss=grpo", "objective.wpsm=false"],
        },
    },
    "ahrl": {
        "title": "AHRL: adaptive hints on hard queries",
        "intro": (
            "Hard = the starting model's no-hint success rate on the query below the cutoff; sparse = "
            "at most 0.1. Two-digit arithmetic (the reference solves about one in six) supplies the "
            "sparse queries and its column-work skeletons; shapes attribute questions the rest."
        ),
        "common": ["rollout.pool_size=192", "tasks={arith_d2: 1.0, shapes_vqa_attr: 1.0}"],
        "arms": {"ahrl": ["objective.ahrl=true"], "no-hints": ["objective.ahrl=false"]},
    },
    "scheduler": {
        "title": "Rollout scheduling: U-RB, APRIL and synchronous",
        "intro": (
            "Long-tailed lengths: short arithmetic answers mixed with long reversals. `sync` trains on "
            "exactly the data distribution; a trained length below it is APRIL's bias toward short, "
            "easy queries."
        ),
        "common": ["tasks={arith_d2: 3.0, reverse_l16: 1.0}", "rollout.pool_size=0", "rollout.chunk=2"],
        "arms": {
            "urb": ["rollout.scheduler=urb"],
            "april": ["rollout.scheduler=april"],
            "sync": ["rollout.scheduler=sync"],
        },
    },
}


def _finished(run_dir: Path, steps: int, needs_pass: bool) -> bool:
    """Whether an arm's run reached its last step (and, with a query pool, its ``pass_final`` record)."""
    if checkpoint_dir(run_dir, steps) not in checkpoint_dirs(run_dir):
        return False
    if not needs_pass:
        return True
    return any(r.get("event") == "pass_final" for r in read_jsonl(run_dir / "metrics.jsonl"))


def run_study(
    study: str,
    checkpoint: str,
    out: str | Path,
    verifiers_for,
    *,
    overrides: list[str] = (),
    config: str | None = None,
    seeds: int = 3,
    quiet: bool = False,
    data_dir: str | Path | None = None,
    heldout_limit: int = HELDOUT_LIMIT,
) -> Path:
    """Run (or continue) every arm of ``study`` over ``seeds`` seeds and write its section; returns
    ``OUT/report.md``. Seeds start at the configured ``rl.seed`` (0 unless overridden).

    ``verifiers_for(cfg)`` builds the verifiers of a run config's tasks (the job layer owns them);
    ``heldout_limit`` caps the held-out sweep after each run (0 = no held-out sweep).
    """
    if study not in STUDIES:
        raise RunError(f"unknown rl study {study!r} (studies: {', '.join(STUDIES)})")
    if seeds < 1:
        raise RunError(f"--seeds {seeds}: expected at least 1")
    if heldout_limit < 0:
        raise RunError(f"--heldout-limit {heldout_limit}: expected >= 0")
    spec = STUDIES[study]
    out = Path(out)
    arms: dict[str, list[Path]] = {}
    start: Path | None = None
    for arm, arm_overrides in spec["arms"].items():
        settings = [*spec.get("common", []), *overrides, *arm_overrides]
        if (out / arm / "config.yaml").is_file():
            raise RunError(f"{out / arm}: a one-seed study from before seeds; start a new --out")
        first = rl_config(checkpoint, config, settings).rl.seed
        for seed in range(first, first + seeds):
            cfg = rl_config(checkpoint, config, [*settings, f"rl.seed={seed}"])
            run_dir = out / arm / f"seed_{seed}"
            if not _finished(run_dir, cfg.rl.steps, needs_pass=cfg.rollout.pool_size > 0):
                resume = (run_dir / "config.yaml").exists()
                rl(cfg, run_dir, verifiers_for(cfg), resume=resume, quiet=quiet)
            arms.setdefault(arm, []).append(run_dir)
            tasks = _harness_tasks(cfg.tasks)
            if heldout_limit and tasks:
                suite = _heldout_suite(out, tasks)
                if start is None:
                    start = out / "start"
                    heldout_sweep(
                        cfg.rl.init_from, suite, start / HELDOUT_DIR, data_dir, heldout_limit, quiet
                    )
                last = checkpoint_dirs(run_dir)[-1]
                heldout_sweep(last, suite, run_dir / HELDOUT_DIR, data_dir, heldout_limit, quiet)
    return write_report(spec["title"], arms, out, spec.get("intro", ""), start=start)


def _harness_tasks(tasks) -> list[str]:
    import evals.tasks  # noqa: F401  (registers the tasks)
    from evals.task import TASKS

    return sorted(t for t in tasks if t in TASKS)


def _heldout_suite(out: Path, tasks: list[str]) -> Path:
    """The held-out sweep's suite (the full model only), written into the study folder."""
    path = out / "heldout_suite.yaml"
    text = (
        "name: rl_heldout\nbatch_size: 16\ntasks:\n"
        + "".join(f"  - {{task: {t}}}\n" for t in tasks)
        + "subnets: {specs: [full]}\nefficiency: {enabled: false}\n"
    )
    if not path.is_file() or path.read_text() != text:
        write_atomic(path, text)
    return path


def heldout_sweep(checkpoint, suite: Path, out: Path, data_dir, limit: int, quiet: bool) -> Path:
    """Sweep ``checkpoint``'s full model over ``suite`` into ``out`` (a finished sweep is reused unit by
    unit, as any sweep is)."""
    from evals.sweep import run_sweep

    run_sweep(checkpoint, suite, out, data_dir=data_dir, limit=limit, quiet=quiet)
    return out
