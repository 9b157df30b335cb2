"""A synthetic sweep run folder, written exactly as ``evals/results.py`` specifies.

Five subnets (``full``, ``k1``, ``d0.75``, ``w0.5``, ``d0.75-w0.5-k1``) x tasks over text, image and
audio with higher- and lower-is-better metrics (``acc``/``acc_norm``, ``exact_match``,
``bits_per_byte`` as a corpus metric, ``wer``), one skipped task (video), one failed unit, an
efficiency table and routing records for two subnets. Each example draws one uniform number that is
shared by every subnet (common random numbers), so subnets and reruns pair like real runs do.

Optionally (``baseline=True``) the run also has the random baseline (``manifest["baseline"] ==
"random"``, units under ``units/random/``, no efficiency row or routing record), scoring every task at
:data:`RANDOM_STRENGTH`; ``chance`` names modalities whose tasks every subnet, the full model included,
answers at (about) the random model's level.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ernie5.store.runs import write_json
from evals import metrics
from evals.results import write_tables, write_unit

SUBNETS = {  # name: (layers, experts, top_k)
    "full": (16, 64, 4),
    "k1": (16, 64, 1),
    "d0.75": (12, 64, 4),
    "w0.5": (16, 32, 4),
    "d0.75-w0.5-k1": (12, 32, 1),
}
STRENGTH = {  # retention of the full model's quality per subnet and modality
    "full": {"text": 1.0, "image": 1.0, "audio": 1.0},
    "k1": {"text": 0.99, "image": 0.93, "audio": 0.97},
    "d0.75": {"text": 0.95, "image": 0.85, "audio": 0.9},
    "w0.5": {"text": 0.97, "image": 0.96, "audio": 0.92},
    "d0.75-w0.5-k1": {"text": 0.9, "image": 0.7, "audio": 0.8},
}
TASKS = {  # name: (modality, capability, metrics -> higher_is_better, full-model level)
    "arith": ("text", "understanding", {"exact_match": True}, 0.6),
    "hellaswag_mini": ("text", "understanding", {"acc": True, "acc_norm": True}, 0.7),
    "shakespeare": ("text", "generation", {"bits_per_byte": False}, 2.0),
    "image_qa": ("image", "understanding", {"acc": True}, 0.65),
    "image_gen": ("image", "generation", {"bits_per_byte": False}, 4.0),
    "asr": ("audio", "understanding", {"wer": False}, 0.3),
}
SKIPPED = ("video_qa", "video", "understanding", "data missing: video/qa.jsonl not under the data root")
FAILED = ("d0.75-w0.5-k1", "asr", "RuntimeError: CUDA out of memory")
N_EXAMPLES = 120
RANDOM = "random"
RANDOM_STRENGTH = 0.35
"""The random model's quality factor (accuracy 0.35 x level, error / bits per byte level / 0.35)."""
HOSTILE_TASK = "<script>alert(1)"
HOSTILE_PREDICTION = '</script><script>alert("pwned")</script><img src=x onerror=alert(2)>'


def _strength(subnet: str, modality: str, chance: tuple[str, ...]) -> float:
    if subnet == RANDOM:
        return RANDOM_STRENGTH
    if modality in chance:  # within ~1% of random: not significantly above it
        return RANDOM_STRENGTH * (1 + 0.01 * STRENGTH[subnet][modality])
    return STRENGTH[subnet][modality]


def _example_scores(
    spec: tuple, subnet: str, u: np.ndarray, extra: np.ndarray, shift: float, chance: tuple[str, ...] = ()
) -> list[dict]:
    modality, _, task_metrics, level = spec
    s = _strength(subnet, modality, chance) * shift
    out = []
    for i in range(len(u)):
        rec = {}
        for m in task_metrics:
            if m in ("acc", "acc_norm", "exact_match"):
                rec[m] = float(u[i] < level * s * (0.97 if m == "acc_norm" else 1.0))
            elif m == "wer":
                rec[m] = float(max(0.0, level / s * (0.5 + u[i])))
            else:  # bits_per_byte: [nll_nats, n_bytes]
                n_bytes = int(100 + 200 * extra[i])
                rec[m] = [float(n_bytes * math.log(2) * level / s * (0.8 + 0.4 * u[i])), n_bytes]
        out.append(rec)
    return out


