"""The sweep harness: adapter conventions, response cache, fingerprints and resume, skips and errors."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from ernie5.config import ConfigError
from ernie5.store.checkpoint import load_checkpoint
from ernie5.subnets.spec import resolve
from evals.adapter import Ernie5EvalModel, EvalInputError
from evals.api import GenerationRequest, LoglikelihoodRequest, MediaPart, RollingRequest
from evals.cache import CachedModel, ResponseCache, request_key
from evals.results import RESULT_COLUMNS, read_unit, unit_path
from evals.suite import load_suite
from evals.sweep import run_sweep


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
    (tmp_path / "no-data").mkdir()  # an empty data root
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
    assert set(eff["subnet"]) == {"full", "k1"} and set(eff["status"]) <= {"ok", "failed"}
    # A failed measurement (a busy machine) says why; a timing that failed its checks is NaN.
    reasons = eff["reason"].map(lambda r: "" if pd.isna(r) else str(r))
    assert (reasons[eff["status"] == "failed"].str.len() > 0).all()
    decode = eff["decode_tokens_per_s"].dropna()
    assert (decode > 0).all() and ((eff["status"] == "ok") <= eff["decode_tokens_per_s"].notna()).all()
    assert (tmp_path / "a" / "routing" / "full.json").is_file()
    samples = (tmp_path / "a" / "samples" / "full" / "arith_d1.jsonl").read_text().splitlines()
    assert len(samples) == 6 and {"id", "scores", "sample"} <= set(json.loads(samples[0]))


def test_a_failed_efficiency_measurement_is_taken_again_next_run(micro_ckpt, tmp_path, monkeypatch):
    import evals.sweep

    real, calls = evals.sweep.measure, []

    def measure(model, sub, *args, **kwargs):
        row = real(model, sub, *args, **kwargs)
        calls.append(sub.name)
        if len(calls) == 1:  # the first measurement of the run fails
            row.update(
                status="failed", reason="decode: interquartile range too wide", decode_tokens_per_s=math.nan
            )
        return row

    monkeypatch.setattr(evals.sweep, "measure", measure)
    suite = _suite(tmp_path, SMALL)
    out = tmp_path / "run"
    run_sweep(micro_ckpt, suite, out, quiet=True)
    assert calls == ["full", "k1"]
    run_sweep(micro_ckpt, suite, out, quiet=True)
    assert calls == ["full", "k1", "full"]  # k1's good row is reused, full's failed one is not


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
    stale_tmp = target.parent / ".arith_d1.json.tmp-999"
    stale_tmp.write_text("{partial")
    (out / ".results.parquet.tmp").write_text("partial")
    (out / "samples" / "k1" / ".copy_l8.jsonl.tmp-12").write_text("partial")
    (out / "units" / ".k1.old-12").mkdir()
    target.write_text('{"fingerprint": "torn')  # a torn record is recomputed, never trusted
    s = run_sweep(micro_ckpt, suite, out, quiet=True)
    assert s.computed == 1
    # what the killed run left is gone; the run's own files are not
    assert not stale_tmp.exists() and not (out / ".results.parquet.tmp").exists()
    assert not (out / "samples" / "k1" / ".copy_l8.jsonl.tmp-12").exists()
    assert not (out / "units" / ".k1.old-12").exists()
    assert read_unit(target)["status"] == "ok" and (out / "cache.sqlite").is_file()
    shutil.rmtree(out)


ONE_TASK = """
name: one
batch_size: 8
tasks:
  - {task: arith_d1, limit: 6}
