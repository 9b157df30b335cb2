"""The cross-source digit tasks: digit_vqa's items, from sources the model never trains on."""

from __future__ import annotations

import numpy as np
import pytest

import evals.tasks  # noqa: F401  (registers every task)
from ernie5.data import digit_sources
from evals.task import TASKS


def test_strokes_task_asks_digit_vqa_question(data_root) -> None:
    strokes, mnist = TASKS.get("digit_vqa_strokes")(), TASKS.get("digit_vqa")()
    assert strokes.available(None)[0]  # procedural: no data root needed
    items, ref = strokes.examples(None, limit=20), mnist.examples(data_root, limit=1)
    assert len(items) == 20 and all(e.id.startswith("strokes-") for e in items)
    every = strokes.examples(None)  # n_examples=200, classes in turn
    assert [e.target for e in every].count("7") == 20 and {e.target for e in every} == set(ref[0].choices)
    assert items[0].prompt == ref[0].prompt and items[0].choices == ref[0].choices
    assert items[0].media.shape == ref[0].media.shape and items[0].media.dtype == ref[0].media.dtype
    again = strokes.examples(None, limit=20)
    assert all(np.array_equal(a.media, b.media) for a, b in zip(items, again))


def test_strokes_task_draws_from_its_own_seed() -> None:
    items = TASKS.get("digit_vqa_strokes")().examples(None, limit=10)
    train_like, _ = digit_sources.stroke_digits(10, seed=0)
    assert not any(np.array_equal(e.media[2:30, 2:30], t) for e, t in zip(items, train_like))


@pytest.mark.parametrize(
    "name, file", [("digit_vqa_usps", "usps/zip.test.gz"), ("digit_vqa_semeion", "semeion/semeion.data")]
)
def test_data_root_tasks_skip_with_how_to_get(tmp_path, name: str, file: str) -> None:
    ok, why = TASKS.get(name)().available(tmp_path)
    assert not ok and file in why


def test_usps_task_reads_the_data_root(tmp_path) -> None:
    import gzip

    (tmp_path / "usps").mkdir()
    pix = -np.ones((16, 16))
    pix[3:13, 7:9] = 1.0
    with gzip.open(tmp_path / "usps" / "zip.test.gz", "wt") as f:
        f.write(" ".join(["1", *map(str, pix.ravel())]) + "\n")
    task = TASKS.get("digit_vqa_usps")()
    assert task.available(tmp_path)[0]
    (item,) = task.examples(tmp_path)
    assert item.target == "1" and item.id == "usps-test-0" and item.media.shape == (32, 32, 3)
