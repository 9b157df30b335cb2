"""The fast paths off the CPU, checked without a GPU: the meta device stands in for CUDA (its tensors
are not CPU tensors, and its kernels run the shape and dtype checks of the real ones).

* every fused CPU kernel's guard refuses tensors that are not on the CPU, so a CUDA model runs the
  eager PyTorch code instead of handing device memory to a CPU kernel;
* the ``grouped`` expert path (what ``auto`` trains with in bf16 on CUDA) passes ``torch._grouped_mm``'s
  checks (bf16, 16-byte aligned strides, int32 offsets) at every preset's MoE shape, for the whole
  layer and for an expert-parallel slice, forward and backward.
"""

from __future__ import annotations

import pytest
import torch

from ernie5.config import from_dict, read_yaml
from ernie5.fast.moe import batch_dispatch, experts_grouped
from ernie5.kernels import ops
from ernie5.model.config import ModelConfig
from ernie5.model.moe import RouterOutput
from ernie5.presets import resolve_config_path

META = torch.device("meta")
PRESETS = ["micro", "mini", "mini_all", "nano", "nano_all", "nano_mm", "reference", "paper"]
"""The run presets (meta tensors hold no memory: the paper's shape costs nothing)."""


def test_every_fused_kernel_guard_refuses_tensors_off_the_cpu():
    n, d, e, f, h, kv, dh = 4, 64, 16, 64, 4, 2, 32
    for dt in (torch.bfloat16, torch.float32):
        x = torch.empty(n, d, dtype=dt, device=META)
        w13 = torch.empty(e, 2 * f, d, dtype=dt, device=META)
        w2 = torch.empty(e, d, f, dtype=dt, device=META)
        q = torch.empty(1, h, n, dh, dtype=dt, device=META)
        k = torch.empty(1, kv, 8, dh, dtype=dt, device=META)
        router = torch.empty(e, d, dtype=dt, device=META)
        assert not ops.fusable(x)
        assert not ops.fusable(torch.empty(n, d, dtype=dt), router)  # one off-CPU tensor is enough
        assert not ops.experts_rows_fusable(x, w13, w2)
        assert not ops.expert_gemm_fusable(x, w13, w2)
        assert not ops.expert_infer_fusable(x, w13, w2)
        assert not ops.attend_rows_fusable(q, k, k)
        assert not ops.attend_f32_fusable(q, k, k)
        assert not ops.router_fusable(x, router)
        with torch.no_grad():  # the decoding product falls back to F.linear on the tensors' device
            assert ops.linear(x[:1], router).device == META


def test_auto_trains_the_grouped_path_for_bf16_on_cuda_only():
    assert batch_dispatch("cuda", torch.bfloat16) == "grouped"
    assert batch_dispatch("cuda", torch.float32) == "sorted"
    assert batch_dispatch("cpu", torch.bfloat16) == "sorted"


def _moe_shape(preset: str) -> tuple[int, int, int, int]:
    cfg = from_dict(ModelConfig, read_yaml(resolve_config_path(preset))["model"])
    return cfg.d_model, cfg.moe.n_experts, cfg.moe.d_expert, cfg.moe.top_k


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_grouped_expert_path_passes_grouped_mm_checks_at_every_preset_shape(preset, ep):
    d, n_exp, f, top_k = _moe_shape(preset)
    e = n_exp // ep  # an expert-parallel slice holds E / ep experts
    n = 37  # any token count: offsets, not shapes, carry the routing
    x = torch.empty(n, d, dtype=torch.bfloat16, device=META, requires_grad=True)
    w13 = torch.empty(e, 2 * f, d, dtype=torch.bfloat16, device=META, requires_grad=True)
    w2 = torch.empty(e, d, f, dtype=torch.bfloat16, device=META, requires_grad=True)
    r = RouterOutput(
        torch.empty(n, top_k, dtype=torch.long, device=META),
        torch.empty(n, top_k, dtype=torch.float32, device=META),
        torch.empty(e, dtype=torch.long, device=META),
    )
    y = experts_grouped(x, w13, w2, r)
    assert y.shape == (n, d) and y.dtype == torch.bfloat16 and y.device == META
    y.sum().backward()
    assert x.grad.shape == x.shape and w13.grad.shape == w13.shape and w2.grad.shape == w2.shape
