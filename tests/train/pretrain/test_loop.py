"""Pretraining smoke run, exact resume, run-folder contract and data-stream determinism."""

from __future__ import annotations

import json
import shutil

import pytest

from ernie5.config import load
from ernie5.presets import resolve_config_path
from ernie5.store.checkpoint import checkpoint_dirs, load_checkpoint
from train.common.run_folder import RunError
from train.pretrain.config import RunConfig
from train.pretrain.loop import pretrain

OVERRIDES = [
    "train.steps=16",
    "train.ckpt_every=8",
    "train.log_every=1",
    "data.tokenizer_chars=20000",
    "elastic.p_full_depth=0.5",
    "elastic.p_full_width=0.5",
    "elastic.p_default_top_k=0.5",
]


def _cfg(*extra: str) -> RunConfig:
    return load(RunConfig, resolve_config_path("micro"), [*OVERRIDES, *extra])


def _losses(run_dir):
    return [
        (r["step"], r["loss"], r["loss_total"])
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    ]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "straight"
    pretrain(_cfg(), out, data_dir=None, quiet=True)
    return out


def test_loss_falls_and_the_run_folder_is_complete(tmp_path):
    out = tmp_path / "run"
    pretrain(_cfg("train.steps=40", "elastic.enabled=false"), out, quiet=True)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["loss"] for r in recs[:5]) / 5
    last = sum(r["loss"] for r in recs[-5:]) / 5
    assert last < first - 0.5
    assert {"step", "loss", "lr", "tokens_per_s", "mfu", "subnets", "routing_entropy"} <= set(recs[-1])
    assert recs[-1]["mfu_model_flops"] > recs[-1]["mfu"] > 0  # + the MTP module and attention cores
    meta = json.loads((out / "meta.json").read_text())
    assert {"git_hash", "versions", "seed", "argv"} <= set(meta)
    assert (out / "config.yaml").is_file() and (out / "tokenizer.json").is_file()
    ckpt = load_checkpoint(checkpoint_dirs(out)[-1])
    assert ckpt.meta["step"] == 40 and ckpt.tokenizer is not None


def test_exact_resume_reproduces_the_losses(straight_run, tmp_path):
    # Simulate a stop right after the step-8 checkpoint: drop everything later, then resume.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000016")
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("\n".join(lines[:10]) + '\n{"step": 11, "loss": 1')  # torn line
    pretrain(_cfg(), resumed, resume=True, quiet=True)
    assert _losses(resumed) == _losses(straight_run)


def test_elastic_sampling_is_logged(straight_run):
    recs = [json.loads(line) for line in (straight_run / "metrics.jsonl").read_text().splitlines()]
    dims = [r["subnets"][0] for r in recs]
    assert any(d["depth"] < 4 for d in dims) and any(d["top_k"] == 1 for d in dims)
    assert any("loss_depth_reduced" in r for r in recs)


def test_refuses_to_overwrite_and_checks_config_on_resume(straight_run, tmp_path):
    with pytest.raises(RunError, match="already holds a run"):
        pretrain(_cfg(), straight_run, quiet=True)
    other = tmp_path / "other"
    shutil.copytree(straight_run, other)
    with pytest.raises(RunError, match="optim.lr"):
        pretrain(_cfg("optim.lr=0.01"), other, resume=True, quiet=True)


