"""The lm-eval bridge: the ``ernie5`` LM, lm-eval's command line, --use_cache refusal, suite units."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.loggers import EvaluationTracker  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from ernie5.store.checkpoint import load_checkpoint  # noqa: E402
from ernie5.subnets.params import count_params  # noqa: E402
from ernie5.subnets.spec import resolve  # noqa: E402
from evals.adapter import Ernie5EvalModel  # noqa: E402
from evals.api import GenerationRequest, LoglikelihoodRequest, RollingRequest  # noqa: E402
from evals.lm_eval.cli import run_lm_eval_cli  # noqa: E402
from evals.lm_eval.model import Ernie5LM  # noqa: E402
from evals.lm_eval.task_yaml import all_local  # noqa: E402
from evals.lm_eval.unit import lm_eval_units  # noqa: E402
from evals.suite import LmEvalEntry  # noqa: E402

SUITES = Path(__file__).resolve().parents[3] / "suites"
N_DOCS = 6
TOY_YAML = """\
task: toy_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{q}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
metadata: {{version: 1.0}}
"""
GEN_YAML = """\
task: toy_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: "{data_dir}/toy/gen.jsonl"
test_split: test
output_type: generate_until
doc_to_text: "Q: {{q}}\\nA:"
doc_to_target: "{{a}}"
generation_kwargs: {until: ["\\n"], do_sample: false, max_gen_toks: 4}
metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]
filter_list:
  - {name: none, filter: [{function: take_first}]}
  - {name: first-number, filter: [{function: regex, regex_pattern: "(-?[0-9]+)"}, {function: take_first}]}
metadata: {version: 2}
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from ernie5.config import load
    from ernie5.presets import resolve_config_path
    from train.pretrain.config import RunConfig
    from train.pretrain.loop import pretrain

    run = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = load(RunConfig, resolve_config_path("micro"), ["train.steps=10", "data.tokenizer_chars=20000"])
    pretrain(cfg, run, quiet=True)
    return run


@pytest.fixture(scope="module")
def eval_model(run_dir) -> Ernie5EvalModel:
    from ernie5.store.checkpoint import checkpoint_dirs

    return Ernie5EvalModel(load_checkpoint(checkpoint_dirs(run_dir)[-1]), batch_size=4)