subnets: {specs: [full]}
efficiency: {enabled: true, prompt_len: 8, decode_tokens: 4, repeats: 1}
"""


def test_units_of_an_earlier_suite_never_enter_the_tables(micro_ckpt, tmp_path):
    from reports.load import load_run

    out = tmp_path / "run"
    run_sweep(micro_ckpt, _suite(tmp_path, SMALL), out, quiet=True)
    assert len(pd.read_csv(out / "units.csv")) == 6
    one = tmp_path / "one"
    one.mkdir()
    s = run_sweep(micro_ckpt, _suite(one, ONE_TASK), out, quiet=True)
    assert s.n_units == 1 and s.reused == 1  # same unit, same fingerprint
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(u["subnet"], u["task"]) for u in manifest["units"]] == [("full", "arith_d1")]
    results, units = pd.read_csv(out / "results.csv"), pd.read_csv(out / "units.csv")
    assert set(zip(results["subnet"], results["task"])) == {("full", "arith_d1")}
    assert list(zip(units["subnet"], units["task"])) == [("full", "arith_d1")]
    assert set(pd.read_parquet(out / "results.parquet")["task"]) == {"arith_d1"}
    assert pd.read_csv(out / "efficiency.csv")["subnet"].tolist() == ["full"]
    assert sorted(p.name for p in (out / "routing").iterdir()) == ["full.json"]
    routing = json.loads((out / "routing" / "full.json").read_text())
    assert set(routing["tasks"]) == {"arith_d1"}
    run = load_run(out)
    assert run.units["task"].tolist() == ["arith_d1"] and set(run.results["task"]) == {"arith_d1"}
    assert unit_path(out, "k1", "copy_l8").is_file()  # stale files may stay on disk


def test_a_second_sweep_into_a_locked_folder_is_refused(micro_ckpt, tmp_path, capsys):
    from ernie5.store.runs import RunLock, RunLocked
    from jobs.cli import main

    out = tmp_path / "run"
    suite = _suite(tmp_path, SMALL)
    with RunLock(out):  # another sweep is writing the folder
        with pytest.raises(RunLocked, match=str(out)):
            run_sweep(micro_ckpt, suite, out, quiet=True)
        args = ["sweep", "--checkpoint", str(micro_ckpt), "--suite", str(suite), "--out", str(out)]
        assert main([*args, "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("ernie5 sweep: error: ") and str(out) in err and len(err.splitlines()) == 1
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written
    s = run_sweep(micro_ckpt, suite, out, quiet=True)  # free once the other sweep is done
    assert s.reused == 0 and s.errors == 0 and s.computed + s.skipped == s.n_units == 6


def test_a_sweep_with_an_error_unit_exits_3_and_retries_it_next_time(
    micro_ckpt, tmp_path, monkeypatch, capsys
):
    from evals.tasks.procedural import ProceduralTask
    from jobs.cli import main

    original = ProceduralTask.score

    def boom(self, example, responses):
        raise RuntimeError("scorer exploded")

    suite = _suite(tmp_path, SMALL)
    out = tmp_path / "run"
    args = ["sweep", "--checkpoint", str(micro_ckpt), "--suite", str(suite), "--out", str(out), "--quiet"]
    monkeypatch.setattr(ProceduralTask, "score", boom)
    assert main(args) == 3
    captured = capsys.readouterr()
    assert json.loads(captured.out)["errors"] == 4
    errors = [x for x in captured.err.splitlines() if x.startswith("ernie5 sweep: error")]
    err = errors[0] if errors else ""
    assert len(errors) == 1 and err.startswith(
        "ernie5 sweep: error: 4 of 6 units failed"
    )  # skips listed apart
    assert "full/arith_d1: RuntimeError: scorer exploded" in err and "Traceback" not in err
    assert (out / "results.csv").is_file()  # the tables are written all the same
    monkeypatch.setattr(ProceduralTask, "score", original)  # the bug is fixed: same fingerprints
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["computed"] == 4 and summary["errors"] == 0


def test_limit_below_one_is_rejected(micro_ckpt, tmp_path):
    with pytest.raises(ConfigError, match="limit=0: expected an integer >= 1"):
        run_sweep(micro_ckpt, _suite(tmp_path, SMALL), tmp_path / "run", limit=0, quiet=True)
    assert not (tmp_path / "run").exists()


def test_the_unsafe_code_flag_reaches_the_lm_eval_units(micro_ckpt, tmp_path, monkeypatch):
    import evals.lm_eval.unit
    import evals.sweep

    seen = []

    def units(entry, suite_dir, **kwargs):
        seen.append(kwargs.get("allow_code"))
        return []

    monkeypatch.setattr(evals.lm_eval.unit, "lm_eval_units", units)
    (tmp_path / "tasks").mkdir()
    suite = _suite(tmp_path, SMALL + "lm_eval:\n  - {task_dir: tasks, tasks: [t]}\n")
    loaded = load_suite(suite)
    evals.sweep.plan_units(loaded, "h", [], None, None)
    evals.sweep.plan_units(loaded, "h", [], None, None, allow_code=True)
    assert seen == [False, True]
    planned = []

    def plan(*args, allow_code=False, **kwargs):
        planned.append(allow_code)
        raise KeyboardInterrupt  # stop before anything is evaluated

    monkeypatch.setattr(evals.sweep, "plan_units", plan)
    for flag in (False, True):
        with pytest.raises(KeyboardInterrupt):
            run_sweep(micro_ckpt, suite, tmp_path / "run", quiet=True, confirm_run_unsafe_code=flag)
    assert planned == [False, True]


def test_suites_are_names_first(tmp_path, monkeypatch):
    from evals.suite import resolve_suite_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "smoke").mkdir()  # e.g. `--out smoke` of an earlier run
    (tmp_path / "nightly").write_text("not a suite")
    assert resolve_suite_path("smoke") == resolve_suite_path("nightly").with_name("smoke.yaml")
    assert resolve_suite_path("smoke").parent.name == "suites"
    assert load_suite("nightly").cfg.name == "nightly"
    with pytest.raises(ConfigError, match="suite file not found: ./smoke"):
        resolve_suite_path("./smoke")  # a path is a path
    (tmp_path / "mine.yaml").write_text("name: mine\ntasks: [{task: arith_d1}]\n")
    assert load_suite("mine.yaml").cfg.name == "mine"
    (tmp_path / "mine").write_text("name: mine\ntasks: [{task: arith_d1}]\n")
    with pytest.raises(ConfigError, match="unknown suite 'mine'"):
        resolve_suite_path("mine")


def _lm_eval_suite(folder: Path, task_dir: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "suite.yaml"
    path.write_text(f"name: x\nlm_eval:\n  - {{task_dir: {task_dir!r}, tasks: [t]}}\n")
    return path


def test_lm_eval_task_dirs_stay_inside_the_suite_folder(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "t.yaml").write_text("task: t\n")
    suite_dir = tmp_path / "suite"
    (suite_dir / "tasks").mkdir(parents=True)
    (suite_dir / "tasks" / "t.yaml").write_text("task: t\n")
    assert load_suite(_lm_eval_suite(suite_dir, "tasks")).cfg.lm_eval[0].task_dir == "tasks"
    (suite_dir / "link").symlink_to(outside, target_is_directory=True)
    for task_dir in ("../elsewhere", str(outside), "link"):
        with pytest.raises(ConfigError) as info:
            load_suite(_lm_eval_suite(suite_dir, task_dir))
        message = str(info.value)
        assert f"lm_eval.task_dir {task_dir!r}" in message and "outside" in message and "\n" not in message
    (suite_dir / "tasks" / "utils.py").symlink_to(outside / "t.yaml")  # code from elsewhere, by a link
    with pytest.raises(ConfigError, match="utils.py links to"):
        load_suite(_lm_eval_suite(suite_dir, "tasks"))


def test_the_projects_lm_eval_tasks_are_allowed_from_any_suite(tmp_path):
    from evals.suite import shipped_lm_eval_dir

    loaded = load_suite(_lm_eval_suite(tmp_path / "s", str(shipped_lm_eval_dir())))
    assert loaded.cfg.lm_eval[0].task_dir == str(shipped_lm_eval_dir())
    assert load_suite("nightly").cfg.lm_eval  # the shipped suites use it
