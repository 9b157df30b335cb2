"""Speech-content features beside the codes of understanding frames (``audio.content_dim > 0``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ernie5.model.config import AudioConfig
from ernie5.model.model import Ernie5Model
from ernie5.sequence.segments import AudioSeg, Segment, pack, text_segment
from ernie5.tokenizers.special import BOA, BOS, EOA
from tests.conftest import tiny_config

Q, K, F = 3, 16, 8


def _model(content_dim: int) -> Ernie5Model:
    torch.manual_seed(0)
    audio = AudioConfig(enabled=True, n_levels=Q, codebook_size=K, n_speakers=4, content_dim=content_dim)
    return Ernie5Model(tiny_config(max_seq_len=128, vocab_size=300, audio=audio)).eval()


def _und_doc(codes, feats=None) -> list[Segment]:
    return [
        text_segment([BOS, BOA], loss=False),
        Segment("audio", audio=AudioSeg(codes, feats_NF=feats)),
        text_segment([EOA, 11, 12]),
    ]


def _gen_doc(codes) -> list[Segment]:
    return [
        text_segment([BOS, 13, BOA], loss=False),
        Segment("audio", audio=AudioSeg(codes, start=True, speaker=1, targets=True)),
        text_segment([EOA]),
    ]


def _codes(n, seed=0):
    return torch.randint(0, K, (n, Q), generator=torch.Generator().manual_seed(seed))


def test_features_travel_with_their_frames_and_generated_frames_get_zeros():
    feats = torch.randn(5, F)
    batch = pack([_gen_doc(_codes(3)), _und_doc(_codes(5, 1), feats)], 64)
    a = batch.inputs.audio
    assert a.frame_codes_MQ.shape == (8, Q) and a.frame_feats_MF.shape == (8, F)
    assert a.frame_feats_MF[:3].abs().max() == 0  # the synthesis frames have none
    assert torch.equal(a.frame_feats_MF[3:], feats)
    assert pack([_und_doc(_codes(5))], 64).inputs.audio.frame_feats_MF is None
    with pytest.raises(ValueError, match="5 frames and 4 feature rows"):
        pack([_und_doc(_codes(5), torch.randn(4, F))], 64)


def test_the_projection_reads_features_and_adds_nothing_without_them():
    model = _model(F)
    batch = pack([_und_doc(_codes(5), torch.randn(5, F))], 64)
    bare = pack([_und_doc(_codes(5))], 64)
    zeros = pack([_und_doc(_codes(5), torch.zeros(5, F))], 64)
    with torch.no_grad():
        with_f = model(batch.inputs).hidden_BTD
        without = model(bare.inputs).hidden_BTD
        zero_f = model(zeros.inputs).hidden_BTD
    assert torch.equal(without, zero_f)  # bias-free: zero features add exactly 0
    assert not torch.allclose(with_f, without)
    # a model without the projection ignores features
    plain = _model(0)
    with torch.no_grad():
        assert torch.equal(plain(batch.inputs).hidden_BTD, plain(bare.inputs).hidden_BTD)
    with pytest.raises(ValueError, match="content_dim=-1"):
        AudioConfig(content_dim=-1)


def test_a_grown_model_starts_exactly_where_the_old_one_was(tmp_path):
    from ernie5.store.checkpoint import save_checkpoint
    from ernie5.tokenizers.text import TextTokenizer
    from train.common.run_folder import load_start

    old = _model(0)
    tok = TextTokenizer.train(["a b c d e f g"] * 20, 300)
    save_checkpoint(tmp_path / "old", old, tokenizer=tok)
    cfg = dataclasses.replace(old.cfg, audio=dataclasses.replace(old.cfg.audio, content_dim=F))
    grown = load_start(tmp_path / "old", cfg, "train.init_from")
    assert grown.cfg.audio.content_dim == F and grown.model.audio.content_proj is not None
    batch = pack([_und_doc(_codes(5), torch.randn(5, F))], 64)
    with torch.no_grad():
        assert torch.allclose(
            grown.model.eval()(batch.inputs).hidden_BTD, old(batch.inputs).hidden_BTD, atol=1e-6
        )
    other = dataclasses.replace(cfg, d_model=cfg.d_model * 2)
    with pytest.raises(Exception, match="different model config"):
        load_start(tmp_path / "old", other, "train.init_from")


def _codec_with_encoder():
    from ernie5.tokenizers.audio_codec import AudioCodec
    from ernie5.tokenizers.audio_config import AudioCodecConfig
    from ernie5.tokenizers.speech_content import SpeechContentConfig, SpeechContentEncoder

    torch.manual_seed(0)
    codec = AudioCodec(
        AudioCodecConfig(channels=4, max_channels=16, latent_dim=8, n_levels=Q, codebook_size=K)
    )
    enc = SpeechContentEncoder(SpeechContentConfig(width=F, dilations=(1,)))
    return codec.eval(), enc.eval()


def test_content_features_lie_on_the_codec_frame_grid():
    import numpy as np

    from ernie5.sequence.audio import content_features, encode_waves

    codec, enc = _codec_with_encoder()
    waves = [
        np.random.default_rng(i).standard_normal(n).astype(np.float32) * 0.1
        for i, n in enumerate((800, 3000, 7))
    ]
    codes = encode_waves(codec, waves)
    feats = content_features(enc, codec, waves)
    assert [f.shape for f in feats] == [(len(c), F) for c in codes]
    # one utterance alone or batched with longer ones: the same features (statistics over its own samples)
    (alone,) = content_features(enc, codec, waves[:1])
    assert torch.allclose(alone, feats[0], atol=1e-5)


def test_a_checkpoint_keeps_the_encoder_with_its_codec(tmp_path):
    from ernie5.store.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from ernie5.tokenizers.text import TextTokenizer

    codec, enc = _codec_with_encoder()
    model = _model(F)
    tok = TextTokenizer.train(["a b c d e f g"] * 20, 300)
    save_checkpoint(tmp_path / "ck", model, tokenizer=tok, audio_codec=codec.attach_content_encoder(enc))
    ckpt = load_checkpoint(tmp_path / "ck", fast=False)
    again = ckpt.audio_codec.content_encoder
    assert again is not None and again.cfg == enc.cfg
    assert "content_encoder" not in "".join(ckpt.audio_codec.state_dict())  # not part of the codec's weights
    ckpt.audio_codec.double()  # moves and casts follow the codec
    assert next(again.parameters()).dtype == torch.float64
    ckpt.audio_codec.float()
    wave = torch.randn(1, 2000) * 0.1
    assert torch.equal(again.features(wave), enc.features(wave))
    save_checkpoint(tmp_path / "bare", model, tokenizer=tok, audio_codec=codec.attach_content_encoder(None))
    with pytest.raises(CheckpointError, match="audio.content_dim=8"):
        load_checkpoint(tmp_path / "bare", fast=False)
