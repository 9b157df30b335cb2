"""Supervised fine-tuning: the chat data stream (loss on answers only), ``train.pretrain.sft`` and
``ernie5 sft``."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from ernie5.config import ConfigError, load
from ernie5.model.inputs import IGNORE
from ernie5.presets import resolve_config_path
from ernie5.sequence.chat import CUES
from ernie5.store.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ernie5.tokenizers.special import BOA, BOI, BOV, EOA, EOI, EOS, EOV
from jobs.cli import main
from tests.conftest import micro_multimodal_parts
from train.pretrain.config import DataConfig, ElasticConfig, RunConfig
from train.pretrain.data import MixtureStream, open_sources
from train.pretrain.elastic import sample_subnet
from train.pretrain.sft import sft_config

MARKERS = {BOI, BOV, BOA, EOI, EOV, EOA, EOS}
"""Special tokens a generation document scores around its media."""
RUN = [
    "--set",
    "train.steps=4",
    "--set",
    "train.ckpt_every=2",
    "--set",
    "train.log_every=1",
    "--set",
    "train.dtype=fp32",
    "--set",
    "data.batch_size=2",
    "--quiet",
]


@pytest.fixture(scope="module")
def micro_mm_ckpt(tmp_path_factory) -> Path:
    """An untrained micro vision + audio checkpoint with its tokenizer, vision tokenizer and codec."""
    model, tok, vtok, codec = micro_multimodal_parts()
    path = tmp_path_factory.mktemp("sft") / "ckpt"
    save_checkpoint(path, model, tokenizer=tok, vision_tokenizer=vtok, audio_codec=codec)
    return path


@pytest.fixture(scope="module")
def sources_file(tmp_path_factory) -> Path:
    """A --config file of overrides: the always-available sources of every modality."""
    path = tmp_path_factory.mktemp("cfg") / "sft.yaml"
    path.write_text("data:\n  sources: {procedural: 0.4, shapes: 0.3, dtmf: 0.3}\n")
    return path


def _stream(ckpt_path: Path, sources: dict[str, float], fmt: str = "chat", **data) -> MixtureStream:
    ckpt = load_checkpoint(ckpt_path, fast=False)
    cfg = DataConfig(format=fmt, sources=sources, seq_len=512, batch_size=4, **data)
    opened = open_sources(cfg, None, ckpt.cfg.vision.image_size)
    vision = ckpt.cfg.vision
    return MixtureStream(cfg, opened, ckpt.tokenizer, 0, ckpt.vision_tokenizer, vision, ckpt.audio_codec)


def _documents(batch):
    """Per document of a batch: its ids, whether each position is a target (of the next position's
    id), and whether it holds vision or audio generation positions."""
    ids, tgt, doc = batch.inputs.ids_BT, batch.targets.ids_BT, batch.inputs.doc_ids_BT
    gen_masks = []
    if batch.inputs.vision is not None and batch.inputs.vision.gen_mask_BT is not None:
        gen_masks.append(batch.inputs.vision.gen_mask_BT)
    if batch.inputs.audio is not None and batch.inputs.audio.pred_mask_BT is not None:
        gen_masks.append(batch.inputs.audio.pred_mask_BT)
    for r in range(ids.shape[0]):
        for d in doc[r].unique().tolist():
            if d < 0:
                continue
            sel = (doc[r] == d).nonzero().flatten()
            d_ids, d_tgt = ids[r, sel].tolist(), tgt[r, sel].tolist()
            scored = [False] + [t != IGNORE for t in d_tgt[:-1]]  # position k is scored from k - 1
            is_gen = any(bool(m[r, sel].any()) for m in gen_masks)
            yield d_ids, scored, is_gen


def _check_answers_only(tokenizer, batch) -> dict[str, int]:
    """Assert that every scored text position of a chat batch is answer text, stop text or a marker;
    returns how many documents of each kind were seen."""
    seen = {"text": 0, "und": 0, "gen": 0}
    for ids, scored, is_gen in _documents(batch):
        words = [i for i, s in zip(ids, scored, strict=True) if s and i >= 10]
        if is_gen:  # the prompt is context; the markers and the media targets carry the loss
            assert {i for i, s in zip(ids, scored, strict=True) if s} <= MARKERS
            seen["gen"] += 1
            continue
        if len(ids) == 1:  # a lone BOS filling a row
            continue
        first = scored.index(True)
        assert all(scored[first:]), "the scored part is one answer at the end of the document"
        context = tokenizer.decode([i for i in ids[:first] if i >= 10])
        answer = tokenizer.decode(words)
        assert context.endswith((*CUES, "A:")), context
        assert ids[-1] == EOS and answer.endswith("\n") and answer.startswith(" ")
        assert not any(cue in answer for cue in (*CUES, "Q:", "Question:")), answer
        seen["und" if any(i in (BOI, BOV, BOA) for i in ids) else "text"] += 1
    return seen


def test_chat_batches_score_answers_only(micro_mm_ckpt):
    stream = _stream(micro_mm_ckpt, {"procedural": 0.4, "shapes": 0.3, "dtmf": 0.3})
    seen = {"text": 0, "und": 0, "gen": 0}
    for step in range(3):
        batch = stream.batch(step, 0)
        for k, v in _check_answers_only(stream.tokenizer, batch).items():
            seen[k] += v
    assert min(seen.values()) > 0, seen
    assert stream.batch(1, 0).inputs.ids_BT.equal(stream.batch(1, 0).inputs.ids_BT)  # pure in (step, index)


def test_generation_documents_keep_their_media_targets(micro_mm_ckpt):
    stream = _stream(micro_mm_ckpt, {"shapes": 0.5, "dtmf": 0.5}, media_understanding=0.0, cfg_dropout=0.0)
    batches = [stream.batch(step, 0) for step in range(3)]
    assert all(b.inputs.vision.gen.targets_PD is not None for b in batches)  # shapes: generation only
    assert any(b.inputs.audio is not None and b.inputs.audio.targets_PQ is not None for b in batches)
    gen_docs = [(ids, scored) for b in batches for ids, scored, is_gen in _documents(b) if is_gen]
    assert gen_docs and all(any(not s and i >= 10 for i, s in zip(*d, strict=True)) for d in gen_docs)
    assert all(_check_answers_only(stream.tokenizer, b)["gen"] for b in batches)


def test_text_turns_use_the_harness_formats(data_root):
    """Each QA source's turn is the harness task's context and scored continuation, ending in its stop."""
    from evals.tasks import babi, math_word
    from evals.tasks.multiple_choice import CONTEXT_TEMPLATE
    from train.pretrain.data import CHAT_SOURCES

    rng = random.Random(0)
    for name in ("babi", "gsm8k", "svamp", "arc", "openbookqa"):
        try:
            turn = CHAT_SOURCES[name](data_root)(rng)
        except Exception as e:  # noqa: BLE001 - a partial data root
            pytest.skip(f"{name}: {e}")
        assert turn.answer.startswith(" ") and not turn.answer.startswith("  ")
        if name == "babi":
            assert turn.prompt.endswith("\nAnswer:") and turn.answer.endswith(babi.STOP[0])
            assert turn.answer.count("\n") == 1
        elif name in ("gsm8k", "svamp"):
            assert turn.prompt.startswith("Question: ") and turn.prompt.endswith("\nAnswer:")
            assert turn.answer.endswith(math_word.STOP[0]) and turn.answer.count("\n\n") == 1
        else:
            question = turn.prompt[len("Question: ") : -len("\nAnswer:")]
            assert turn.prompt == CONTEXT_TEMPLATE.format(question=question) and turn.answer.endswith("\n")
    turn = CHAT_SOURCES["procedural"](None)(rng)
    assert turn.prompt.startswith("Q: ") and turn.prompt.endswith("\nA:") and turn.answer.endswith("\n")


def test_packed_mode_still_scores_every_text_token(micro_mm_ckpt):
    stream = _stream(micro_mm_ckpt, {"procedural": 1.0}, fmt="packed")
    for _ids, scored, _ in _documents(stream.batch(0, 0)):
        assert all(scored[1:]), "pretraining documents carry loss on every token after BOS"


def test_shakespeare_has_no_instruction_form():
    cfg = DataConfig(format="chat", sources={"shakespeare": 0.5, "procedural": 0.5})
    with pytest.raises(ValueError, match="'shakespeare' has no instruction form") as info:
        open_sources(cfg, None)
    assert "\n" not in str(info.value)


def test_sft_config_layers(micro_mm_ckpt, sources_file):
    cfg = sft_config(micro_mm_ckpt, sources_file, ["optim.lr=0.0002"])
    preset = load(RunConfig, resolve_config_path("sft"))
    assert cfg.model == load_checkpoint(micro_mm_ckpt).cfg
    assert cfg.train.init_from == str(micro_mm_ckpt.resolve())
    assert cfg.data.format == "chat" and cfg.data.sources == {"procedural": 0.4, "shapes": 0.3, "dtmf": 0.3}
    assert cfg.optim.lr == 0.0002 and cfg.train.steps == preset.train.steps == 300
    assert cfg.elastic == ElasticConfig() and cfg.elastic.enabled  # the pretraining probabilities
    with pytest.raises(ConfigError, match="model comes from the checkpoint"):
        sft_config(micro_mm_ckpt, None, ["model.n_layers=2"])
    with pytest.raises(CheckpointError):
        sft_config(micro_mm_ckpt.parent / "nothing")


def _losses(run: Path) -> list[tuple]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["loss_total"]) for r in recs]


@pytest.fixture(scope="module")
def sft_run(micro_mm_ckpt, sources_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft_run") / "run"
    args = ["sft", "--checkpoint", str(micro_mm_ckpt), "--out", str(out), "--config", str(sources_file)]
    assert main([*args, *RUN]) == 0
    return out


def test_sft_end_to_end_with_elastic_sampling(sft_run, micro_mm_ckpt):
    recs = [json.loads(line) for line in (sft_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    cfg = _stored(sft_run)
    assert cfg.data.format == "chat" and cfg.elastic.enabled
    for r in recs:  # every micro-batch ran the sub-model train.pretrain.elastic samples for its step
        _, dims = sample_subnet(cfg.elastic, cfg.model, cfg.train.seed, r["step"] - 1, 0)
        assert {k: v for k, v in r["subnets"][0].items() if k != "loss"} == dims
    ckpt = load_checkpoint(sft_run / "checkpoints" / "step_00000004")
    assert ckpt.vision_tokenizer is not None and ckpt.audio_codec is not None  # adopted from the parent
    assert (sft_run / "tokenizer.json").read_text() == (micro_mm_ckpt / "tokenizer.json").read_text()


def _stored(run: Path) -> RunConfig:
    return load(RunConfig, run / "config.yaml")


def test_resume_reproduces_the_losses(sft_run, micro_mm_ckpt, sources_file, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(sft_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    args = ["sft", "--checkpoint", str(micro_mm_ckpt), "--out", str(resumed), "--config", str(sources_file)]
    assert main([*args, *RUN, "--resume"]) == 0
    assert _losses(resumed) == _losses(sft_run)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("bad_checkpoint", "not a checkpoint or a run folder"),
        ("existing_run", "already holds a run; pass --resume"),
        ("bad_key", "train.nope"),
        ("model_key", "model comes from the checkpoint"),
    ],
)
def test_bad_inputs_are_one_line_errors(case, message, sft_run, micro_mm_ckpt, tmp_path, capsys):
    ckpt, out, extra = str(micro_mm_ckpt), str(tmp_path / "new"), []
    if case == "bad_checkpoint":
        ckpt = str(tmp_path / "missing")
    elif case == "existing_run":
        out = str(sft_run)
    elif case == "bad_key":
        extra = ["--set", "train.nope=1"]
    else:
        extra = ["--set", "model.n_layers=2"]
    assert main(["sft", "--checkpoint", ckpt, "--out", out, *extra, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ernie5 sft: error: ") and message in err and err.count("\n") == 1
