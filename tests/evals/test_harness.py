"""The sweep harness: adapter conventions, response cache, fingerprints and resume, skips and errors."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from ernie5.config import ConfigError
from ernie5.model.elastic import resolve
from ernie5.store.checkpoint import load_checkpoint
from evals.adapter import Ernie5EvalModel, EvalInputError
from evals.api import GenerationRequest, LoglikelihoodRequest, MediaPart, RollingRequest
from evals.cache import CachedModel, ResponseCache, request_key
from evals.results import RESULT_COLUMNS, read_unit, unit_path
from evals.suite import load_suite
from evals.sweep import run_sweep


@pytest.fixture(scope="module")
def micro_ckpt(tmp_path_factory) -> Path:
    from ernie5.config import load
    from ernie5.presets import resolve_config_path
    from train.config import RunConfig
    from train.loop import checkpoint_dirs, pretrain

    run = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = load(RunConfig, resolve_config_path("micro"), ["train.steps=30", "data.tokenizer_chars=30000"])
    pretrain(cfg, run, quiet=True)
    return checkpoint_dirs(run)[-1]


@pytest.fixture(scope="module")
def model(micro_ckpt) -> Ernie5EvalModel:
    return Ernie5EvalModel(load_checkpoint(micro_ckpt), batch_size=3)


def test_loglikelihood_matches_a_manual_forward(model):
    tok = model.tokenizer
    req = LoglikelihoodRequest("Q: 1+1=\nA:", " 2")
    (res,) = model.loglikelihood([req]).results
    ctx, whole = tok.encode(req.context), tok.encode(req.context + req.continuation)
    ids = torch.tensor([[1, *whole]])
    with torch.no_grad():
        lp = model.model(ids[:, :-1]).logits_BTV.log_softmax(-1)[0]
    n = len(whole) - len(ctx)
    expected = sum(float(lp[len(ctx) + i, whole[len(ctx) + i]]) for i in range(n))
    assert res.logprob == pytest.approx(expected, abs=1e-4) and res.n_tokens == n


def test_batching_does_not_change_answers(model):
    reqs = [LoglikelihoodRequest(f"Q: {i}+{i}=\nA:", f" {2 * i}") for i in range(7)]
    batched = model.loglikelihood(reqs).results
    single = [model.loglikelihood([r]).results[0] for r in reqs]
    assert [r.logprob for r in batched] == pytest.approx([r.logprob for r in single], abs=1e-4)
    gens = [GenerationRequest(f"Q: copy ab{i}\nA:", max_new_tokens=6, stop=("\n",)) for i in range(5)]
    assert [g.text for g in model.generate(gens)] == [model.generate([g])[0].text for g in gens]


def test_rolling_equals_token_sum_in_one_window(model):
    text = "To be, or not to be, that is the question."
    (res,) = model.loglikelihood_rolling([RollingRequest(text)]).results
    ids = torch.tensor([[1, *model.tokenizer.encode(text)]])
    with torch.no_grad():
        lp = model.model(ids[:, :-1]).logits_BTV.log_softmax(-1)[0]
    expected = float(lp.gather(-1, ids[0, 1:, None]).sum())
    assert res.logprob == pytest.approx(expected, abs=1e-3) and res.n_tokens == ids.shape[1] - 1


def test_rolling_windows_cover_long_documents(model):
    text = "abc def ghi " * 400  # longer than max_seq_len tokens
    (res,) = model.loglikelihood_rolling([RollingRequest(text)]).results
    assert res.n_tokens > model.max_len and res.logprob < 0


def test_generation_stops_at_stop_strings(model):
    (g,) = model.generate([GenerationRequest("Q: 1+1=\nA:", max_new_tokens=12, stop=("\n",))]).results
    assert "\n" not in g.text and g.n_tokens <= 12


def test_media_input_is_a_clear_error(model):
    import numpy as np

    with pytest.raises(EvalInputError, match="image"):
        model.generate([GenerationRequest(("look:", MediaPart("image", np.zeros((2, 2), np.uint8))))])


def test_two_subnets_never_share_cached_answers(model, tmp_path):
    cache = ResponseCache(tmp_path / "c.sqlite")
    cfg = model.ckpt.cfg
    full_model = Ernie5EvalModel(model.ckpt, resolve("full", cfg), batch_size=3)
    sub_model = Ernie5EvalModel(model.ckpt, resolve("d0.5-k1", cfg), batch_size=3)
    full_cached, sub_cached = CachedModel(full_model, cache), CachedModel(sub_model, cache)
    req = [LoglikelihoodRequest("Q: 2+2=\nA:", " 4")]
    full = full_cached.loglikelihood(req).results[0]
    sub = sub_cached.loglikelihood(req).results[0]
    assert sub_model.fingerprint != full_model.fingerprint
    assert sub_cached.misses == 1 and full_cached.misses == 1 and sub_cached.hits == 0
    assert full.logprob != sub.logprob
    again = sub_cached.loglikelihood(req)
    assert again.results[0] == sub and sub_cached.hits == 1
    assert again.model_s == 0.0 and again.routing == {}  # a hit runs no forward
    assert again.costs[0].n_input_tokens > 0  # the cost stored with the first answer comes back
    assert request_key(full_model.fingerprint, req[0]) != request_key(sub_model.fingerprint, req[0])


def test_answers_carry_their_cost_time_and_expert_loads(model):
    """Every call returns its own accounting; nothing accumulates on the adapter between calls."""
    reqs = [LoglikelihoodRequest("Q: 2+2=\nA:", " 4"), LoglikelihoodRequest("Q: 1+1=\nA:", " 2")]
    a = model.loglikelihood(reqs)
    b = model.loglikelihood(reqs)
    assert a.results == b.results and len(a.costs) == 2
    assert all(c.latency_s > 0 and c.n_input_tokens > 0 and c.n_output_tokens > 0 for c in a.costs)
    assert 0 < a.model_s < 60 and 0 < b.model_s < 60
    n_tokens = sum(c.n_input_tokens + c.n_output_tokens for c in a.costs) - len(reqs)  # no BOS target
    top_k = model.ckpt.cfg.moe.top_k
    assert set(a.routing) == set(model.ckpt.cfg.moe_layers)
    assert all(sum(counts) == n_tokens * top_k for counts in a.routing.values())  # real tokens only
    assert a.routing == b.routing
    quiet = Ernie5EvalModel(model.ckpt, batch_size=3, routing=False).loglikelihood(reqs)
    assert quiet.routing == {} and quiet.results == a.results


def _writer(path: str, worker: int) -> None:
    cache = ResponseCache(path)
    from evals.api import LoglikelihoodResult

    for i in range(40):
        req = LoglikelihoodRequest(f"w{worker}", f"r{i}")
        cache.put_many([(request_key("m", req), "m", req, LoglikelihoodResult(-1.0 * i, True, 1), 0.1, 3, 1)])
    cache.close()


def test_cache_is_safe_with_several_processes(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    ResponseCache(path).close()
    procs = [mp.get_context("spawn").Process(target=_writer, args=(path, w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    cache = ResponseCache(path)
    assert cache.count("m") == 120
    got = cache.get_many([request_key("m", LoglikelihoodRequest("w1", "r7"))])
    ((resp, latency, n_in, n_out),) = got.values()
    assert resp.logprob == -7.0 and latency == 0.1 and (n_in, n_out) == (3, 1)


def _suite(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "suite.yaml"
    path.write_text(body)
    return path


SMALL = """
name: small
batch_size: 8
tasks:
  - {task: arith_d1, limit: 6}
  - {task: copy_l8, limit: 4}
  - {task: shakespeare_bpb, limit: 2}
