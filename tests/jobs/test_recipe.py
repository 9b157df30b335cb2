"""``ernie5 recipe reference``: every stage, the export, resuming, and refusing a changed recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from ernie5.config import ConfigError
from jobs.cli import main
from jobs.recipe import hash_inputs, run_recipe, split_overrides

TINY = [
    "vision.steps=2",
    "vision.video_steps=1",
    "vision.batch_size=4",
    "vision.video_batch_size=2",
    "vision.video_image_batch_size=2",
    "vision.eval_images=4",
    "vision.eval_clips=2",
    "speech.steps=2",
    "speech.batch_size=2",
    "speech.espeak_utterances=8",
    "codec.steps=2",
    "codec.batch_size=2",
    "codec.teacher_fit_crops=8",
    "codec.teacher_iters=2",
    "codec.eval_dtmf=2",
    "refiner.steps=2",
    "refiner.batch_size=2",
    "refiner.eval_images=2",
    "refiner.eval_steps=[1]",
    "backbone.train.steps=2",
    "continue.train.steps=2",
    "continue.data.batch_size=1",
    "anneal.train.steps=2",
    "anneal.data.batch_size=1",
    "backbone.train.ckpt_every=1",
    "backbone.data.batch_size=1",
    "backbone.data.tokenizer_chars=20000",
]
"""The reference recipe at smoke scale (same shapes, a few steps per stage)."""


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("recipe") / "ref"
    run_recipe(out, None, overrides=TINY, quiet=True)
    return out


def test_the_recipe_trains_every_stage_and_exports_a_bf16_checkpoint(recipe_dir):
    from ernie5.store.checkpoint import load_checkpoint

    record = json.loads((recipe_dir / "recipe.json").read_text())
    assert set(record["stages"]) == {
        "vision",
        "speech",
        "codec",
        "refiner",
        "backbone",
        "anneal_a",
        "anneal_b",
        "soup1",
        "continue",
        "anneal2_a",
        "anneal2_b",
        "export",
    }
    assert all(record["stages"][s]["seconds"] > 0 for s in record["stages"])
    assert record["overrides"]["backbone"][0] == "train.steps=2"
    backbone_cfg = yaml.safe_load(record["stages"]["backbone"]["config"])
    assert backbone_cfg["data"]["speech_encoder"] == str(recipe_dir / "speech" / "encoder")
    ckpt = load_checkpoint(recipe_dir / "reference")
    assert ckpt.vision_tokenizer is not None and ckpt.audio_codec is not None and ckpt.refiner is not None
    assert ckpt.cfg.audio.content_dim == ckpt.audio_codec.content_encoder.cfg.width
    assert ckpt.cfg.moe.n_experts >= 64 and ckpt.cfg.moe.top_k >= 4  # the paper's fine-grained sparsity
    assert all(p.dtype == torch.float32 for p in ckpt.model.parameters())  # load_dtype upcasts
    params = {n for n, _ in ckpt.model.named_parameters()}
    with safe_open(recipe_dir / "reference" / "model.safetensors", "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert {dtypes[k] for k in dtypes if k in params} == {"BF16"}
    assert ckpt.meta["reference"]["recipe"]["preset"] == "reference"
    assert ckpt.meta["reference"]["step"] == 2
    # round 1: two anneals from the backbone's last checkpoint, their soup; the continuation starts from
    # that soup with its own seed and learning rate; round 2: two anneals from the continuation's last
    # checkpoint, whose soup is the export
    ckpts = {"anneal": "backbone", "anneal2": "continue"}
    for round_, start in ckpts.items():
        mixes = {}
        for mix in ("a", "b"):
            anneal = yaml.safe_load((recipe_dir / round_ / mix / "config.yaml").read_text())
            assert anneal["train"]["init_from"] == str(recipe_dir / start / "checkpoints" / "step_00000002")
            assert anneal["schedule"]["decay_frac"] == 1.0 and anneal["train"]["seed"] == 1
            mixes[mix] = anneal["data"]["sources"]
        assert mixes["a"] != mixes["b"]
    cont = yaml.safe_load((recipe_dir / "continue" / "config.yaml").read_text())
    assert cont["train"]["init_from"] == str(recipe_dir / "soup1")
    assert cont["train"]["seed"] == 2 and cont["optim"]["lr"] == 0.0005
    soup1 = load_checkpoint(recipe_dir / "soup1")
    assert [Path(p).parent.parent.parent.name for p in soup1.meta["reference"]["source_checkpoints"]] == [
        "anneal"
    ] * 2
    sources = ckpt.meta["reference"]["source_checkpoints"]
    assert [Path(p).parent.parent.name for p in sources] == ["a", "b"]
    assert {Path(p).parent.parent.parent.name for p in sources} == {"anneal2"}
    branches = [load_checkpoint(p, fast=False).model.state_dict() for p in sources]
    for name, p in ckpt.model.named_parameters():
        mean = ((branches[0][name].float() + branches[1][name].float()) / 2).to(torch.bfloat16).float()
        assert torch.equal(p.detach(), mean), name


def test_a_rerun_keeps_finished_stages_and_a_killed_stage_is_redone(recipe_dir, monkeypatch):
    import train.pretrain.loop
    import train.side.audio_codec
    import train.side.refiner
    import train.side.speech_content
    import train.side.vision_tokenizer

    def must_not_train(*args, **kwargs):
        raise AssertionError("a finished stage was trained again")

    for module, name in (
        (train.side.vision_tokenizer, "train_vision_tokenizer"),
        (train.side.speech_content, "train_speech_content"),
        (train.side.audio_codec, "train_audio_codec"),
        (train.pretrain.loop, "pretrain"),
    ):
        monkeypatch.setattr(module, name, must_not_train)
    # the refiner stage was killed: an incomplete folder and a temporary one are left
    (recipe_dir / "refiner" / "refiner" / "meta.json").unlink()
    (recipe_dir / ".refiner.tmp").mkdir()
    calls = []
    real = train.side.refiner.train_refiner

    def count(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(train.side.refiner, "train_refiner", count)
    run_recipe(recipe_dir, None, overrides=TINY, quiet=True)
    assert calls == [1] and (recipe_dir / "refiner" / "refiner" / "meta.json").is_file()
    assert not (recipe_dir / ".refiner.tmp").exists()


def test_a_resumed_recipe_must_keep_its_overrides(recipe_dir):
    with pytest.raises(ConfigError, match="started with backbone overrides"):
        run_recipe(recipe_dir, None, overrides=[o for o in TINY if o != "backbone.train.steps=2"])


def test_bad_overrides_are_one_line_errors_before_anything_is_written(tmp_path, capsys):
    assert main(["recipe", "reference", "--out", str(tmp_path / "r"), "--set", "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "expected STAGE.KEY=VALUE" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()
    assert split_overrides(["codec.steps=3"])["codec"] == ["steps=3"]


def test_inputs_are_hashed_per_data_folder(tmp_path):
    (tmp_path / "mnist").mkdir()
    (tmp_path / "mnist" / "a.gz").write_bytes(b"x")
    (tmp_path / "other").mkdir()  # not read by the recipe: not hashed
    (tmp_path / "other" / "b").write_bytes(b"y")
    inputs = hash_inputs(tmp_path)
    assert list(inputs) == ["mnist"] and inputs["mnist"]["n_files"] == 1
    assert list(inputs["mnist"]["files"]) == ["mnist/a.gz"]
    before = inputs["mnist"]["sha256"]
    (tmp_path / "mnist" / "a.gz").write_bytes(b"z")
    assert hash_inputs(tmp_path)["mnist"]["sha256"] != before
    assert hash_inputs(None) == {}
