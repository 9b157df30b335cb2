"""``ernie5 bench train``: training throughput and MFU at the nano shape.

One optimizer step of the real training loop's work (forward with targets and the MTP loss,
backward, gradient clipping, fused AdamW, aux-free bias update) on ``batch_size x seq_len``
tokens of random ids, for the full model (no elastic sampling, so every step does the same
work), with fp32 master weights and a bf16 compute replica (``train.precision``), as
``ernie5 train`` runs. ``mfu = 6 * active_params_no_embedding * tokens_per_s / peak`` with
``peak`` this machine's bf16 matmul FLOP/s measured in the same process (perf-anchors.md
convention: attention-score FLOPs ignored).
"""

from __future__ import annotations

import torch

from ernie5.bench.timing import environment, matmul_peak, median_seconds
from ernie5.config import from_dict, read_yaml
from ernie5.model.config import ModelConfig
from ernie5.model.model import Ernie5Model
from ernie5.model.moe import MoE, update_router_bias
from ernie5.params import count_params
from ernie5.presets import resolve_config_path
from ernie5.runtime import tune_allocator
from train.precision import MixedPrecision


def bench_train(repeats: int = 5, batch_size: int = 8, seq_len: int = 256, dtype: str = "bf16") -> dict:
    """Median tokens/s of a full training step and the MFU it implies."""
    cfg = from_dict(ModelConfig, read_yaml(resolve_config_path("nano"))["model"])
    torch.manual_seed(0)
    tune_allocator()
    model = Ernie5Model(cfg).train()
    mp = MixedPrecision(model, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(16, cfg.vocab_size, (batch_size, seq_len + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    moes = [b.ffn for b in model.layers if isinstance(b.ffn, MoE)]
    avail = torch.ones(cfg.moe.n_experts, dtype=torch.bool)

    def step():
        out = mp.compute(x, targets_BT=y, return_logits=False)
        loss = out.loss + 0.3 * torch.stack(out.mtp_losses).mean()
        loss.backward()
        mp.accumulate_grads()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for moe, r in zip(moes, out.routing.values()):
            update_router_bias(moe, r.counts_E, 1e-3, avail)
        mp.sync()

    seconds = median_seconds(step, repeats, warmup=2)
    tokens = batch_size * seq_len
    peak = matmul_peak(torch.bfloat16 if mp.bf16 else torch.float32)
    active = count_params(cfg, None, seq_len).active_params_no_embedding
    tps = tokens / seconds
    return {
        "shape": "nano",
        "dtype": dtype,
        "tokens_per_step": tokens,
        "step_ms": seconds * 1e3,
        "tokens_per_s": tps,
        "mfu": 6 * active * tps / peak,
        "peak_gflops": peak / 1e9,
        "active_params_no_embedding": active,
        "env": environment(),
        "target": "mfu >= 0.30",
    }