def test_resume_with_more_steps_extends_the_run(straight_run, tmp_path):
    """--resume with a larger train.steps continues the run to the new total: the steps already
    trained are untouched, the schedule is re-evaluated over the new total from the resume point, and
    the extension is recorded in meta.json and metrics.jsonl. Shrinking, or changing anything else, is
    refused in one line."""
    from train.common.schedule import lr_at

    ext = tmp_path / "ext"
    shutil.copytree(straight_run, ext)
    with pytest.raises(RunError, match=r"train.steps=8 < 16 .*extended, not shortened") as info:
        pretrain(_cfg("train.steps=8"), ext, resume=True, quiet=True)
    assert "\n" not in str(info.value)
    with pytest.raises(RunError, match=r"optim.lr: .*only train.steps may grow"):
        pretrain(_cfg("train.steps=24", "optim.lr=0.01"), ext, resume=True, quiet=True)

    cfg = _cfg("train.steps=24")
    pretrain(cfg, ext, resume=True, quiet=True)
    recs = [json.loads(line) for line in (ext / "metrics.jsonl").read_text().splitlines()]
    record = {"at_step": 16, "from_steps": 16, "to_steps": 24}
    assert [r for r in recs if "event" in r] == [{"step": 16, "event": "extended", **record}]
    trained = [r for r in recs if "event" not in r]
    assert [r["step"] for r in trained] == list(range(1, 25))
    before = [json.loads(line) for line in (straight_run / "metrics.jsonl").read_text().splitlines()]
    assert trained[:16] == before  # the steps before the resume point are untouched
    assert recs.index({"step": 16, "event": "extended", **record}) == 16  # the note sits at the resume point
    # from the resume point on, the learning rate follows the schedule over the new total: the WSD decay
    # of the 16-step run (steps 13-15) is undone and moves to the last steps of the 24
    peak = cfg.optim.lr
    assert before[-1]["lr"] < peak and trained[16]["lr"] == pytest.approx(peak)
    assert [r["lr"] for r in trained[16:]] == [lr_at(s, 24, peak, cfg.schedule) for s in range(16, 24)]
    assert trained[-1]["lr"] < peak
    assert load_checkpoint(checkpoint_dirs(ext)[-1]).meta["step"] == 24
    assert json.loads((ext / "meta.json").read_text())["extensions"] == [record]
    assert "steps: 24" in (ext / "config.yaml").read_text()
    # a later resume of the extended run (same config) keeps the record
    pretrain(cfg, ext, resume=True, quiet=True)
    assert json.loads((ext / "meta.json").read_text())["extensions"] == [record]
    assert [json.loads(line) for line in (ext / "metrics.jsonl").read_text().splitlines()] == recs


def test_data_stream_is_a_pure_function_of_the_step(straight_run):
    from ernie5.tokenizers.text import TextTokenizer
    from train.pretrain.data import MixtureStream, open_sources

    cfg = _cfg()
    tok = TextTokenizer.load(straight_run / "tokenizer.json")
    stream = MixtureStream(cfg.data, open_sources(cfg.data, None), tok, seed=0)
    a, b = stream.batch(5, 0), stream.batch(5, 0)
    assert (a.inputs.ids_BT == b.inputs.ids_BT).all() and (a.targets.ids_BT == b.targets.ids_BT).all()
    assert not (stream.batch(5, 1).inputs.ids_BT == a.inputs.ids_BT).all()  # another micro-batch / process
    assert a.inputs.ids_BT.shape == (cfg.data.batch_size, cfg.data.seq_len)


def test_init_from_starts_from_the_weights_of_another_run(straight_run, tmp_path):
    parent = load_checkpoint(checkpoint_dirs(straight_run)[-1])
    out = tmp_path / "child"
    pretrain(_cfg("train.steps=2", "train.ckpt_every=1", f"train.init_from={straight_run}"), out, quiet=True)
    first = load_checkpoint(checkpoint_dirs(out)[0])  # after one step at the warmup learning rate
    child_losses = _losses(out)
    fresh = _losses(straight_run)
    # the child starts where the parent ended (loss far below a fresh model's first steps)
    assert child_losses[0][1] < fresh[0][1] - 0.5
    assert (out / "tokenizer.json").read_text() == (straight_run / "tokenizer.json").read_text()
    moved = [
        float((a - b).abs().max())
        for a, b in zip(first.model.state_dict().values(), parent.model.state_dict().values(), strict=True)
        if a.is_floating_point()
    ]
    assert max(moved) < 0.05  # one small step away from the parent's weights


def test_init_from_with_another_model_config_is_a_run_error(straight_run, tmp_path):
    with pytest.raises(RunError, match="train.init_from: .* different model config"):
        pretrain(
            _cfg("train.steps=1", "model.n_layers=3", f"train.init_from={straight_run}"),
            tmp_path / "x",
            quiet=True,
        )
    with pytest.raises(RunError, match="train.init_from"):
        pretrain(_cfg("train.steps=1", f"train.init_from={tmp_path / 'nothing'}"), tmp_path / "y", quiet=True)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_trainer_runs_the_fast_paths_on_its_compute_replica(tmp_path, dtype):
    """The trainer applies the fast paths to the model it computes with, and its MoE layers record
    the expert gradients' sums of squares into that trainer's own mixed-precision pair."""
    from ernie5.fast import is_fast
    from ernie5.fast.moe import FastMoE
    from ernie5.model.moe import MoE
    from train.pretrain.loop import Trainer

    trainer = Trainer(_cfg(f"train.dtype={dtype}"), tmp_path / "run", resume=False, data_dir=None, quiet=True)
    trainer._setup()
    mp = trainer.precision
    assert is_fast(mp.compute)
    moes = [m for m in mp.compute.modules() if isinstance(m, MoE)]
    assert len(moes) == len(trainer.moe_layers) > 0
    assert all(
        isinstance(m, FastMoE) and m.grad_squares is mp.grad_squares and m.path == "auto" for m in moes
    )
    assert (mp.compute is trainer.model) == (dtype == "fp32")
    if dtype == "bf16":
        assert not is_fast(trainer.model)  # the fp32 master keeps the eager maths


