"""``ernie5 bench parity``: how far a device's forward and greedy decoding are from the CPU's.

The nano model (random init, fp32, fast paths applied) scores one ``2 x 128`` batch on the CPU and on
``device`` from the same weights; the figures are the relative L2 difference of the logits
(``||gpu - cpu|| / ||cpu||``, the goal of issue 42: <= 1e-4 in fp32), the largest absolute
difference, whether every position's top token agrees, and whether 32 greedy tokens after a prompt
are the same tokens on both. Nothing here is a test: the tests (``tests/model/test_cuda.py``) assert
tolerances; this prints the measured numbers for the GPU check's ``summary.json``.
"""

from __future__ import annotations

import copy

import torch

from ernie5.bench import preset_model
from ernie5.bench.timing import environment
from ernie5.fast import apply_fast_paths
from ernie5.generation.text import generate
from ernie5.model.model import Ernie5Model


@torch.inference_mode()
def bench_parity(
    device: torch.device | str = "cpu", batch: int = 2, seq_len: int = 128, new: int = 32
) -> dict:
    """The CPU-vs-``device`` figures above (``device="cpu"`` compares the CPU with itself: all zero)."""
    device = torch.device(device)
    cfg = preset_model("nano")
    torch.manual_seed(0)
    cpu = apply_fast_paths(Ernie5Model(cfg).eval())
    other = apply_fast_paths(copy.deepcopy(cpu).to(device))
    ids = torch.randint(16, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    ref_BTV = cpu(ids).logits_BTV.float()
    got_BTV = other(ids.to(device)).logits_BTV.float().cpu()
    diff = got_BTV - ref_BTV
    prompt = ids[0, :16].tolist()
    tokens_cpu = generate(cpu, [prompt], new)[0]
    tokens_dev = generate(other, [prompt], new)[0]
    return {
        "shape": "nano",
        "dtype": "fp32",
        "batch": batch,
        "seq_len": seq_len,
        "forward_rel_l2": float(diff.norm() / ref_BTV.norm()),
        "forward_max_abs": float(diff.abs().max()),
        "top1_agreement": float((got_BTV.argmax(-1) == ref_BTV.argmax(-1)).float().mean()),
        "greedy_tokens_equal": tokens_cpu == tokens_dev,
        "greedy_tokens": new,
        "target": "forward_rel_l2 <= 1e-4",
        "env": environment(device),
    }
