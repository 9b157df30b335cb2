"""The speech-content encoder: shapes, length-aware normalisation, CTC helpers, save/load."""

from __future__ import annotations

import pytest
import torch

from ernie5.tokenizers.speech_content import (
    ALPHABET,
    SpeechContentConfig,
    SpeechContentEncoder,
    SpeechContentError,
    ctc_greedy,
    encode_text,
)

SMALL = SpeechContentConfig(width=16, dilations=(1, 2))


def test_features_are_50_hz_and_as_wide_as_the_config():
    enc = SpeechContentEncoder(SMALL).eval()
    wave = torch.randn(2, 8000) * 0.1
    feats = enc.features(wave)
    assert feats.shape == (2, enc.n_frames(8000), 16)
    assert enc.frame_rate == 50.0 and enc.n_frames(8000) == 51
    assert enc(wave).shape == (2, 51, 1 + len(ALPHABET))


def test_padding_does_not_change_an_utterances_normalised_log_mel():
    enc = SpeechContentEncoder(SMALL).eval()
    short = torch.randn(1, 4000) * 0.1
    padded = torch.cat([short, torch.zeros(1, 4000)], dim=1)
    a = enc.log_mel(short, torch.tensor([4000]))
    b = enc.log_mel(padded, torch.tensor([4000]))
    n = a.shape[-1]
    assert torch.allclose(a, b[..., :n], atol=1e-5)
    assert b[..., n:].abs().max() == 0  # frames past the utterance are zero


def test_ctc_text_round_trip():
    ids = encode_text("seven two")
    # the path repeats symbols and inserts blanks; greedy decoding undoes both
    path = [0, ids[0], ids[0], 0] + [x for i in ids[1:] for x in (i, 0)]
    assert ctc_greedy(path) == "seven two"
    with pytest.raises(ValueError, match="outside a-z"):
        encode_text("Seven!")


def test_save_and_load(tmp_path):
    enc = SpeechContentEncoder(SMALL).eval()
    enc.save(tmp_path / "enc")
    again = SpeechContentEncoder.load(tmp_path / "enc")
    wave = torch.randn(1, 3000) * 0.1
    assert torch.equal(enc.features(wave), again.features(wave))
    assert not any(p.requires_grad for p in again.parameters())
    (tmp_path / "enc" / "speech_content.safetensors").write_bytes(b"broken")
    with pytest.raises(SpeechContentError, match="speech_content.safetensors"):
        SpeechContentEncoder.load(tmp_path / "enc")
