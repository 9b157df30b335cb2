"""``ernie5 sweep --device cuda``'s code path, checked on the CPU: the shipped reference on the stand-in
device (``tests/stand_in_device.py``: real values, ``.device`` not the CPU) scores text, image, clip and
audio tasks of every request kind (log-likelihoods with shared contexts and KV-cache continuations,
generation, speech recognition), a sub-model and the random twin, without mixing a CPU tensor into its
device tensors, and gives the CPU sweep's tables."""

from __future__ import annotations

import pandas as pd
import torch

import evals.sweep as sweep
from tests.stand_in_device import stand_in_device

SUITE = """
name: placed
batch_size: 8
tasks:
  - {task: arith_d1, limit: 3}
  - {task: sort_l4, limit: 2}
  - {task: shapes_vqa_attr, limit: 3}
  - {task: video_shapes, limit: 2}
  - {task: asr_dtmf, limit: 1}
subnets: {specs: [full, d0.5-k1], random_baseline: true}
efficiency: {enabled: false}
routing: true
"""


def test_a_sweep_on_the_device_path_mixes_nothing_and_equals_the_cpu_sweep(tmp_path, monkeypatch):
    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE)
    cpu = tmp_path / "cpu"
    assert sweep.run_sweep("reference", suite, cpu, quiet=True, device="cpu").errors == 0
    loaded = sweep.load_checkpoint("reference")  # outside the stand-in (it slows every operation)
    monkeypatch.setattr(sweep, "load_checkpoint", lambda path: loaded)
    monkeypatch.setattr(sweep, "check_device", lambda name: None)
    monkeypatch.setattr(sweep, "pick_device", lambda name: torch.device("meta"))  # the stand-in GPU
    dev = tmp_path / "dev"
    with stand_in_device() as mixed:
        summary = sweep.run_sweep("reference", suite, dev, quiet=True, device="cuda")
    assert summary.errors == 0, summary.failed
    assert mixed == []
    want, got = (pd.read_csv(d / "results.csv") for d in (cpu, dev))
    # The device path runs eager kernels where the CPU runs its fused ones: scores within an item.
    pd.testing.assert_frame_equal(
        want.drop(columns=["value", "stderr"]), got.drop(columns=["value", "stderr"])
    )
    assert ((want["value"] - got["value"]).abs() <= 1.0 / want["n"] + 1e-9).all()