def _aggregate(values: list, metric: str) -> tuple[float, float]:
    if metric == "bits_per_byte":
        items = [tuple(v) for v in values]
        return metrics.corpus_bits_per_byte(items), metrics.bootstrap_stderr(
            metrics.corpus_bits_per_byte, items, 0, 200
        )
    return metrics.mean_stderr(values)


def write_run(
    root: Path,
    name: str = "run",
    *,
    seed: int = 0,
    shift: dict[tuple[str, str], float] | None = None,
    hostile: bool = False,
    efficiency: bool = True,
    routing: bool = True,
    baseline: bool = False,
    baseline_rows: bool = True,
    baseline_skip: tuple[str, ...] = (),
    chance: tuple[str, ...] = (),
) -> Path:
    """Write a synthetic run folder and return it.

    Args:
        root: parent folder.
        name: the run folder's name.
        seed: seeds the per-example uniforms; a different seed is a pure-noise rerun.
        shift: ``{(subnet, task): factor}`` multiplying a cell's quality (< 1 plants a regression).
        hostile: add a task named ``<script>...`` and a script-laden prediction.
        efficiency: write efficiency.csv/json.
        routing: write routing/full.json and routing/k1.json.
        baseline: the manifest names the random baseline (``"baseline": "random"``) and, with
            ``baseline_rows``, its units are written.
        baseline_skip: tasks the random baseline skipped.
        chance: modalities every subnet answers at about the random model's level.
    """
    run = root / name
    subnets = list(SUBNETS) + ([RANDOM] if baseline and baseline_rows else [])
    extra_manifest = {"baseline": RANDOM} if baseline else {}
    tasks = dict(TASKS)
    if hostile:
        tasks[HOSTILE_TASK] = ("text", "understanding", {"exact_match": True}, 0.5)
    write_json(
        run / "manifest.json",
        {
            "suite": "nightly",
            "suite_hash": "abc123",
            "suite_yaml": "name: nightly\n",
            "checkpoint": "runs/x/ckpt",
            "checkpoint_hash": "ff00",
            "model_config": {"n_layers": 16, "moe": {"n_experts": 64, "top_k": 4}},
            "subnets": [
                {"name": s, "layers": d, "experts_per_layer": w, "top_k": k}
                for s, (d, w, k) in SUBNETS.items()
            ],
            "tasks": [
                {"name": t, "version": 1, "modality": m, "capability": c, "data_hash": ""}
                for t, (m, c, _, _) in tasks.items()
            ],
            "data_dir": "/data",
            "seeds": [seed],
            "git_hash": "deadbeef",
            "versions": {"python": "3.11"},
            "machine": {"cpu": "test"},
            "argv": ["ernie5", "nightly"],
            "started": "2026-12-01T00:00:00",
            "finished": "2026-12-01T01:00:00",
            **extra_manifest,
        },
    )
    for t_index, (task, (modality, capability, task_metrics, _)) in enumerate(tasks.items()):
        rng = np.random.default_rng([seed, t_index])
        u, extra = rng.random(N_EXAMPLES), np.random.default_rng(t_index).random(N_EXAMPLES)
        for subnet in subnets:
            record = {
                "fingerprint": f"{subnet}:{task}",
                "subnet": subnet,
                "task": task,
                "task_version": 1,
                "modality": modality,
                "capability": capability,
                "status": "ok",
                "reason": "",
                "metrics": {},
                "n_examples": N_EXAMPLES,
                "limit": N_EXAMPLES,
                "seed": seed,
                "kwargs": {},
                "wall_s": 1.5,
                "model_s": 1.0,
            }
            if (subnet, task) == FAILED[:2]:
                write_unit(run, {**record, "status": "error", "reason": FAILED[2], "n_examples": 0}, [])
                continue
            if subnet == RANDOM and task in baseline_skip:
                write_unit(run, {**record, "status": "skipped", "reason": "skipped", "n_examples": 0}, [])
                continue
            factor = (shift or {}).get((subnet, task), 1.0)
            per = _example_scores(tasks[task], subnet, u, extra, factor, chance)
            samples = []
            for i, scores in enumerate(per):
                prediction = HOSTILE_PREDICTION if hostile and i == 0 else f"answer {i}"
                samples.append(
                    {
                        "id": f"{task}-{i}",
                        "scores": scores,
                        "sample": {
                            "id": f"{task}-{i}",
                            "prompt": f"Question {i} of {task}?",
                            "target": f"answer {i}",
                            "prediction": prediction,
                            "scores": scores,
                        },
                    }
                )
            for m, hib in task_metrics.items():
                value, stderr = _aggregate([s[m] for s in per], m)
                record["metrics"][m] = {
                    "value": value,
                    "stderr": stderr,
                    "n": N_EXAMPLES,
                    "higher_is_better": hib,
                }
            write_unit(run, record, samples)
    for subnet in subnets:
        task, modality, capability, reason = SKIPPED
        write_unit(
            run,
            {
                "fingerprint": "s",
                "subnet": subnet,
                "task": task,
                "task_version": 1,
                "modality": modality,
                "capability": capability,
                "status": "skipped",
                "reason": reason,
                "metrics": {},
                "n_examples": 0,
                "limit": None,
                "seed": seed,
                "kwargs": {},
                "wall_s": 0.0,
                "model_s": 0.0,
            },
            [],
        )
    rows = []
    for subnet, (layers, experts, k) in SUBNETS.items():
        total = 50e6 + layers * (2e6 + experts * 0.5e6)
        active = 50e6 + layers * (2e6 + k * 0.5e6)
        rows.append(
            {
                "subnet": subnet,
                "depth": layers,
                "width": experts,
                "top_k": k,
                "total_params": total,
                "active_params": active,
                "active_params_measured": active,
                "flops_per_token": 2 * active,
                "prefill_ms": active / 1e6,
                "decode_tokens_per_s": 4e9 / active,
                "peak_memory_mb": total / 1e6,
                "extracted_bytes": 2 * total,
            }
        )
    write_tables(run, efficiency=rows if efficiency else None)
    if routing:
        for subnet in ("full", "k1"):
            write_json(run / "routing" / f"{subnet}.json", _routing(subnet))
    return run


