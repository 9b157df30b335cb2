"""Group scores, the seesaw index and the degradation order on hand-made tables."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from reports.seesaw import Z95, degradation_order, group_scores, seesaw_index


def _rel(rows):
    return pd.DataFrame(rows, columns=["subnet", "task", "modality", "capability", "rel", "rel_se"])


def test_group_scores_mean_and_propagated_interval():
    rel = _rel(
        [
            ("k1", "a", "text", "understanding", 0.9, 0.03),
            ("k1", "b", "text", "generation", 0.8, 0.04),
            ("k1", "c", "image", "understanding", 0.7, 0.05),
            ("k1", "d", "image", "understanding", math.nan, math.nan),  # undefined: left out
        ]
    )
    g = group_scores(rel, "modality").set_index("group")
    assert g.loc["text", "rel"] == pytest.approx(0.85)
    assert g.loc["text", "ci_high"] - g.loc["text", "rel"] == pytest.approx(
        Z95 * 0.05 / 2
    )  # sqrt(.03²+.04²)=.05
    assert g.loc["image", "n_tasks"] == 1
    cap = group_scores(rel, "capability").set_index("group")
    assert cap.loc["understanding", "rel"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    "scores, index, best, worst",
    [
        ({"text": 0.95, "image": 0.75, "audio": 0.85}, 0.20, "text", "image"),
        ({"text": 0.9, "image": 0.9}, 0.0, "text", "image"),  # equal: ties broken by name
        ({"text": 0.9}, math.nan, "", ""),  # one modality: no seesaw
    ],
)
def test_seesaw_index(scores, index, best, worst):
    groups = pd.DataFrame({"subnet": "s", "group": list(scores), "rel": list(scores.values())})
    row = seesaw_index(groups).iloc[0]
    assert (math.isnan(index) and math.isnan(row["seesaw_index"])) or row["seesaw_index"] == pytest.approx(
        index
    )
    assert (row["best"], row["worst"]) == (best, worst)


GROUPS = pd.DataFrame(
    [
        # subnet, modality, retention
        ("full", "text", 1.0),
        ("full", "image", 1.0),
        ("full", "audio", 1.0),
        ("big", "text", 0.99),
        ("big", "image", 0.93),  # image crosses 95% first, at the largest reduced subnet
        ("big", "audio", 0.97),
        ("mid", "text", 0.97),
        ("mid", "image", 0.90),
        ("mid", "audio", 0.94),  # audio crosses next
        ("small", "text", 0.96),  # text never crosses
        ("small", "image", 0.80),
        ("small", "audio", 0.90),
    ],
    columns=["subnet", "group", "rel"],
)
ACTIVE = {"full": 100.0, "big": 80.0, "mid": 60.0, "small": 40.0}


@pytest.mark.parametrize(
    "active, threshold, order, crosses",
    [
        (ACTIVE, 0.95, ["image", "audio", "text"], ["big", "mid", ""]),
        (ACTIVE, 0.92, ["image", "audio", "text"], ["mid", "small", ""]),
        (ACTIVE, 0.995, ["image", "audio", "text"], ["big", "big", "big"]),  # same subnet: lower score first
        (None, 0.95, ["image", "audio", "text"], ["big", "mid", ""]),  # ordered by mean score instead
    ],
)
def test_degradation_order(active, threshold, order, crosses):
    table = degradation_order(GROUPS, active, threshold)
    assert table["modality"].tolist() == order
    assert table["crosses_at"].tolist() == crosses
    assert table["rank"].tolist() == [1, 2, 3]
    assert set(table["smallest"]) == {"small"}


def test_degradation_order_follows_active_params_not_names():
    # The subnet that loses image is the *larger* one by active params, although listed last.
    groups = pd.DataFrame(
        [("tiny", "text", 0.9), ("tiny", "image", 0.96), ("large", "text", 0.99), ("large", "image", 0.9)],
        columns=["subnet", "group", "rel"],
    )
    table = degradation_order(groups, {"tiny": 10.0, "large": 90.0})
    assert table["modality"].tolist() == ["image", "text"]
    assert table.iloc[0]["crosses_at_active_params"] == 90.0
