"""The Whisper teacher loads safetensors only, whether named directly or through a saved ``teacher.json``."""

from __future__ import annotations

import shutil

import pytest
import torch

from ernie5.tokenizers.audio_teacher import WhisperTeacher, load_teacher


@pytest.fixture(scope="module")
def whisper_dirs(tmp_path_factory):
    """A tiny random Whisper saved as safetensors, and the same weights as a pickled pytorch_model.bin."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("whisper")
    config = transformers.WhisperConfig(
        vocab_size=100,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_mel_bins=80,
        max_source_positions=50,
        max_target_positions=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    model = transformers.WhisperModel(config)
    model.save_pretrained(root / "safe")
    (root / "bin").mkdir()
    shutil.copy(root / "safe" / "config.json", root / "bin" / "config.json")
    torch.save(model.state_dict(), root / "bin" / "pytorch_model.bin")
    return root / "safe", root / "bin"


def test_safetensors_weights_load(whisper_dirs, tmp_path):
    safe, _ = whisper_dirs
    teacher = WhisperTeacher.from_pretrained(str(safe))
    assert teacher.target_dim == 16 and teacher.source == str(safe)
    again = load_teacher(teacher.save(tmp_path / "teacher"))
    assert isinstance(again, WhisperTeacher) and again.source == str(safe)


def test_pickled_weights_are_refused(whisper_dirs, tmp_path, monkeypatch):
    safe, pickled = whisper_dirs
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))
    with pytest.raises(ValueError, match="has no loadable safetensors weights") as err:
        WhisperTeacher.from_pretrained(str(pickled))
    assert str(pickled) in str(err.value) and "\n" not in str(err.value)

    # The same source read from a side model's teacher.json.
    teacher = WhisperTeacher.from_pretrained(str(safe))
    path = WhisperTeacher(teacher.encoder, source=str(pickled)).save(tmp_path / "teacher")
    with pytest.raises(ValueError, match="only safetensors are loaded"):
        load_teacher(path)


def test_a_missing_source_is_a_one_line_error(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="no-such-folder") as err:
        WhisperTeacher.from_pretrained(str(tmp_path / "no-such-folder"))
    assert "\n" not in str(err.value)


def test_content_teacher_saves_its_encoder_and_centroids(tmp_path):
    from ernie5.tokenizers.speech_content import (
        ContentKMeansTeacher,
        SpeechContentConfig,
        SpeechContentEncoder,
    )

    enc = SpeechContentEncoder(SpeechContentConfig(width=16, dilations=(1,)))
    teacher = ContentKMeansTeacher(enc, n_clusters=4)
    wave = torch.randn(3, 4000) * 0.1
    feats = teacher.features(wave, 8000)
    assert feats.shape == (3, enc.n_frames(4000), 16) and teacher.feature_dim == 16
    teacher.fit(feats.reshape(-1, 16), seed=0, iters=5)
    again = load_teacher(teacher.save(tmp_path / "teacher"))
    assert isinstance(again, ContentKMeansTeacher) and again.target_dim == 4
    assert torch.equal(again.assign(feats), teacher.assign(feats))
    assert torch.equal(again.features(wave, 8000), feats)
    with pytest.raises(ValueError, match="16000 Hz"):
        teacher.features(wave, 16000)