def _routing(subnet: str) -> dict:
    n, layers = 16, [0, 1, 2, 3]
    centre = {"text": 3.0, "image": 8.0, "audio": 12.0}
    tasks = {}
    for task, (modality, _, _, _) in TASKS.items():
        if modality not in centre:
            continue
        counts = {}
        for layer in layers:
            width = 1.5 + (2.5 if modality == "text" else 0.6) * (layer + 1) / len(layers)
            c = centre[modality] + (0.5 if "gen" in task else 0.0) + (layer if modality == "image" else 0)
            load = np.exp(-0.5 * ((np.arange(n) - c) / width) ** 2) * (1000 if subnet == "full" else 800)
            counts[str(layer)] = [int(x) for x in np.round(load)]
        tasks[task] = {"modality": modality, "counts": counts}
    return {"n_experts": n, "layers": layers, "tasks": tasks}


@pytest.fixture
def make_run(tmp_path):
    """Factory: ``make_run(name, **options)`` writes a synthetic run under ``tmp_path`` (see write_run)."""

    def make(name: str = "run", **options) -> Path:
        return write_run(tmp_path, name, **options)

    return make


@pytest.fixture
def run_dir(make_run) -> Path:
    """A synthetic, contract-conforming sweep run folder."""
    return make_run("nightly-base")


@pytest.fixture(scope="session")
def built_report(tmp_path_factory) -> Path:
    """The report folder of a synthetic run, built once per session (read-only for tests)."""
    from reports import build_report

    return build_report(write_run(tmp_path_factory.mktemp("built"), "nightly-base"))


@pytest.fixture(scope="session")
def hostile_report(tmp_path_factory) -> Path:
    """The report folder of a run whose task name and a prediction carry ``<script>`` (built once)."""
    from reports import build_report

    return build_report(write_run(tmp_path_factory.mktemp("hostile"), "nightly-hostile", hostile=True))


@pytest.fixture(scope="session")
def base_run(tmp_path_factory) -> Path:
    """A synthetic run written once per session; tests must not modify it."""
    return write_run(tmp_path_factory.mktemp("shared"), "base")
