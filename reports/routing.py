"""Routing analyses of the paper's figures 8-10 on a run's recorded expert loads.

Input: one ``routing/<subnet>.json`` record, ``{"n_experts", "layers", "tasks": {task: {"modality",
"counts": {layer: [tokens routed to each expert]}}}}``. A group is a task or a modality (the counts
of its tasks summed).

* **Activation frequency** ``p_i``: the share of a group's routed tokens (per layer) sent to expert i.
* **Normalised routing entropy** ``NE = -sum_i p_i log p_i / log N`` with N the number of routed
  experts: 1 for perfectly even use of all experts, 0 when one expert takes every token.
* **IoU of the top-25% experts** of two groups in a layer: the ``ceil(N / 4)`` most activated experts
  of each (ties to the lower index), intersection over union. 1: the groups use the same experts;
  0: disjoint experts (modality-specialised routing).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

TOP_FRACTION = 0.25


def normalized_entropy(counts: list[float] | np.ndarray, n_experts: int | None = None) -> float:
    """``-sum p log p / log N`` of a count vector; NaN for no tokens, 1.0 when N is 1."""
    c = np.asarray(counts, dtype=np.float64)
    n = n_experts if n_experts is not None else len(c)
    total = c.sum()
    if total <= 0:
        return math.nan
    if n <= 1:
        return 1.0
    p = c[c > 0] / total
    return float(-(p * np.log(p)).sum() / math.log(n))


def top_experts(counts: list[float] | np.ndarray, fraction: float = TOP_FRACTION) -> frozenset[int]:
    """Indices of the ``ceil(fraction * N)`` most activated experts (ties: lower index); empty if none ran."""
    c = np.asarray(counts, dtype=np.float64)
    if c.sum() <= 0:
        return frozenset()
    k = max(1, math.ceil(fraction * len(c)))
    order = sorted(range(len(c)), key=lambda i: (-c[i], i))
    return frozenset(order[:k])


def iou(a: frozenset[int] | set[int], b: frozenset[int] | set[int]) -> float:
    """Intersection over union of two sets; NaN if both are empty."""
    union = len(a | b)
    return len(a & b) / union if union else math.nan


def group_counts(record: dict[str, Any], by: str = "modality") -> dict[str, dict[int, np.ndarray]]:
    """``{group: {layer: counts per expert}}`` with groups by ``"task"`` or ``"modality"`` (summed)."""
    n = int(record["n_experts"])
    out: dict[str, dict[int, np.ndarray]] = {}
    for task, rec in record["tasks"].items():
        group = task if by == "task" else str(rec.get("modality", "unknown"))
        layers = out.setdefault(group, {})
        for layer, counts in rec.get("counts", {}).items():
            c = np.zeros(n, dtype=np.float64)
            values = np.asarray(counts, dtype=np.float64)[:n]
            c[: len(values)] = values
            layers[int(layer)] = layers.get(int(layer), np.zeros(n)) + c
    return out


def layers_of(record: dict[str, Any]) -> list[int]:
    """The MoE layers with counts, ascending."""
    found = {int(layer) for rec in record["tasks"].values() for layer in rec.get("counts", {})}
    return sorted(found)


def key_layers(layers: list[int]) -> list[int]:
    """First, middle and last layer (deduplicated), as in the paper's figures."""
    if not layers:
        return []
    return list(dict.fromkeys([layers[0], layers[len(layers) // 2], layers[-1]]))


def frequency_table(record: dict[str, Any], by: str = "modality") -> pd.DataFrame:
    """Long table ``group, layer, expert, frequency`` (each group-layer sums to 1)."""
    rows = []
    for group, layers in group_counts(record, by).items():
        for layer, c in sorted(layers.items()):
            total = c.sum()
            for expert, v in enumerate(c):
                rows.append(
                    {
                        "group": group,
                        "layer": layer,
                        "expert": expert,
                        "frequency": v / total if total else math.nan,
                    }
                )
    return pd.DataFrame(rows, columns=["group", "layer", "expert", "frequency"])


def entropy_table(record: dict[str, Any], by: str = "modality") -> pd.DataFrame:
    """Long table ``group, layer, entropy`` of normalised routing entropy."""
    n = int(record["n_experts"])
    rows = [
        {"group": group, "layer": layer, "entropy": normalized_entropy(c, n)}
        for group, layers in group_counts(record, by).items()
        for layer, c in sorted(layers.items())
    ]
    return pd.DataFrame(rows, columns=["group", "layer", "entropy"])


def iou_table(record: dict[str, Any], by: str = "modality", fraction: float = TOP_FRACTION) -> pd.DataFrame:
    """Long table ``layer, a, b, iou`` of top-expert IoU for every ordered pair of groups per layer."""
    counts = group_counts(record, by)
    groups = list(counts)
    rows = []
    for layer in layers_of(record):
        tops = {g: top_experts(counts[g][layer], fraction) for g in groups if layer in counts[g]}
        for a in tops:
            for b in tops:
                rows.append({"layer": layer, "a": a, "b": b, "iou": iou(tops[a], tops[b])})
    return pd.DataFrame(rows, columns=["layer", "a", "b", "iou"])
