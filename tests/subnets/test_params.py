"""Parameter and FLOP accounting."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ernie5.config import from_dict, read_yaml
from ernie5.model.config import ModelConfig, MTPConfig
from ernie5.model.model import Ernie5Model
from ernie5.presets import resolve_config_path
from ernie5.subnets.params import count_instantiated, count_params
from ernie5.subnets.spec import resolve
from tests.conftest import tiny_config


def _preset(name: str) -> ModelConfig:
    return from_dict(ModelConfig, read_yaml(resolve_config_path(name))["model"])


@pytest.mark.parametrize(
    "cfg",
    [
        tiny_config(),
        tiny_config(tie_embeddings=True, n_dense_layers=2),
        tiny_config(qk_norm=False, moe={"n_shared_experts": 0}),
    ],
)
def test_analytic_total_matches_instantiated(cfg):
    assert count_params(cfg).total_params == count_instantiated(Ernie5Model(cfg))


def test_nano_matches_the_peer_counts():
    """perf-anchors.md: Qwen3-MoE at the nano shape has 104,207,104 params, 6,689,536 active."""
    from dataclasses import replace

    cfg = replace(_preset("nano"), mtp=MTPConfig(n_depth=0))
    r = count_params(cfg)
    assert r.total_params == 104_207_104
    assert r.active_params == 6_689_536
    assert r.active_params_no_embedding == 5_640_960


def test_paper_preset_is_trillion_scale_and_ultra_sparse():
    cfg = _preset("paper")
    r = count_params(cfg)
    assert r.total_params >= 1e12
    assert r.activation_rate < 0.03
    with torch.device("meta"):
        m = Ernie5Model(cfg)
    assert count_instantiated(m) == r.total_params


def test_subnets_shrink_active_params_and_flops():
    cfg = _preset("nano")
    full = count_params(cfg)
    k1 = count_params(cfg, resolve("k1", cfg))
    d = count_params(cfg, resolve("d0.5", cfg))
    assert k1.total_params == full.total_params and k1.active_params < full.active_params
    assert d.total_params < full.total_params and d.flops_per_token < full.flops_per_token
    assert full.flops_per_token == pytest.approx(full.matmul_flops_per_token + full.attn_flops_per_token)


def test_train_flops_match_a_flop_counter_on_a_real_step(monkeypatch):
    """``train_flops_per_token`` is what a training step's matmuls do: torch's FlopCounterMode over
    forward + backward (MTP loss included) of the eager micro model (no fast paths: its experts are
    the naive loop, so that no padded row is counted). The counter has no formula for CPU attention
    (PyTorch's fused SDPA), so the causal attention cores, ``4 * heads * head_dim * (T + 1) / 2``
    forward FLOPs per token and attention layer (the MTP block's included), are set aside for the
    comparison."""
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setenv("ERNIE5_KERNELS", "off")
    b, t = 2, 32
    for cfg in (_preset("micro"), replace(_preset("micro"), tie_embeddings=True, qk_norm=False)):
        torch.manual_seed(0)
        model = Ernie5Model(cfg).train()
        ids = torch.randint(16, cfg.vocab_size, (b, t + 1))
        with FlopCounterMode(display=False) as counter:
            out = model(ids[:, :-1], targets=ids[:, 1:], return_logits=False)
            (out.losses.text + 0.3 * torch.stack(out.losses.mtp).mean()).backward()
        rep = count_params(cfg, None, t)
        cores = 4.0 * cfg.n_heads * cfg.dim_head * (t + 1) / 2 * (cfg.n_layers + cfg.mtp.n_depth)
        assert counter.get_total_flops() == pytest.approx((rep.train_flops_per_token - 3 * cores) * b * t)
        assert rep.mtp_flops_per_token > 0
    no_mtp = count_params(replace(_preset("micro"), mtp=MTPConfig(n_depth=0)), None, t)
    assert no_mtp.mtp_flops_per_token == 0
    assert no_mtp.train_flops_per_token < 3 * no_mtp.flops_per_token  # norm weights are not matmuls
