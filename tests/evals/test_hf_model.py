"""Hugging Face MoE targets: elastic patches against a naive masked forward, the adapter against
per-request forwards, and an ``hf:`` sweep with a report (tiny random models, offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")

from evals.adapter import EvalInputError  # noqa: E402
from evals.api import GenerationRequest, LoglikelihoodRequest, MediaPart, RollingRequest  # noqa: E402
from evals.hf_elastic import MOE_FAMILIES, decoder_layers, elastic, param_counts  # noqa: E402
from evals.hf_model import HFTarget, load_hf_target  # noqa: E402
from evals.hf_tiny import write_tiny  # noqa: E402

SPECS = ["full", "k1", "d0.5", "w0.5", "d0.75-w0.5-k1", "w0.25-k1"]


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def target(request, tmp_path_factory) -> HFTarget:
    folder = write_tiny(tmp_path_factory.mktemp(request.param), request.param, steps=0, layers=4, experts=8)
    return load_hf_target(f"hf:{folder}")


def _naive_moe(block, x: torch.Tensor, kept, top_k: int, family: str) -> torch.Tensor:
    """The MoE block written out: masked router softmax, top-k over kept experts, each expert's MLP."""
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ block.gate.weight.T
    if kept is not None:
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
        mask[list(kept)] = True
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if family == "mixtral" or block.gate.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    ex = block.experts
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for w, e in zip(weights[t], chosen[t]):
            gate, up = (flat[t] @ ex.gate_up_proj[e].T).chunk(2, dim=-1)
            out[t] += w * ((ex.act_fn(gate) * up) @ ex.down_proj[e].T)
    if hasattr(block, "shared_expert"):  # Qwen2-MoE
        out = out + torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    return out.reshape(x.shape)


@torch.no_grad()
def _naive_logits(target: HFTarget, ids: torch.Tensor, sub) -> torch.Tensor:
    """An explicit loop over the kept layers with the family's modules."""
    from transformers.masking_utils import create_causal_mask

    model, family = target.model, target.cfg.model_type
    base = model.model
    h = base.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    pe = base.rotary_emb(h, position_ids=pos)
    mask = create_causal_mask(
        config=model.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
    )
    layers = decoder_layers(model)
    for i in sub.layers:
        layer = layers[i]
        a, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(h),
            position_embeddings=pe,
            attention_mask=mask,
            position_ids=pos,
        )
        h = h + a
        h = h + _naive_moe(layer.mlp, layer.post_attention_layernorm(h), sub.experts[i], sub.top_k, family)
    return model.lm_head(base.norm(h))


def _ids(n: int = 12) -> torch.Tensor:
    return torch.randint(3, 300, (2, n), generator=torch.Generator().manual_seed(0))


def test_sub_models_equal_a_naive_masked_forward(target):
    ids = _ids()
    for sub in target.resolve_specs(SPECS):
        with torch.no_grad(), elastic(target.model, sub, target.cfg):
            got = target.model(input_ids=ids, use_cache=False).logits
        want = _naive_logits(target, ids, sub)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{target.cfg.model_type} {sub.name}")


def test_full_is_the_unmodified_model_and_patches_are_undone(target):
    ids = _ids()
    with torch.no_grad():
        plain = target.model(input_ids=ids, use_cache=False).logits
        full, cut = target.resolve_specs(["full", "d0.5-w0.5-k1"])
        with elastic(target.model, full, target.cfg):
            assert torch.equal(target.model(input_ids=ids, use_cache=False).logits, plain)
        with elastic(target.model, cut, target.cfg):
            assert not torch.allclose(target.model(input_ids=ids, use_cache=False).logits, plain)
        assert torch.equal(target.model(input_ids=ids, use_cache=False).logits, plain)
    assert not any("forward" in m.__dict__ for m in target.model.modules())


