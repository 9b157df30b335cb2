"""Audio codec training: run folder, data-free (DTMF-only) training, overfitting, determinism, helpers."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from ernie5.config import ConfigError, from_dict, load
from ernie5.tokenizers.audio_codec import AudioCodec
from ernie5.tokenizers.audio_config import AudioCodecConfig
from ernie5.tokenizers.audio_teacher import MFCCKMeansTeacher, load_teacher
from train.common.optim import OptimConfig
from train.common.schedule import ScheduleConfig, lr_at
from train.side.audio_codec import (
    AudioCodecTrainConfig,
    AudioCrops,
    codec_loss,
    crop,
    multi_resolution_stft_loss,
    train_audio_codec,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one thread is faster than two on a busy machine (the shared conftest
    fixture restores the thread count afterwards)."""
    torch.set_num_threads(1)


def tiny_train_cfg(**overrides) -> AudioCodecTrainConfig:
    codec = AudioCodecConfig(
        channels=4, max_channels=8, latent_dim=8, n_levels=2, codebook_size=16, teacher_dim=8
    )
    base = dict(
        codec=codec,
        steps=3,
        batch_size=2,
        crop_s=(0.2, 0.3),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=1, min_lr_ratio=0.05),
        teacher_fit_crops=8,
        teacher_iters=5,
        eval_dtmf=3,
        eval_fsdd=4,
        log_every=1,
        fsdd_seq_pool=4,
    )
    base.update(overrides)
    return AudioCodecTrainConfig(**base)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_data_free_training_writes_the_run_folder(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "run"
    summary = train_audio_codec(tiny_train_cfg(), out, data_dir=empty)
    assert summary["sources"] == {"dtmf": 1.0}
    assert set(summary["eval"]) == {"dtmf_heldout"}
    for name in ("config.yaml", "meta.json", "metrics.jsonl", "summary.json"):
        assert (out / name).is_file(), name
    assert load(AudioCodecTrainConfig, out / "config.yaml") == tiny_train_cfg()
    meta = json.loads((out / "meta.json").read_text())
    assert {"git_hash", "versions", "seed"} <= set(meta)
    records = _records(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert {"loss", "stft", "mel", "wave_l1", "commit", "distill", "perplexity", "lr"} <= set(records[-1])
    dtmf = summary["eval"]["dtmf_heldout"]
    assert set(dtmf["levels"]) == {"1", "2"}
    assert {"snr_db", "mel_distance", "dtmf_exact"} <= set(dtmf["levels"]["2"])
    assert dtmf["dtmf_reference_exact"] == 1.0
    assert len(dtmf["usage"]["perplexity"]) == 2
    assert summary["steps"] == 3 and summary["n_params"] > 0
    assert summary["speed"]["encode_ms"] > 0 and summary["codes_per_s_audio"] == 50.0
    codec = AudioCodec.load(out / "codec")
    assert codec.cfg == tiny_train_cfg().codec
    teacher = load_teacher(out / "teacher")
    assert isinstance(teacher, MFCCKMeansTeacher) and teacher.fitted
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_training_is_deterministic(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    runs = []
    for name in ("a", "b"):
        train_audio_codec(tiny_train_cfg(steps=2), tmp_path / name, data_dir=empty)
        runs.append([{k: v for k, v in r.items() if k != "elapsed_s"} for r in _records(tmp_path / name)])
    assert runs[0] == runs[1]
    a = AudioCodec.load(tmp_path / "a" / "codec")
    b = AudioCodec.load(tmp_path / "b" / "codec")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_time_budget_stops_early(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    summary = train_audio_codec(tiny_train_cfg(steps=50), tmp_path / "run", data_dir=empty, time_budget_s=0.0)
    assert summary["stopped_early_at_step"] == 0 and summary["steps"] == 0


def test_loss_falls_when_overfitting_one_batch():
    torch.manual_seed(0)
    cfg = tiny_train_cfg(
        codec=AudioCodecConfig(
            channels=8,
            max_channels=16,
            latent_dim=16,
            n_levels=2,
            codebook_size=16,
            teacher="none",
            quantizer_dropout=0.0,
        )
    )
    data = AudioCrops.open(cfg, None)
    wave, sources = data.batch(2, random.Random(0))
    assert sources == ["dtmf", "dtmf"] and wave.shape[1] % 320 == 0
    codec = AudioCodec(cfg.codec).train()
    opt = torch.optim.Adam(codec.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss, terms = codec_loss(codec, wave, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:3])
    assert "distill" not in terms


def test_codec_loss_terms_with_the_teacher():
    cfg = tiny_train_cfg()
    codec = AudioCodec(cfg.codec).train()
    wave, _ = AudioCrops.open(cfg, None).batch(3, random.Random(1))
    teacher = MFCCKMeansTeacher(n_clusters=8)
    teacher.fit(codec.teacher_targets(teacher, wave).reshape(-1, 39), iters=3)
    loss, terms = codec_loss(codec, wave, cfg, teacher)
    assert loss.ndim == 0 and np.isfinite(loss.item())
    assert {"distill", "semantic_acc", "train_snr_db", "restarted"} <= set(terms)


def test_stft_loss_is_zero_for_identical_signals_and_positive_otherwise():
    x = torch.randn(2, 1600) * 0.1
    assert float(multi_resolution_stft_loss(x, x, ((64, 16), (256, 64)))) == pytest.approx(0.0, abs=1e-6)
    assert float(multi_resolution_stft_loss(x, 0.5 * x, ((64, 16), (256, 64)))) > 0.5


def test_helpers():
    rng = random.Random(0)
    w = np.arange(10, dtype=np.float32) + 1
    c = crop(w, 4, rng)
    assert len(c) == 4 and np.all(np.diff(c) == 1)  # a contiguous window
    c = crop(w, 16, rng)
    assert len(c) == 16 and np.count_nonzero(c) == 10 and c[c > 0].tolist() == w.tolist()
    cfg = tiny_train_cfg(
        steps=100,
        schedule=ScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.1),
        optim=OptimConfig(lr=1e-3, fused=False),
    )
    lr = [lr_at(s, cfg.steps, cfg.optim.lr, cfg.schedule) for s in (0, 9, 99)]
    assert lr[0] == pytest.approx(1e-4) and lr[1] == pytest.approx(1e-3)
    assert lr[2] == pytest.approx(1e-4, rel=1e-2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"crop_s": (0.5, 0.2)}, "crop_s=[0.5, 0.2] must satisfy 0 < low <= high"),
        ({"dtmf_weight": 0.0}, "dtmf_weight=0.0 must be > 0"),
        ({"schedule": ScheduleConfig(kind="wsd")}, "schedule.kind='wsd': expected 'cosine'"),
        ({"stft_resolutions": ((64, 128),)}, "need n_fft >= 2 and 1 <= hop <= n_fft"),
        ({"codec": AudioCodecConfig(teacher="whisper", teacher_dim=384)}, "needs whisper_source"),
    ],
)
def test_config_rejects(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_train_cfg(**overrides)


def test_config_strict_nested_keys():
    with pytest.raises(ConfigError, match="unknown key 'codec.n_level'"):
        from_dict(AudioCodecTrainConfig, {"codec": {"n_level": 3}})


def test_training_on_fsdd_evaluates_the_test_split(tmp_path, data_root):
    summary = train_audio_codec(tiny_train_cfg(steps=2), tmp_path / "run", data_dir=data_root)
    assert set(summary["sources"]) == {"dtmf", "fsdd", "fsdd_seq"}
    fsdd = summary["eval"]["fsdd_test"]
    assert fsdd["n_utterances"] == 4 and set(fsdd["levels"]) == {"1", "2"}
    assert "semantic_acc" in fsdd


def test_codec_training_pools_never_hold_the_unseen_speaker(data_root):
    import hashlib

    from ernie5.data.audio import FSDD_UNSEEN_SPEAKER, fsdd_utterances

    if not (data_root / "fsdd" / "recordings").is_dir():
        pytest.skip(f"no FSDD under {data_root}")

    def digest(w) -> str:
        return hashlib.sha1(np.asarray(w, np.float32).tobytes()).hexdigest()

    held_out = fsdd_utterances(data_root, "unseen")
    assert len(held_out) == 500 and {u.speaker for u in held_out} == {FSDD_UNSEEN_SPEAKER}
    by_len: dict[int, set[str]] = {}
    for u in held_out:
        by_len.setdefault(len(u.wave), set()).add(digest(u.wave))
    crops = AudioCrops.open(tiny_train_cfg(fsdd_seq_pool=40), data_root)
    assert len(crops.pools["fsdd"]) == 1800  # the seen speakers' train split
    assert not {digest(w) for w in crops.pools["fsdd"]} & set().union(*by_len.values())
    for w in crops.pools["fsdd_seq"]:  # a sequence starts with one of its recordings: never a held-out one
        assert not any(digest(w[:n]) in d for n, d in by_len.items() if n <= len(w))


def test_a_content_teacher_trains_the_codec_and_is_saved_with_it(tmp_path):
    from ernie5.tokenizers.speech_content import (
        ContentKMeansTeacher,
        SpeechContentConfig,
        SpeechContentEncoder,
    )

    enc_dir = SpeechContentEncoder(SpeechContentConfig(width=16, dilations=(1,))).save(tmp_path / "enc")
    codec = AudioCodecConfig(
        channels=4,
        max_channels=8,
        latent_dim=8,
        n_levels=2,
        codebook_size=16,
        teacher="content_kmeans",
        teacher_dim=8,
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = tiny_train_cfg(codec=codec, content_encoder=str(enc_dir))
    summary = train_audio_codec(cfg, tmp_path / "run", data_dir=empty)
    assert summary["teacher"]["kind"] == "content_kmeans"
    assert all("semantic_acc" in r and "distill" in r for r in _records(tmp_path / "run"))
    teacher = load_teacher(tmp_path / "run" / "teacher")
    assert isinstance(teacher, ContentKMeansTeacher) and teacher.fitted and teacher.target_dim == 8
    with pytest.raises(ValueError, match="needs content_encoder"):
        tiny_train_cfg(codec=codec)


def test_augmented_crops_change_speech_and_never_dtmf(data_root):
    base = AudioCrops.open(tiny_train_cfg(fsdd_seq_pool=4, dtmf_weight=0.01), data_root)
    aug = AudioCrops.open(tiny_train_cfg(fsdd_seq_pool=4, dtmf_weight=0.01, augment_p=1.0), data_root)
    if "fsdd" not in base.pools:
        pytest.skip(f"no FSDD under {data_root}")
    a, src_a = base.batch(6, random.Random(3))
    b, src_b = aug.batch(6, random.Random(3))
    assert src_a == src_b and a.shape == b.shape
    speech = [i for i, s in enumerate(src_a) if s != "dtmf"]
    assert speech and all(not torch.equal(a[i], b[i]) for i in speech)
