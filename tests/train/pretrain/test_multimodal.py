"""Pretraining on text, images and clips in one run (one router, no modality ids)."""

from __future__ import annotations

import json

import pytest
import torch

from ernie5.config import load
from ernie5.presets import resolve_config_path
from ernie5.store.checkpoint import checkpoint_dirs, load_checkpoint
from ernie5.tokenizers.vision import VisionTokenizer
from ernie5.tokenizers.vision_config import VisionTokenizerConfig
from train.common.run_folder import RunError
from train.pretrain.config import RunConfig
from train.pretrain.loop import pretrain


@pytest.fixture(scope="module")
def vtok_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = VisionTokenizerConfig(base_channels=8, channel_mult=(1, 2), norm_groups=4, latent_bits=6, mode="3d")
    return VisionTokenizer(cfg).save(tmp_path_factory.mktemp("vt") / "tok")


def _cfg(vtok_dir, *extra: str) -> RunConfig:
    return load(
        RunConfig,
        resolve_config_path("micro"),
        [
            "model.max_seq_len=512",
            "data.seq_len=512",
            "data.batch_size=2",
            "data.tokenizer_chars=20000",
            "model.vision.enabled=true",
            "model.vision.cnn_channels=16",
            "model.vision.latent_bits=6",
            "model.vision.vit_dim=16",
            "model.vision.vit_layers=1",
            "model.vision.vit_heads=2",
            "data.sources={procedural: 0.3, shapes: 0.5, moving_shapes: 0.2}",
            f"data.vision_tokenizer={vtok_dir}",
            "train.steps=8",
            "train.log_every=1",
            "train.ckpt_every=4",
            "train.loss_balance=posterior",
            *extra,
        ],
    )


def test_text_image_video_training_runs_and_resumes(vtok_dir, tmp_path):
    out = tmp_path / "run"
    pretrain(_cfg(vtok_dir), out, quiet=True)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("loss_text" in r for r in recs) and any("loss_vision_gen" in r for r in recs)
    assert any("loss_image" in r for r in recs) and any("loss_video" in r for r in recs)
    ckpt = load_checkpoint(checkpoint_dirs(out)[-1])
    assert ckpt.vision_tokenizer is not None and ckpt.model.vision is not None
    # exact resume with media in the mixture (bit flips and prompt dropout come from the batch's generator)
    resumed = tmp_path / "resumed"
    import shutil

    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000008")
    # ... its batches built by two data-loader workers this time (train.pretrain.prefetch): the same batches
    pretrain(_cfg(vtok_dir, "data.workers=2"), resumed, resume=True, quiet=True)
    a = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x)["loss"] for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert a == b


def test_media_sources_need_a_vision_tokenizer(vtok_dir, tmp_path):
    with pytest.raises(RunError, match="data.vision_tokenizer"):
        pretrain(_cfg(vtok_dir, "data.vision_tokenizer=''"), tmp_path / "x", quiet=True)
    with pytest.raises(RunError, match="does not fit"):
        pretrain(_cfg(vtok_dir, "model.vision.latent_bits=8"), tmp_path / "y", quiet=True)


@pytest.fixture(scope="module")
def codec_dir(tmp_path_factory):
    from ernie5.tokenizers.audio_codec import AudioCodec
    from ernie5.tokenizers.audio_config import AudioCodecConfig

    torch.manual_seed(0)
    cfg = AudioCodecConfig(channels=4, max_channels=16, latent_dim=8, n_levels=2, codebook_size=16)
    return AudioCodec(cfg).save(tmp_path_factory.mktemp("codec") / "codec")


def _audio_cfg(codec_dir, *extra: str) -> RunConfig:
    return load(
        RunConfig,
        resolve_config_path("micro"),
        [
            "model.max_seq_len=256",
            "data.seq_len=256",
            "data.batch_size=2",
            "data.tokenizer_chars=20000",
            "model.audio.enabled=true",
            "model.audio.n_levels=2",
            "model.audio.codebook_size=16",
            "data.sources={procedural: 0.4, dtmf: 0.6}",
            f"data.audio_codec={codec_dir}",
            "train.steps=6",
            "train.log_every=1",
            "train.ckpt_every=3",
            "train.loss_balance=posterior",
            *extra,
        ],
    )


def test_text_and_audio_training_runs_resumes_and_ships_the_codec(codec_dir, tmp_path):
    out = tmp_path / "run"
    pretrain(_audio_cfg(codec_dir), out, quiet=True)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("loss_audio_gen" in r for r in recs) and any("loss_audio" in r for r in recs)
    assert all(len(r["loss_audio_levels"]) == 2 for r in recs if "loss_audio_gen" in r)
    ckpt = load_checkpoint(checkpoint_dirs(out)[-1])
    assert ckpt.audio_codec is not None and ckpt.model.audio is not None
    import shutil

    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    pretrain(_audio_cfg(codec_dir), resumed, resume=True, quiet=True)
    a = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x)["loss"] for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert a == b


