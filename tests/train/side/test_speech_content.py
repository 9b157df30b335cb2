"""Speech-content encoder training: a run folder, a loss that falls, held-out WER on FSDD."""

from __future__ import annotations

import json

import pytest
import torch

from ernie5.config import load
from ernie5.data.root import DataMissing
from ernie5.tokenizers.speech_content import SpeechContentConfig, SpeechContentEncoder
from train.side.speech_content import SpeechContentTrainConfig, ctc_loss, pad_batch, train_speech_content


def tiny(**overrides) -> SpeechContentTrainConfig:
    base = dict(
        encoder=SpeechContentConfig(width=16, dilations=(1, 2)),
        steps=3,
        batch_size=4,
        log_every=1,
        fsdd_seq_pool=8,
        espeak_weight=0.0,
        ljspeech_weight=0.0,
    )
    return SpeechContentTrainConfig(**(base | overrides))


def test_no_data_at_all_is_a_recorded_data_missing(tmp_path):
    with pytest.raises(DataMissing):
        train_speech_content(tiny(), tmp_path / "run", data_dir=tmp_path)


def test_training_on_fsdd_writes_the_folder_and_scores_the_unseen_speaker(tmp_path, data_root):
    if not (data_root / "fsdd" / "recordings").is_dir():
        pytest.skip(f"no FSDD under {data_root}")
    summary = train_speech_content(tiny(), tmp_path / "run", data_dir=data_root)
    assert set(summary["sources"]) == {"fsdd", "fsdd_seq"}
    assert summary["heldout"]["fsdd_unseen"]["n"] == 500 and summary["heldout"]["fsdd_seen"]["n"] == 200
    assert load(SpeechContentTrainConfig, tmp_path / "run" / "config.yaml") == tiny()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    enc = SpeechContentEncoder.load(tmp_path / "run" / "encoder")
    assert enc.cfg == tiny().encoder


def test_ctc_loss_falls_when_overfitting_one_batch():
    torch.manual_seed(0)
    model = SpeechContentEncoder(SpeechContentConfig(width=32, dilations=(1, 2), dropout=0.0))
    g = torch.Generator().manual_seed(0)
    wave, n = pad_batch(
        [(torch.randn(6000, generator=g) * 0.2).numpy(), (torch.randn(4000, generator=g) * 0.2).numpy()]
    )
    texts = ["one two", "nine"]
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    first = None
    for _ in range(60):
        loss = ctc_loss(model, wave, n, texts)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first
    assert model.eval().transcribe(wave, n) == texts


def test_the_cli_trains_one_and_a_budget_stops_it_early(tmp_path, data_root, capsys):
    from jobs.cli import main

    if not (data_root / "fsdd" / "recordings").is_dir():
        pytest.skip(f"no FSDD under {data_root}")
    sets = [
        "encoder.width=16",
        "encoder.dilations=[1]",
        "steps=50",
        "batch_size=2",
        "espeak_weight=0",
        "ljspeech_weight=0",
        "fsdd_seq_pool=4",
    ]
    args = ["train-speech-encoder", "--out", str(tmp_path / "run"), "--data-dir", str(data_root)]
    assert main([*args, *[x for s in sets for x in ("--set", s)], "--time-budget", "0"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_early"] and summary["steps"] == 0
    assert (tmp_path / "run" / "encoder" / "meta.json").is_file()