def test_text_benchmark_train_splits_are_sources_in_the_harness_format(data_root):
    """``arc``, ``openbookqa``, ``svamp`` read only the train splits, in the tasks' own context, and
    answer with what the task scores (the correct choice's text; SVAMP's number)."""
    import random

    from ernie5.data import text as text_data
    from train.pretrain.data import SOURCES

    for name in ("arc", "openbookqa", "svamp"):
        if not (data_root / name).is_dir():
            pytest.skip(f"the data root has no {name}")
    rng = random.Random(0)
    arc = SOURCES["arc"](data_root)
    docs = {arc(rng) for _ in range(50)}
    assert all(d.startswith("Question: ") and "\nAnswer: " in d and d.endswith("\n") for d in docs)
    train_questions = {
        it.question.strip()
        for subset in ("Easy", "Challenge")
        for it in text_data.read_arc(data_root, subset, "train")
    }
    test_questions = {it.question.strip() for it in text_data.read_arc(data_root, "Easy", "test")}
    asked = {d.split("\n")[0][len("Question: ") :] for d in docs}
    assert asked <= train_questions and not asked & test_questions
    obqa = SOURCES["openbookqa"](data_root)(rng)
    item = next(
        it
        for it in text_data.read_openbookqa(data_root, "train")
        if obqa.startswith(f"Question: {it.question}")
    )
    assert obqa.endswith(f"Answer: {item.choices[item.answer]}\n")
    svamp_test = {it.question.strip() for it in text_data.read_svamp(data_root, "test")}
    svamp = SOURCES["svamp"](data_root)
    for _ in range(20):
        doc = svamp(rng)
        assert doc.split("\n")[0][len("Question: ") :] not in svamp_test
        float(doc.split("Answer: ")[1].strip().replace(",", ""))


def test_activation_checkpointing_recomputes_the_same_step(straight_run, tmp_path):
    out = tmp_path / "ac"
    pretrain(_cfg("train.parallel.activation_checkpoint=true"), out, quiet=True)
    assert _losses(out) == _losses(straight_run)


def test_resume_keeps_the_global_batch(straight_run, tmp_path):
    """How a run is spread may change at a resume (processes, sharding, expert split, micro-batches
    per process), as long as processes x micro-batches, the global batch, stays the same."""
    other = tmp_path / "other"
    shutil.copytree(straight_run, other)
    msg = r"train.grad_accum=2 x 1 process\(es\).*global batch is 1 x 1"
    with pytest.raises(RunError, match=msg) as info:
        pretrain(_cfg("train.grad_accum=2"), other, resume=True, quiet=True)
    assert "\n" not in str(info.value)
    pretrain(_cfg("train.parallel.ep=2", "train.parallel.dp_shard=1"), other, resume=True, quiet=True)
    assert _losses(other) == _losses(straight_run)


def test_log_with_tensorboard_mirrors_every_record_and_resume_continues_it(tmp_path):
    """``--log-with tensorboard``: each metrics.jsonl record's numbers at its step, the loss equal;
    a resumed run appends the later steps to the same folder."""
    from jobs.cli import main
    from tests.store.test_trackers import needs, tensorboard_scalars

    needs("tensorboard")

    run = tmp_path / "run"
    base = ["train", "--config", "micro", "--out", str(run), "--quiet", "--log-with", "tensorboard"]
    sets = ["train.log_every=1", "train.ckpt_every=2", "data.tokenizer_chars=20000"]
    args = [*base, *[x for s in sets for x in ("--set", s)]]
    assert main([*args, "--set", "train.steps=2"]) == 0
    assert main([*args, "--set", "train.steps=3", "--resume"]) == 0
    got = tensorboard_scalars(run / "tensorboard" / "run")
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "event" not in r]  # the resume's own note
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [s for s, _ in got["loss"]] == [1, 2, 3]
    assert [v for _, v in got["loss"]] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert {"lr", "tokens_per_s", "grad_norm"} <= set(got)


def test_log_with_an_unknown_tracker_is_one_line_before_any_work(tmp_path, capsys):
    from jobs.cli import main

    code = main(["train", "--config", "micro", "--out", str(tmp_path / "run"), "--log-with", "comet"])
    assert code == 2
    assert "--log-with 'comet': expected one of tensorboard, wandb, mlflow" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