def _per_request_logprob(target, sub, context: str, continuation: str) -> float:
    tok = target.tokenizer
    ctx = tok.encode(context, add_special_tokens=False)
    cont = tok.encode(context + continuation, add_special_tokens=False)[len(ctx) :]
    seq = torch.tensor([[tok.bos_token_id, *ctx, *cont]])
    with torch.no_grad(), elastic(target.model, sub, target.cfg):
        lp = target.model(input_ids=seq[:, :-1], use_cache=False).logits.log_softmax(-1)[0]
    n = len(cont)
    pos = torch.arange(seq.shape[1] - 1 - n, seq.shape[1] - 1)
    return float(lp[pos].gather(-1, seq[0, -n:, None]).sum())


def test_loglikelihood_equals_a_per_request_forward(target):
    reqs = [
        LoglikelihoodRequest("Q: 3+4=\nA:", " 7"),
        LoglikelihoodRequest("Q: 3+4=\nA:", " 8"),
        LoglikelihoodRequest("Q: 3+4=\nA:", " 17 and more"),
        LoglikelihoodRequest("Q: reverse abc\nA:", " cba"),
        LoglikelihoodRequest("Q: sort c a\nA:", " a"),
    ]
    for sub in target.resolve_specs(["full", "d0.75-w0.5-k1"]):
        got = target.adapter(sub, batch_size=2).loglikelihood(reqs)
        for r, res in zip(reqs, got.results):
            want = _per_request_logprob(target, sub, r.context, r.continuation)
            assert res.logprob == pytest.approx(want, abs=1e-4), (sub.name, r)
        assert got.routing and all(len(c) == target.cfg.moe.n_experts for c in got.routing.values())
        assert set(got.routing) <= set(sub.layers)


def test_rolling_generation_and_media(target):
    sub = target.resolve_specs(["k1"])[0]
    m = target.adapter(sub, batch_size=4)
    text = "Q: copy abc\nA: abc\n" * 3
    (roll,) = m.loglikelihood_rolling([RollingRequest(text)]).results
    tok = target.tokenizer
    ids = [tok.bos_token_id, *tok.encode(text, add_special_tokens=False)]
    seq = torch.tensor([ids])
    with torch.no_grad(), elastic(target.model, sub, target.cfg):
        lp = target.model(input_ids=seq[:, :-1], use_cache=False).logits.log_softmax(-1)[0]
    assert roll.logprob == pytest.approx(float(lp.gather(-1, seq[0, 1:, None]).sum()), abs=1e-3)
    (gen,) = m.generate([GenerationRequest("Q: 1+1=\nA:", max_new_tokens=4, stop=("\n",))]).results
    assert gen.n_tokens <= 4 and "\n" not in gen.text
    with pytest.raises(EvalInputError, match="text-only"):
        m.loglikelihood([LoglikelihoodRequest(("look: ", MediaPart("image", object())), " x")])


