"""Training-time sub-model sampling: marginals, constraints, determinism."""

from __future__ import annotations

from tests.conftest import tiny_config
from train.pretrain.config import ElasticConfig
from train.pretrain.elastic import sample_subnet


def test_marginals_follow_the_paper_defaults():
    cfg = tiny_config(n_layers=8, moe={"n_experts": 8, "top_k": 4})
    ec = ElasticConfig()
    dims = [sample_subnet(ec, cfg, 0, step, 0)[1] for step in range(2000)]
    full_depth = sum(d["depth"] == 8 for d in dims) / len(dims)
    full_width = sum(d["width"] == 8 for d in dims) / len(dims)
    default_k = sum(d["top_k"] == 4 for d in dims) / len(dims)
    assert abs(full_depth - 0.75) < 0.04 and abs(full_width - 0.8) < 0.04 and abs(default_k - 0.8) < 0.04
    assert {d["top_k"] for d in dims} == {1, 2, 3, 4}
    assert min(d["depth"] for d in dims) == 4  # min_depth 0.5 of 8


def test_samples_are_valid_and_deterministic():
    cfg = tiny_config(n_layers=6)
    ec = ElasticConfig(p_full_depth=0, p_full_width=0, p_default_top_k=0)
    for step in range(50):
        sub, dims = sample_subnet(ec, cfg, 3, step, 1)
        assert sub.layers[0] == 0 and sub.layers[-1] == 5 and list(sub.layers) == sorted(set(sub.layers))
        assert all(e is not None and len(e) == 4 for e in sub.experts)
        assert 1 <= sub.top_k < 2 and dims["width"] == 4
        assert sample_subnet(ec, cfg, 3, step, 1)[0] == sub


def test_disabled_is_always_full():
    cfg = tiny_config()
    sub, _ = sample_subnet(ElasticConfig(enabled=False), cfg, 0, 5, 0)
    assert sub.is_full_for(cfg)
