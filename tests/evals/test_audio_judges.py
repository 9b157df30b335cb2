"""Audio judges: CTC greedy decoding, the recogniser network, its cache, and the DTMF judge."""

from __future__ import annotations

import dataclasses
import json
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from ernie5.data.audio import SAMPLE_RATE, fsdd_sequences
from ernie5.data.dtmf import dtmf_sequences, dtmf_tone
from ernie5.data.root import DataMissing
from evals import audio_judges
from evals.audio_judges import (
    ASR_JUDGE_VERSION,
    BLANK,
    VOCAB,
    AsrRecipe,
    CtcDigitNet,
    DigitRecognizer,
    ctc_greedy_decode,
    dtmf_transcribe,
    load_digit_recognizer,
    text_to_ids,
)

TINY = AsrRecipe(hidden=8, channels=8, n_fsdd_seq=6, n_dtmf=2, epochs=1, batch_size=8, n_test_seq=3)


def _logits(path: list[int], n_classes: int = len(VOCAB)) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(path), n_classes).float()


def test_vocab_and_text_to_ids():
    assert VOCAB[BLANK] == "<blank>" and VOCAB[1:] == ("zero", "one", "two", "three", "four", "five", "six",
                                                        "seven", "eight", "nine")  # fmt: skip
    assert text_to_ids("Seven 3, zero!") == [8, 4, 1]
    assert text_to_ids("hello one") == [2]  # words outside the vocabulary are dropped


def test_ctc_greedy_decode_hand_made_logits():
    # "two two four": repeats merge, a blank separates the repeated word, trailing padding is ignored
    path = [0, 3, 3, 0, 3, 5, 5, 0, 9, 9]
    logits = torch.stack([_logits(path), _logits([0] * 10)])
    assert ctc_greedy_decode(logits, torch.tensor([8, 10])) == ["two two four", ""]
    assert ctc_greedy_decode(logits) == ["two two four eight", ""]


def test_network_shapes_and_batch_independence():
    torch.manual_seed(0)
    net = CtcDigitNet(channels=8, hidden=8).eval()
    judge = DigitRecognizer(net, ASR_JUDGE_VERSION, 0.0, 0.0, sum(p.numel() for p in net.parameters()))
    rng = np.random.default_rng(0)
    waves = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (4000, 1234, 80, 0)]
    samples = torch.tensor([len(w) for w in waves])
    assert CtcDigitNet.frame_lengths(samples).tolist() == [13, 4, 1, 1]
    feats = judge.features(waves)
    assert [f.shape for f in feats] == [(13, 16), (4, 16), (1, 16), (1, 16)]
    alone = judge.features([waves[1]])[0]
    np.testing.assert_allclose(feats[1], alone, atol=1e-5)  # padding in a batch changes nothing
    texts = judge.transcribe(waves)
    assert len(texts) == 4 and all(set(t.split()) <= set(VOCAB[1:]) for t in texts)
    assert judge.transcribe([]) == [] and judge.name == f"asr-v{ASR_JUDGE_VERSION}"
    logits, lengths = net(torch.zeros(2, 800), torch.tensor([800, 400]))
    assert logits.shape == (2, 3, len(VOCAB)) and lengths.tolist() == [3, 2]


def test_gradients_reach_every_parameter():
    net = CtcDigitNet(channels=8, hidden=8)
    logits, lengths = net(torch.randn(2, 1600) * 0.1, torch.tensor([1600, 1200]))
    loss = torch.nn.functional.ctc_loss(
        logits.log_softmax(-1).transpose(0, 1), torch.tensor([1, 2, 3]), lengths, torch.tensor([2, 1])
    )
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


def test_dtmf_transcribe_is_exact():
    utts = dtmf_sequences(40, 1, 6, seed=11)
    assert dtmf_transcribe([u.wave for u in utts]) == [u.text for u in utts]
    assert dtmf_transcribe([np.zeros(800, np.float32), dtmf_tone("#", 0.1)]) == ["", "pound"]


def _fake_fsdd(root: Path) -> Path:
    """A tiny FSDD lookalike: each digit is a 0.2 s tone of its own pitch (indices 0 test, 5-6 train)."""
    rec = root / "fsdd" / "recordings"
    rec.mkdir(parents=True)
    t = np.arange(1600) / SAMPLE_RATE
    for d in range(10):
        for i in (0, 5, 6):
            pcm = np.round(0.3 * np.sin(2 * np.pi * (300 + 150 * d) * t) * 32767).astype("<i2")
            with wave.open(str(rec / f"{d}_jackson_{i}.wav"), "wb") as f:
                (
                    f.setnchannels(1),
                    f.setsampwidth(2),
                    f.setframerate(SAMPLE_RATE),
                    f.writeframes(pcm.tobytes()),
                )
    return root


def test_cache_second_load_does_not_retrain(tmp_path, monkeypatch):
    monkeypatch.setenv("ERNIE5_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(audio_judges, "RECIPE", TINY)
    root = _fake_fsdd(tmp_path / "data")
    first = load_digit_recognizer(root)
    assert first.path.is_file() and first.path.name.startswith(f"asr-v{ASR_JUDGE_VERSION}-")
    meta = json.loads(first.path.with_suffix(".json").read_text())
    assert (
        meta["wer"] == first.wer and meta["cer"] == first.cer and meta["n"] == 3 and "train_seconds" in meta
    )
    assert first.n_params == sum(p.numel() for p in first.net.parameters())
    assert not list(first.path.parent.glob(".*tmp*"))  # atomic writes left no temporaries

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although the cache exists")

    monkeypatch.setattr(audio_judges, "train_recognizer", no_training)
    second = load_digit_recognizer(root)
    assert second.path == first.path and (second.wer, second.cer) == (first.wer, first.cer)
    waves = [u.wave for u in fsdd_sequences(root, "test", 3, seed=5)]
    assert second.transcribe(waves) == first.transcribe(waves)
    other = dataclasses.replace(TINY, epochs=2)  # another recipe is another cache entry
    monkeypatch.setattr(audio_judges, "train_recognizer", lambda train, recipe: CtcDigitNet(8, 8).eval())
    assert load_digit_recognizer(root, other).path != first.path


def test_missing_fsdd_is_data_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("ERNIE5_CACHE_DIR", str(tmp_path / "cache"))
    for root in (None, tmp_path):
        with pytest.raises(DataMissing, match="fsdd"):
            load_digit_recognizer(root)


@pytest.mark.slow
def test_trained_recognizer_on_heldout_fsdd(data_root, tmp_path, monkeypatch):
    """Trains the real recogniser (about 1-2 minutes on 2 cores) and checks its held-out figures."""
    if not (data_root / "fsdd" / "recordings").is_dir():
        pytest.skip(f"no FSDD under {data_root}")
    monkeypatch.setenv("ERNIE5_CACHE_DIR", str(tmp_path / "cache"))
    judge = load_digit_recognizer(data_root)
    assert judge.version == ASR_JUDGE_VERSION and judge.wer < 0.05 and judge.cer < 0.05
    test = fsdd_sequences(data_root, "test", 50, seed=99)
    hyps = judge.transcribe([u.wave for u in test])
    assert np.mean([h == u.text for h, u in zip(hyps, test)]) > 0.8
    assert judge.transcribe([np.zeros(SAMPLE_RATE, np.float32)]) == [""]
