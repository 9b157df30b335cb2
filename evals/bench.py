"""``ernie5 bench harness``: items per second of each multiple-choice task family, with the choices'
context shared (:mod:`evals.shared_context`) and with every request scored on its own (the adapter
before sharing), timed in alternating rounds in one process so that the ratio compares runs taken
moments apart.

Families (one task each; a task whose data the data root lacks is listed under ``skipped``):
  * ``image_10way_1tok``: ``digit_vqa_strokes`` (10 one-token digit choices after an image);
  * ``image_6way_1tok``: ``shapes_vqa_attr``;
  * ``clip_3way_1tok``: ``video_shapes``;
  * ``image_10way_1tok_mnist``: ``digit_vqa`` (MNIST; data root);
  * ``audio_10way``: ``spoken_digit_qa`` (FSDD; data root);
  * ``text_4way_multitok``: ``arc_easy`` and ``openbookqa`` (ARC-style answers of several tokens; data root).

Each figure is the median over ``repeats`` timed calls of the adapter on the same ``items`` items
(one call holds all their requests, as a sweep unit's call does), after one untimed call. The largest
difference between the two scorings' log-likelihoods is printed beside the speed-up (the parity
tests bound it). Defaults: the shipped reference (the model the nightly runs) at the sweep's batch
size.
"""

from __future__ import annotations

import time
from pathlib import Path

import evals.tasks  # noqa: F401  (registers the tasks)
from ernie5.bench.timing import alternating_medians, environment
from ernie5.store.checkpoint import load_checkpoint, resolve_checkpoint
from evals.adapter import Ernie5EvalModel
from evals.api import LoglikelihoodRequest
from evals.task import TASKS

FAMILIES: dict[str, tuple[str, ...]] = {
    "image_10way_1tok": ("digit_vqa_strokes",),
    "image_6way_1tok": ("shapes_vqa_attr",),
    "clip_3way_1tok": ("video_shapes",),
    "image_10way_1tok_mnist": ("digit_vqa",),
    "audio_10way": ("spoken_digit_qa",),
    "text_4way_multitok": ("arc_easy", "openbookqa"),
}


def _requests(task: str, data_dir, items: int) -> tuple[int, list[LoglikelihoodRequest]]:
    """How many items the task gives (up to ``items``) and all their requests."""
    t = TASKS.get(task)()
    examples = t.examples(data_dir, limit=items, seed=0)
    return len(examples), [r for ex in examples for r in t.requests(ex)]


def bench_harness(
    checkpoint: str = "reference",
    *,
    data_dir: str | Path | None = None,
    items: int = 40,
    repeats: int = 3,
    batch_size: int = 16,
) -> dict:
    """Items/s per family, shared and unshared, their ratio and the largest log-likelihood gap."""
    path = resolve_checkpoint(checkpoint)
    ckpt = load_checkpoint(path)
    shared = Ernie5EvalModel(ckpt, batch_size=batch_size, routing=False)
    each = Ernie5EvalModel(
        ckpt, batch_size=batch_size, routing=False, ckpt_hash=shared.ckpt_hash, share_context=False
    )
    families, skipped = {}, {}
    for family, tasks in FAMILIES.items():
        for task in tasks:
            name = task if len(tasks) == 1 else f"{family}:{task}"
            try:
                n_items, reqs = _requests(task, data_dir, items)
            except Exception as e:  # noqa: BLE001  (a missing data root is a skip, named)
                skipped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                continue
            t0 = time.perf_counter()
            a = shared.loglikelihood(reqs).results
            b = each.loglikelihood(reqs).results
            first_s = time.perf_counter() - t0
            gap = max(abs(x.logprob - y.logprob) for x, y in zip(a, b, strict=True))
            med = alternating_medians(
                {
                    "shared": lambda r=reqs: shared.loglikelihood(r),
                    "each": lambda r=reqs: each.loglikelihood(r),
                },
                repeats=repeats,
                warmup=0,
            )
            families[name] = {
                "task": task,
                "items": n_items,
                "requests": len(reqs),
                "choices_per_item": round(len(reqs) / max(1, n_items), 2),
                "items_per_s_each": round(n_items / med["each"], 2),
                "items_per_s_shared": round(n_items / med["shared"], 2),
                "speedup": round(med["each"] / med["shared"], 2),
                "max_abs_logprob_gap": float(f"{gap:.3g}"),
                "first_call_s": round(first_s, 2),
            }
    return {
        "bench": "harness",
        "checkpoint": str(checkpoint),
        "batch_size": batch_size,
        "repeats": repeats,
        "families": families,
        "skipped": skipped,
        "env": environment("cpu"),
    }