def test_audio_sources_need_a_fitting_codec(codec_dir, tmp_path):
    with pytest.raises(RunError, match="data.audio_codec"):
        pretrain(_audio_cfg(codec_dir, "data.audio_codec=''"), tmp_path / "x", quiet=True)
    with pytest.raises(RunError, match="does not fit"):
        pretrain(_audio_cfg(codec_dir, "model.audio.codebook_size=32"), tmp_path / "y", quiet=True)


@pytest.mark.parametrize("share", [0.0, 0.6, 1.0])
def test_media_understanding_sets_the_share_of_understanding_documents(share):
    import random

    from ernie5.data.vision_sources import open_media_source

    for name in ("shapes", "moving_shapes"):
        fn = open_media_source(name, None, 32, understanding=share)
        rng = random.Random(0)
        kinds = [fn(rng).kind for _ in range(300)]
        got = kinds.count("und") / len(kinds)
        assert got == pytest.approx(share, abs=0.07), (name, got)


def test_media_understanding_out_of_range_is_a_config_error():
    from ernie5.config import ConfigError
    from train.pretrain.config import DataConfig

    with pytest.raises((ConfigError, ValueError), match="media_understanding"):
        DataConfig(media_understanding=1.5)


def test_a_run_reuses_a_checkpoints_tokenizer_and_codec(tmp_path):
    """``data.vision_tokenizer``/``data.audio_codec`` may name a checkpoint (``reference``, the shipped
    one): the run trains with its frozen parts and ships them unchanged; a part that does not fit the
    model is a one-line error naming the key."""

    def cfg(*extra):
        return load(
            RunConfig,
            resolve_config_path("reference"),
            [
                "data.vision_tokenizer=reference",
                "data.audio_codec=reference",
                "data.batch_size=1",
                "data.tokenizer_chars=20000",
                "data.sources={procedural: 0.4, shapes: 0.3, dtmf: 0.3}",
                "train.steps=2",
                "train.ckpt_every=2",
                *extra,
            ],
        )

    out = tmp_path / "run"
    pretrain(cfg(), out, quiet=True)
    got, ref = load_checkpoint(checkpoint_dirs(out)[-1]), load_checkpoint("reference")
    for a, b in ((got.vision_tokenizer, ref.vision_tokenizer), (got.audio_codec, ref.audio_codec)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(RunError, match=r"data\.vision_tokenizer='reference': .*does not fit"):
        pretrain(cfg("model.vision.cnn_channels=32"), tmp_path / "x", quiet=True)


@pytest.fixture(scope="module")
def speech_dir(tmp_path_factory):
    from ernie5.tokenizers.speech_content import SpeechContentConfig, SpeechContentEncoder

    torch.manual_seed(0)
    enc = SpeechContentEncoder(SpeechContentConfig(width=8, dilations=(1,)))
    return enc.save(tmp_path_factory.mktemp("speech") / "encoder")


def test_understanding_frames_read_content_features_and_the_checkpoint_ships_the_encoder(
    codec_dir, speech_dir, tmp_path
):
    from ernie5.tokenizers.text import TextTokenizer
    from train.pretrain.data import MixtureStream, open_sources
    from train.pretrain.media import load_audio_codec

    extra = ("model.audio.content_dim=8", f"data.speech_encoder={speech_dir}")
    cfg = _audio_cfg(codec_dir, *extra, "data.sources={dtmf: 1.0}")
    tok = TextTokenizer.train(
        ["Transcript: one two three four five six seven eight nine zero star pound"] * 20, 300
    )
    stream = MixtureStream(cfg.data, open_sources(cfg.data, None), tok, 0, audio_codec=load_audio_codec(cfg))
    batch = stream.batch(0)
    a = batch.inputs.audio
    assert a.frame_feats_MF is not None and a.frame_feats_MF.shape == (a.frame_codes_MQ.shape[0], 8)
    has_feats = a.frame_feats_MF.abs().sum(-1).gt(0)
    # half of the DTMF documents are recognition (features), half synthesis (none: zeros)
    assert has_feats.any() and not has_feats.all()
    out = tmp_path / "run"
    pretrain(cfg, out, quiet=True)
    ckpt = load_checkpoint(checkpoint_dirs(out)[-1])
    assert ckpt.audio_codec.content_encoder is not None and ckpt.cfg.audio.content_dim == 8
    with pytest.raises(RunError, match="content_dim=8"):
        pretrain(_audio_cfg(codec_dir, "model.audio.content_dim=8"), tmp_path / "x", quiet=True)
