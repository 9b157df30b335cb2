"""The sweep on a GPU against the same sweep on the CPU (skipped without one; ``launch/gpu_check.sh``
runs it): the shipped reference over text, image, clip and audio tasks of every request kind, the
full model and a sub-model, with efficiency measured on the GPU.

Tolerance: the GPU's kernels and reduction orders differ from the CPU's, so an accuracy may move by
an item whose top two choices are within rounding of each other (two items per unit allowed here: a
WER moves by up to the words of the utterances that flip), and any score by 1e-3 relative."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from evals.sweep import run_sweep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SUITE = """
name: gpu_parity
batch_size: 16
tasks:
  - {task: arith_d1, limit: 24}
  - {task: reverse_l8, limit: 16}
  - {task: shapes_vqa_attr, limit: 24}
  - {task: video_shapes, limit: 16}
  - {task: asr_dtmf, limit: 12}
subnets: {specs: [full, d0.5-k1]}
efficiency: {enabled: true, prompt_len: 16, decode_tokens: 8, repeats: 1}
routing: true
"""
DEVICES = ("cpu", "cuda")


def test_a_gpu_sweep_equals_the_cpu_sweep(tmp_path):
    suite = tmp_path / "suite.yaml"
    suite.write_text(SUITE)
    tables = {}
    for device in DEVICES:
        out = tmp_path / device
        summary = run_sweep("reference", suite, out, quiet=True, device=device)
        assert summary.errors == 0, summary.failed
        tables[device] = pd.read_csv(out / "results.csv").set_index(["subnet", "task", "metric"])
    cpu, gpu = (tables[d] for d in DEVICES)
    assert list(cpu.index) == list(gpu.index)
    for key, row in cpu.iterrows():
        got = gpu.loc[key, "value"]
        assert abs(got - row["value"]) <= max(2.0 / row["n"] + 1e-9, 1e-3 * abs(row["value"])), key
    manifest = json.loads((tmp_path / DEVICES[1] / "manifest.json").read_text())
    assert manifest["device"].startswith("cuda")
    eff = pd.read_csv(tmp_path / DEVICES[1] / "efficiency.csv")
    assert (eff["decode_tokens_per_s"].dropna() > 0).all()