def _uncached_greedy(target, sub, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding written out: the whole sequence recomputed at every step, no cache."""
    toks = list(prompt)
    with torch.no_grad(), elastic(target.model, sub, target.cfg):
        for _ in range(n):
            toks.append(
                int(target.model(input_ids=torch.tensor([toks]), use_cache=False).logits[0, -1].argmax())
            )
    return toks[len(prompt) :]


def test_cached_generation_equals_recomputing_the_prefix(target):
    """The KV-cached greedy decoder gives the tokens of a per-step full forward for every sub-model,
    a depth cut that drops layer 0 included (its cache holds the kept layers only)."""
    from ernie5.model.elastic import Subnet

    subs = target.resolve_specs(["full", "k1", "d0.5", "d0.75-w0.5-k1"])
    full = subs[0]
    no_first = Subnet((1, 3), full.experts, full.top_k, name="drop0")
    prompt = _ids(9)[0].tolist()
    for sub in [*subs, no_first]:
        m = target.adapter(sub, batch_size=2)
        got = m._greedy(prompt, 8, (), None)
        assert got == _uncached_greedy(target, sub, prompt, 8), (target.cfg.model_type, sub.name)
    layer_idx = [getattr(mod, "layer_idx", None) for mod in target.model.modules()]
    assert [i for i in layer_idx if i is not None] == sorted(i for i in layer_idx if i is not None)


def test_importance_and_parameter_counts(target):
    full, imp, cut = target.resolve_specs(["full", "d0.5-Limportance-w0.5-Eimportance", "w0.5-k1"])
    assert len(imp.layers) == 2 and all(e is None or len(e) == 4 for e in imp.experts)
    total, active = param_counts(target.model, full, target.cfg)
    assert total == sum(p.numel() for p in target.model.parameters())
    assert active < total
    t_cut, a_cut = param_counts(target.model, cut, target.cfg)
    assert t_cut < total and a_cut < active


def _suite(tmp_path: Path) -> Path:
    path = tmp_path / "suite.yaml"
    path.write_text(
        "name: hf_tiny\nseed: 0\nbatch_size: 8\ntasks:\n"
        "  - {task: arith_d1, limit: 6}\n  - {task: reverse_l8, limit: 3}\n"
        "  - {task: shapes_vqa_attr, limit: 2}\n"
        "subnets: {specs: [full, k1, d0.5-w0.5], random_baseline: true}\n"
        "efficiency: {enabled: true, prompt_len: 8, decode_tokens: 4, repeats: 1}\nrouting: true\n"
    )
    return path


def test_hf_sweep_writes_results_and_a_report_and_resumes(tmp_path):
    from evals.sweep import run_sweep
    from reports import build_report

    folder = write_tiny(tmp_path / "mixtral", "mixtral", steps=0, layers=2, experts=4, hidden=32)
    out = tmp_path / "run"
    s1 = run_sweep(f"hf:{folder}", _suite(tmp_path), out, quiet=True)
    assert s1.n_units == 12 and s1.errors == 0 and s1.failed == []
    assert s1.computed == 8 and s1.skipped == 4 and "shapes_vqa_attr" in s1.unavailable
    assert (out / "results.csv").is_file() and (out / "efficiency.csv").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["checkpoint"] == f"hf:{folder.resolve()}"
    assert manifest["checkpoint_hash"] == load_hf_target(f"hf:{folder}").hash
    assert [s["name"] for s in manifest["subnets"]] == ["full", "k1", "d0.5-w0.5"]
    assert (out / "routing" / "full.json").is_file()
    eff = pd.read_csv(out / "efficiency.csv").set_index("subnet")
    # Timed as the ERNIE5 rows are (the KV-cached decoder, every step checked against the peak).
    assert (eff["status"] == "ok").all(), eff["reason"].tolist()
    assert (eff["decode_tokens_per_s"] > 0).all() and (eff["prefill_ms"] > 0).all()
    assert eff.loc["d0.5-w0.5", "active_params"] < eff.loc["full", "active_params"]
    report = build_report(out)
    assert (report / "index.html").is_file() and (report / "summary.md").is_file()
    assert "k1" in (report / "summary.md").read_text()
    s2 = run_sweep(f"hf:{folder}", _suite(tmp_path), out, quiet=True)
    assert s2.reused == 12 and s2.computed == 0


def test_hf_timings_go_through_the_same_checks_as_ernie5s(tmp_path):
    """A clock that makes decoding impossibly fast fails the row with the efficiency module's reason."""
    from evals.hf_model import efficiency_rows
    from evals.suite import EfficiencyConfig

    folder = write_tiny(tmp_path / "qwen", "qwen2_moe", steps=0, layers=2, experts=4, hidden=32)
    target = load_hf_target(f"hf:{folder}")
    (full,) = target.resolve_specs(["full"])
    cfg = EfficiencyConfig(enabled=True, prompt_len=8, decode_tokens=4, repeats=1)
    ticks = iter(range(10**6))
    (row,) = efficiency_rows(target, [full], cfg, clock=lambda: next(ticks) * 1e-12)
    assert row["status"] == "failed" and "above" in row["reason"] and "matmul peak" in row["reason"]
    (row,) = efficiency_rows(target, [full], cfg)
    assert row["status"] == "ok" and row["threads"] == 1 and row["decode_tokens_per_s"] > 0
    (row,) = efficiency_rows(target, [full])  # no settings: the counts only
    assert row["status"] == "failed" and row["reason"].startswith("not measured")