subnets: {specs: [full, k1]}
efficiency: {enabled: true, prompt_len: 8, decode_tokens: 4, repeats: 1}
"""


def test_sweep_writes_the_contract_and_is_deterministic(micro_ckpt, tmp_path):
    suite = _suite(tmp_path, SMALL)
    a = run_sweep(micro_ckpt, suite, tmp_path / "a", data_dir=tmp_path / "no-data", quiet=True)
    run_sweep(micro_ckpt, suite, tmp_path / "b", data_dir=tmp_path / "no-data", quiet=True)
    assert a.computed == 4 and a.skipped == 2 and a.errors == 0  # shakespeare skipped twice (no data)
    ra, rb = pd.read_csv(tmp_path / "a" / "results.csv"), pd.read_csv(tmp_path / "b" / "results.csv")
    assert list(ra.columns) == list(RESULT_COLUMNS)
    pd.testing.assert_frame_equal(ra, rb)
    skipped = read_unit(unit_path(tmp_path / "a", "full", "shakespeare_bpb"))
    assert skipped["status"] == "skipped" and "tinyshakespeare" in skipped["reason"]
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert {"checkpoint_hash", "suite_hash", "git_hash", "versions", "seeds", "argv", "machine"} <= set(
        manifest
    )
    eff = pd.read_csv(tmp_path / "a" / "efficiency.csv")
    assert set(eff["subnet"]) == {"full", "k1"} and (eff["decode_tokens_per_s"] > 0).all()
    assert (tmp_path / "a" / "routing" / "full.json").is_file()
    samples = (tmp_path / "a" / "samples" / "full" / "arith_d1.jsonl").read_text().splitlines()
    assert len(samples) == 6 and {"id", "scores", "sample"} <= set(json.loads(samples[0]))


def test_resume_skips_matching_units_and_recomputes_changed_ones(micro_ckpt, tmp_path):
    suite = _suite(tmp_path, SMALL)
    out = tmp_path / "run"
    run_sweep(micro_ckpt, suite, out, quiet=True)
    again = run_sweep(micro_ckpt, suite, out, quiet=True)
    assert again.reused == again.n_units and again.computed == 0
    limited = run_sweep(micro_ckpt, suite, out, limit=3, quiet=True)
    assert limited.computed >= 2  # the limit is part of the fingerprint
    assert limited.cache_hits > 0  # ... and the answers come from the cache


def test_a_crashing_task_is_recorded_and_the_sweep_goes_on(micro_ckpt, tmp_path, monkeypatch):
    from evals.tasks.procedural import ProceduralTask

    def boom(self, example, responses):
        raise RuntimeError("scorer exploded\nsecond line")

    monkeypatch.setattr(ProceduralTask, "score", boom)
    suite = _suite(tmp_path, SMALL.replace("shakespeare_bpb, limit: 2", "shakespeare_bpb, limit: 1"))
    s = run_sweep(micro_ckpt, suite, tmp_path / "run", quiet=True)
    assert s.errors == 4
    rec = read_unit(unit_path(tmp_path / "run", "k1", "copy_l8"))
    assert rec["status"] == "error" and rec["reason"] == "RuntimeError: scorer exploded"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ("name: x\ntasks: [{task: arith_d9}]\n", "did you mean"),
        ("name: x\ntasks: [{task: arith_d1, limit: 0}]\n", "limit=0"),
        ("name: x\ntasks: [{task: arith_d1, kwargs: {bogus: 1}}]\n", "bogus"),
        ("name: x\ntasks: [{task: arith_d1}]\nsubnets: {specs: [d0]}\n", "depth=0"),
        ("name: x\ntaskz: []\n", "unknown key 'taskz'"),
        ("name: x\ntasks: [{task: arith_d1\n", "malformed YAML"),
    ],
)
def test_bad_suites_are_one_line_errors(tmp_path, body, fragment):
    with pytest.raises(ConfigError) as e:
        load_suite(_suite(tmp_path, body))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_subnet_outside_the_model_is_an_error(micro_ckpt, tmp_path):
    suite = _suite(tmp_path, "name: x\ntasks: [{task: arith_d1, limit: 1}]\nsubnets: {specs: [k9]}\n")
    with pytest.raises(ConfigError, match="top_k=9"):
        run_sweep(micro_ckpt, suite, tmp_path / "run", quiet=True)
    assert not (tmp_path / "run" / "units").exists()


def test_shipped_suites_load():
    for name in ("smoke", "nightly", "full", "multimodal"):
        assert load_suite(name).cfg.tasks


def test_units_written_atomically_survive_a_stale_temp_file(micro_ckpt, tmp_path):
    suite = _suite(tmp_path, SMALL)
    out = tmp_path / "run"
    run_sweep(micro_ckpt, suite, out, quiet=True)
    target = unit_path(out, "full", "arith_d1")
    (target.parent / ".arith_d1.json.tmp-999").write_text("{partial")
    target.write_text('{"fingerprint": "torn')  # a torn record is recomputed, never trusted
    s = run_sweep(micro_ckpt, suite, out, quiet=True)
    assert s.computed == 1
    shutil.rmtree(out)