@pytest.fixture(scope="module")
def toy_tasks(tmp_path_factory) -> Path:
    """A local multiple-choice task over a jsonl, with an absolute data_files path."""
    root = tmp_path_factory.mktemp("toy")
    data = root / "toy.jsonl"
    rows = [
        {"q": f"{i}+{i}=", "choices": [str(2 * i), str(2 * i + 1), str(i)], "label": 0} for i in range(N_DOCS)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tasks").mkdir()
    (root / "tasks" / "toy_mc.yaml").write_text(TOY_YAML.format(data=data))
    return root / "tasks"


def _instance(kind: str, args: tuple, idx: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=idx)


def test_simple_evaluate_on_a_local_task(eval_model, toy_tasks):
    tm = TaskManager(include_path=str(toy_tasks), include_defaults=False)
    out = simple_evaluate(
        model=Ernie5LM.from_eval_model(eval_model),
        tasks=["toy_mc"],
        task_manager=tm,
        log_samples=True,
        evaluation_tracker=EvaluationTracker(),
        bootstrap_iters=0,
    )
    acc = float(out["results"]["toy_mc"]["acc,none"])
    assert 0.0 <= acc <= 1.0
    assert out["n-samples"]["toy_mc"]["effective"] == N_DOCS and len(out["samples"]["toy_mc"]) == N_DOCS
    assert out["config"]["subnet"] == "full" and out["config"]["fingerprint"] == eval_model.fingerprint


def test_requests_map_to_the_adapter_in_order(eval_model):
    lm = Ernie5LM.from_eval_model(eval_model)
    pairs = [("Q: 1+1=\nA:", " 2"), ("", "hello"), ("Q: 3+3=\nA:", " 6")]
    got = lm.loglikelihood([_instance("loglikelihood", p, i) for i, p in enumerate(pairs)])
    want = eval_model.loglikelihood([LoglikelihoodRequest(c, x) for c, x in pairs])
    assert [g[0] for g in got] == pytest.approx([w.logprob for w in want], abs=1e-5)
    assert [g[1] for g in got] == [w.is_greedy for w in want]
    text = "to be or not to be"
    (roll,) = lm.loglikelihood_rolling([_instance("loglikelihood_rolling", (text,))])
    assert roll == pytest.approx(eval_model.loglikelihood_rolling([RollingRequest(text)])[0].logprob)
    gens = lm.generate_until(
        [
            _instance(
                "generate_until", ("Q: 2+2=\nA:", {"until": "\n", "max_gen_toks": 5, "do_sample": False})
            ),
            _instance(
                "generate_until",
                (
                    "Q: 5+5=\nA:",
                    {"until": ["Q:", "\n"], "max_gen_toks": 8, "do_sample": True, "temperature": 0},
                ),
            ),
        ]
    )
    want_gen = eval_model.generate(
        [
            GenerationRequest("Q: 2+2=\nA:", max_new_tokens=5, stop=("\n",)),
            GenerationRequest("Q: 5+5=\nA:", max_new_tokens=8, stop=("Q:", "\n")),
        ]
    )
    assert gens == [w.text for w in want_gen] and all("\n" not in g for g in gens)
    req = lm._gen_request(("x", {"max_gen_toks": 10_000, "do_sample": True, "temperature": 0.7}))
    assert req.max_new_tokens < eval_model.max_len and req.temperature == 0.7
    req = lm._gen_request(("x", {"until": "Q:", "temperature": 0.7}))  # do_sample absent: greedy
    assert req.max_new_tokens == 256 and req.temperature == 0.0 and req.stop == ("Q:",)


def test_cli_writes_results_with_the_subnet_info(run_dir, toy_tasks, tmp_path):
    out = tmp_path / "out"
    rc = run_lm_eval_cli(
        [
            "--model",
            "ernie5",
            "--model_args",
            f"checkpoint={run_dir},subnet=k1",
            "--tasks",
            "toy_mc",
            "--include_path",
            str(toy_tasks),
            "--output_path",
            str(out),
            "--log_samples",
        ]
    )
    assert rc == 0
    (results,) = out.rglob("results_*.json")
    cfg = json.loads(results.read_text())["config"]
    ckpt = load_checkpoint(cfg["checkpoint"])
    assert cfg["subnet"] == "k1" and cfg["top_k"] == 1 and cfg["device"] == "cpu"
    assert cfg["active_params"] == count_params(ckpt.cfg, resolve("k1", ckpt.cfg)).active_params
    assert cfg["active_params"] < cfg["total_params"]
    assert len(list(out.rglob("samples_toy_mc_*.jsonl"))) == 1


def test_subnets_answer_differently_and_our_cache_keeps_them_apart(run_dir, tmp_path):
    db = tmp_path / "cache.sqlite"
    full = Ernie5LM(checkpoint=str(run_dir), subnet="full", batch_size="auto", cache=str(db))
    small = Ernie5LM(checkpoint=str(run_dir), subnet="d0.5-w0.5-k1", batch_size=2, cache=str(db))
    req = [_instance("loglikelihood", ("Q: 1+1=\nA:", " 2"))]
    a, b = full.loglikelihood(req)[0][0], small.loglikelihood(req)[0][0]
    assert a != pytest.approx(b)
    assert small.loglikelihood(req)[0][0] == b and full.loglikelihood(req)[0][0] == a  # cache hits
    assert full.eval_model.hits == 1 and small.eval_model.hits == 1
    info = small.get_model_info()
    assert info["subnet"] == "d0.5-w0.5-k1" and len(info["layers"]) == 2 and info["top_k"] == 1
    assert info["active_params"] < full.get_model_info()["active_params"]
    with pytest.raises(ValueError, match="device"):
        Ernie5LM(checkpoint=str(run_dir), device="mps")


@pytest.mark.parametrize("form", [["run"], []])
def test_use_cache_is_refused_on_the_cli(run_dir, tmp_path, capsys, form):
    cache = tmp_path / "lm_cache"
    flag = "--use_cache" if form else "-c"
    argv = [
        *form,
        "--model",
        "ernie5",
        "--model_args",
        f"checkpoint={run_dir}",
        "--tasks",
        "toy_mc",
        flag,
        str(cache),
    ]
    assert run_lm_eval_cli(argv) == 2
    assert "--use_cache" in capsys.readouterr().err and not list(tmp_path.glob("lm_cache*"))


def test_device_variant_of_the_adapter_answers_the_same(eval_model):
    from evals.lm_eval.model import _DeviceEvalModel

    reqs = [LoglikelihoodRequest("Q: 1+1=\nA:", " 2"), LoglikelihoodRequest("ab", "cd")]
    moved = _DeviceEvalModel(eval_model.ckpt, eval_model.subnet, batch_size=2).loglikelihood(reqs)
    plain = eval_model.loglikelihood(reqs)
    assert [r.logprob for r in moved] == pytest.approx([r.logprob for r in plain], abs=1e-5)


def test_use_cache_is_refused_in_python(eval_model, toy_tasks, tmp_path):
    tm = TaskManager(include_path=str(toy_tasks), include_defaults=False)
    with pytest.raises(ValueError, match="use_cache"):
        simple_evaluate(
            model=Ernie5LM.from_eval_model(eval_model),
            tasks=["toy_mc"],
            task_manager=tm,
            use_cache=str(tmp_path / "c"),
        )


def test_shipped_arc_task_as_a_suite_unit(eval_model, data_root, tmp_path):
    (arc,) = lm_eval_units(LmEvalEntry(task_dir="lm_eval", tasks=("arc_easy_local",), limit=5), SUITES)
    assert arc.name == "lmeval-arc_easy_local" and arc.version == 1
    assert arc.metrics == {"acc": True, "acc_norm": True}
    assert arc.kwargs["lm_eval_task"] == "arc_easy_local" and arc.available(data_root) == (True, "")
    result = arc.evaluate(eval_model, data_dir=data_root, limit=5, seed=0, work_dir=tmp_path / "w")
    samples = result.samples
    assert result.n_examples == 5 and set(result.metrics) == {"acc", "acc_norm"}
    assert result.model_s > 0  # the forwards lm-eval asked for, timed through the adapter's answers
    n_experts = eval_model.ckpt.cfg.moe.n_experts
    assert result.routing and all(len(c) == n_experts and sum(c) > 0 for c in result.routing.values())
    for m in result.metrics.values():
        assert math.isfinite(m["value"]) and type(m["value"]) is float
        assert m["n"] == 5 and m["higher_is_better"] is True
        assert math.isfinite(m["stderr"]) and type(m["stderr"]) is float
    assert [s["id"] for s in samples] == [str(i) for i in range(5)]
    first = samples[0]
    assert set(first["scores"]) == {"acc", "acc_norm"} and first["sample"]["prompt"].startswith("Question:")
    assert first["sample"]["target"] == "Sunlight is the source of energy for nearly all ecosystems."
    assert first["sample"]["prediction"] and len(first["sample"]["logprobs"]) >= 3
    json.dumps(samples, allow_nan=False)
    copied = next((tmp_path / "w").rglob("arc_easy_local.yaml")).read_text()
    assert "{data_dir}" not in copied and str(data_root.resolve()) in copied


def test_shipped_units_check_their_data(data_root, tmp_path):
    arc, gsm = lm_eval_units(LmEvalEntry(task_dir="lm_eval", tasks=("arc_easy_local", "gsm8k_local")), SUITES)
    assert set(gsm.metrics) == {"exact_match_strict-match", "exact_match_flexible-extract"}
    ok, reason = arc.available(tmp_path / "empty")
    assert not ok and "ARC-Easy" in reason and str(tmp_path / "empty") in reason and "\n" not in reason
    assert not arc.available(None)[0]
    fp = arc.fingerprint_data(data_root)
    assert fp == arc.fingerprint_data(data_root) != gsm.fingerprint_data(data_root)


def test_generation_unit_with_filters(eval_model, tmp_path):
    root, data = tmp_path / "suite", tmp_path / "data"
    (root / "tasks").mkdir(parents=True)
    (data / "toy").mkdir(parents=True)
    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(3)]
    (data / "toy" / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tasks" / "gen.yaml").write_text(GEN_YAML)
    (unit,) = lm_eval_units(LmEvalEntry(task_dir="tasks", tasks=("toy_gen",), num_fewshot=0), root)
    assert unit.version == 2 and set(unit.metrics) == {"exact_match", "exact_match_first-number"}
    result = unit.evaluate(eval_model, data_dir=data, limit=None, seed=1, work_dir=tmp_path / "w")
    samples = result.samples
    assert set(result.metrics) == set(unit.metrics) and result.n_examples == 3
    assert all(0.0 <= m["value"] <= 1.0 for m in result.metrics.values())
    assert [s["id"] for s in samples] == ["0", "1", "2"]
    assert set(samples[0]["scores"]) == set(unit.metrics)
    assert {"prediction", "prediction_first-number", "output", "target"} <= set(samples[0]["sample"])
    assert samples[0]["sample"]["target"] == "1"


def test_cli_skips_the_builtin_task_index_only_for_local_tasks(toy_tasks):
    assert all_local("toy_mc", str(toy_tasks)) and not all_local("toy_mc,arc_easy", str(toy_tasks))
    assert not all_local("toy_mc", None)


def test_unknown_lm_eval_task_is_named(tmp_path):
    with pytest.raises(ValueError, match="nope"):
        lm_eval_units(LmEvalEntry(task_dir="lm_eval", tasks=("nope",)), SUITES)


# ---------------------------------------------------------------------- suites are data only
CODE_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
{extra}
doc_to_text: "{text}Q: {{{{q}}}}\\nA:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
metadata: {{version: 1.0}}
"""
UTILS_PY = """\
import pathlib

pathlib.Path({marker!r}).write_text("imported")


def process_docs(ds):
    return ds
"""


def _task_folder(
    root: Path, marker: Path, *, task: str = "toy_code", extra: str = "", text: str = ""
) -> Path:
    """A folder with one multiple-choice task over 3 documents and a ``utils.py`` that leaves ``marker``
    when imported (the YAML uses it only if ``extra`` says so)."""
    root.mkdir(parents=True, exist_ok=True)
    data = root.parent / f"{root.name}-data.jsonl"
    rows = [{"q": f"{i}+{i}=", "choices": [str(2 * i), str(i)], "label": 0} for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "task.yaml").write_text(CODE_YAML.format(task=task, data=data, extra=extra, text=text))
    (root / "utils.py").write_text(UTILS_PY.format(marker=str(marker)))
    return root


def test_task_dir_must_be_inside_the_suite_folder_or_the_shipped_one(tmp_path):
    suite, outside = tmp_path / "suite", _task_folder(tmp_path / "elsewhere", tmp_path / "m")
    suite.mkdir()
    (suite / "link").symlink_to(outside, target_is_directory=True)
    for task_dir in (str(outside), "../elsewhere", "link"):
        with pytest.raises(ValueError, match="must be a folder inside the suite's folder") as err:
            lm_eval_units(LmEvalEntry(task_dir=task_dir, tasks=("toy_code",)), suite)
        assert repr(task_dir) in str(err.value) and "\n" not in str(err.value)
    shipped = str(SUITES / "lm_eval")  # the shipped tasks may be named from any suite
    (arc,) = lm_eval_units(LmEvalEntry(task_dir=shipped, tasks=("arc_easy_local",)), suite)
    assert arc.lm_eval_task == "arc_easy_local"


def test_task_folder_files_and_includes_stay_inside_it(tmp_path):
    suite, secret = tmp_path / "suite", tmp_path / "secret.txt"
    secret.write_text("not for the run folder")
    folder = _task_folder(suite / "tasks", tmp_path / "m")
    (folder / "leak.txt").symlink_to(secret)
    with pytest.raises(ValueError, match=r"leak\.txt resolves to .*outside the task folder"):
        lm_eval_units(LmEvalEntry(task_dir="tasks", tasks=("toy_code",)), suite)
    (folder / "leak.txt").unlink()
    (tmp_path / "base.yaml").write_text("output_type: multiple_choice\n")
    text = (folder / "task.yaml").read_text()
    (folder / "task.yaml").write_text("include: ../../base.yaml\n" + text)
    with pytest.raises(
        ValueError, match=r"include '\.\./\.\./base\.yaml' must be a file inside the task folder"
    ):
        lm_eval_units(LmEvalEntry(task_dir="tasks", tasks=("toy_code",)), suite)


@pytest.mark.parametrize(
    "layout",
    ["in the task file", "in an included file", "unsafe_code"],
)
def test_task_code_needs_the_flag(tmp_path, layout):
    suite, marker = tmp_path / "suite", tmp_path / "marker"
    func = "process_docs: !function utils.process_docs"
    folder = _task_folder(suite / "tasks", marker, extra=func if layout == "in the task file" else "")
    if layout == "in an included file":
        (folder / "_base.yaml").write_text(func + "\n")
        (folder / "task.yaml").write_text("include: _base.yaml\n" + (folder / "task.yaml").read_text())
    if layout == "unsafe_code":
        (folder / "task.yaml").write_text((folder / "task.yaml").read_text() + "unsafe_code: true\n")
    entry = LmEvalEntry(task_dir="tasks", tasks=("toy_code",))
    with pytest.raises(ValueError, match="--confirm-run-unsafe-code") as err:
        lm_eval_units(entry, suite)
    msg = str(err.value)
    assert "\n" not in msg and not marker.exists()
    named = {"in the task file": "task.yaml", "in an included file": "_base.yaml", "unsafe_code": "task.yaml"}
    assert str(folder / named[layout]) in msg
    if layout != "unsafe_code":
        assert str(folder / "utils.py") in msg
    (unit,) = lm_eval_units(entry, suite, allow_code=True)
    assert unit.allow_code and not marker.exists()  # planning never imports task code


def test_allowed_task_code_runs_and_every_task_file_enters_the_fingerprint(eval_model, tmp_path):
    suite, marker = tmp_path / "suite", tmp_path / "marker"
    folder = _task_folder(suite / "tasks", marker, extra="process_docs: !function utils.process_docs")
    (unit,) = lm_eval_units(LmEvalEntry(task_dir="tasks", tasks=("toy_code",)), suite, allow_code=True)
    fp = unit.fingerprint_data(None)
    result = unit.evaluate(eval_model, data_dir=None, limit=None, seed=0, work_dir=tmp_path / "w")
    assert result.n_examples == 3 and marker.read_text() == "imported"
    (folder / "utils.py").write_text((folder / "utils.py").read_text() + "\n# changed\n")
    fp_code = unit.fingerprint_data(None)
    (folder / "notes.md").write_text("a new file of the folder")
    assert len({fp, fp_code, unit.fingerprint_data(None)}) == 3


def test_code_added_after_planning_is_refused_when_the_unit_runs(eval_model, tmp_path):
    suite, marker = tmp_path / "suite", tmp_path / "marker"
    folder = _task_folder(suite / "tasks", marker)
    (unit,) = lm_eval_units(LmEvalEntry(task_dir="tasks", tasks=("toy_code",)), suite)
    text = (folder / "task.yaml").read_text()
    (folder / "task.yaml").write_text(text + "process_docs: !function utils.process_docs\n")
    with pytest.raises(
        ValueError, match=r"`!function utils\.process_docs`.*utils\.py.*--confirm-run-unsafe-code"
    ):
        unit.evaluate(eval_model, data_dir=None, limit=None, seed=0, work_dir=tmp_path / "w")
    assert not marker.exists()


def test_templates_cannot_reach_python(eval_model, tmp_path):
    suite, marker = tmp_path / "suite", tmp_path / "marker"
    payload = f"{{{{ lipsum.__globals__['os'].mkdir('{marker}') }}}}"  # classic Jinja escape to os
    _task_folder(suite / "tasks", tmp_path / "unused", text=payload)
    (unit,) = lm_eval_units(LmEvalEntry(task_dir="tasks", tasks=("toy_code",)), suite)
    with pytest.raises(ValueError, match="a template tried to reach Python") as err:
        unit.evaluate(eval_model, data_dir=None, limit=None, seed=0, work_dir=tmp_path / "w")
    assert not marker.exists() and "\n" not in str(err.value)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    rc = run_lm_eval_cli(argv)
    return rc, capsys.readouterr().err


def test_cli_unknown_task_is_a_one_line_error(toy_tasks, capsys):
    argv = ["--model", "ernie5", "--model_args", "checkpoint=/nonexistent", "--tasks", "no_such_task_x"]
    rc, err = _cli([*argv, "--include_path", str(toy_tasks)], capsys)
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "lm-eval: error: Tasks not found: no_such_task_x"


def test_cli_bad_checkpoint_is_a_one_line_error(toy_tasks, tmp_path, capsys):
    argv = ["--model", "ernie5", "--model_args", f"checkpoint={tmp_path / 'nope'}", "--tasks", "toy_mc"]
    rc, err = _cli([*argv, "--include_path", str(toy_tasks)], capsys)
    assert rc == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lm-eval: error: ernie5: ") and str(tmp_path / "nope") in last


def test_cli_task_code_needs_confirm_run_unsafe_code(run_dir, tmp_path, capsys):
    marker = tmp_path / "marker"
    folder = _task_folder(tmp_path / "tasks", marker, extra="process_docs: !function utils.process_docs")
    argv = ["--model", "ernie5", "--model_args", f"checkpoint={run_dir}"]
    argv += ["--include_path", str(folder), "--limit", "2"]
    for tasks in (["--tasks", "toy_code"], ["--tasks", str(folder / "task.yaml")]):
        rc, err = _cli([*argv, *tasks], capsys)
        assert rc == 2 and not marker.exists() and "Traceback" not in err
        last = err.strip().splitlines()[-1]
        assert last.startswith("lm-eval: error: ") and str(folder / "utils.py") in last
        assert "--confirm_run_unsafe_code" in last
    rc, err = _cli([*argv, "--tasks", "toy_code", "--confirm_run_unsafe_code"], capsys)
    assert rc == 0 and marker.read_text() == "imported"
