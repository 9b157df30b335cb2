"""Routing analyses (activation frequency, top-25% IoU, normalised entropy) on hand-made counts."""

from __future__ import annotations

import math

import pytest

from reports.routing import (
    entropy_table,
    frequency_table,
    iou,
    iou_table,
    key_layers,
    normalized_entropy,
    top_experts,
)


@pytest.mark.parametrize(
    "counts, n, expected",
    [
        ([5, 5, 5, 5], None, 1.0),  # even use of every expert
        ([20, 0, 0, 0], None, 0.0),  # one expert takes all
        ([10, 10, 0, 0], None, 0.5),  # log 2 / log 4
        ([10, 10], 4, 0.5),  # N is the number of routed experts, not of those seen
        ([0, 0, 0], None, math.nan),  # no tokens
        ([7], None, 1.0),
    ],
)
def test_normalized_entropy(counts, n, expected):
    got = normalized_entropy(counts, n)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


@pytest.mark.parametrize(
    "counts, expected",
    [
        ([9, 1, 8, 2, 7, 3, 6, 4], {0, 2}),  # ceil(8 / 4) = 2 experts
        ([1, 1, 1, 1, 1, 1, 1, 1], {0, 1}),  # ties: lower index
        ([0, 3, 0, 0, 0], {1, 0}),  # ceil(5 / 4) = 2
        ([0, 0, 0, 0], set()),
    ],
)
def test_top_experts(counts, expected):
    assert top_experts(counts) == frozenset(expected)


@pytest.mark.parametrize(
    "a, b, expected",
    [({1, 2}, {1, 2}, 1.0), ({1, 2}, {3, 4}, 0.0), ({1, 2}, {2, 3}, 1 / 3), (set(), set(), math.nan)],
)
def test_iou(a, b, expected):
    got = iou(frozenset(a), frozenset(b))
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


RECORD = {
    "n_experts": 8,
    "layers": [0, 1],
    "tasks": {
        "t1": {
            "modality": "text",
            "counts": {"0": [10, 10, 0, 0, 0, 0, 0, 0], "1": [1, 1, 1, 1, 1, 1, 1, 1]},
        },
        "t2": {
            "modality": "text",
            "counts": {"0": [0, 0, 10, 10, 0, 0, 0, 0], "1": [1, 1, 1, 1, 1, 1, 1, 1]},
        },
        "i1": {"modality": "image", "counts": {"0": [0, 0, 0, 0, 5, 5, 0, 0], "1": [4, 4, 0, 0, 0, 0, 0, 0]}},
    },
}


def test_frequency_sums_to_one_per_group_and_layer():
    freq = frequency_table(RECORD, "modality")
    sums = freq.groupby(["group", "layer"])["frequency"].sum()
    assert sums.to_numpy() == pytest.approx(1.0)
    text0 = freq[(freq["group"] == "text") & (freq["layer"] == 0)]["frequency"].tolist()
    assert text0 == pytest.approx([0.25, 0.25, 0.25, 0.25, 0, 0, 0, 0])  # t1 + t2 summed


def test_entropy_per_modality_and_layer():
    ent = entropy_table(RECORD, "modality").set_index(["group", "layer"])["entropy"]
    assert ent[("text", 0)] == pytest.approx(math.log(4) / math.log(8))
    assert ent[("text", 1)] == pytest.approx(1.0)
    assert ent[("image", 1)] == pytest.approx(math.log(2) / math.log(8))


def test_iou_between_tasks_and_modalities():
    by_task = iou_table(RECORD, "task").set_index(["layer", "a", "b"])["iou"]
    assert by_task[(0, "t1", "t2")] == 0.0  # disjoint experts
    assert by_task[(1, "t1", "t2")] == 1.0
    assert by_task[(1, "t1", "i1")] == 1.0  # uniform t1 ties to experts {0, 1}, the image's top two
    by_mod = iou_table(RECORD, "modality").set_index(["layer", "a", "b"])["iou"]
    assert by_mod[(0, "text", "image")] == 0.0
    assert by_mod[(0, "text", "text")] == 1.0


@pytest.mark.parametrize(
    "layers, expected",
    [([], []), ([3], [3]), ([0, 1], [0, 1]), ([0, 1, 2, 3, 4], [0, 2, 4]), ([2, 5, 9, 11], [2, 9, 11])],
)
def test_key_layers(layers, expected):
    assert key_layers(layers) == expected
