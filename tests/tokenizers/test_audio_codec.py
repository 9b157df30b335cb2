"""Audio codec: config validation, shapes, causality, RVQ (residual property, EMA, dead codes, dropout),
persistence, semantic teachers and the metric functions."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

from ernie5.config import ConfigError, dump, from_dict, load
from ernie5.tokenizers.audio_codec import AudioCodec, AudioCodecError, mel_distance, snr_db
from ernie5.tokenizers.audio_config import AudioCodecConfig
from ernie5.tokenizers.audio_quant import EMACodebook, ResidualVQ, code_usage, kmeans
from ernie5.tokenizers.audio_teacher import (
    MFCCKMeansTeacher,
    SemanticTeacher,
    build_teacher,
    load_teacher,
    pool_to_frames,
    resample_fft,
)
from tests.conftest import without_manifest


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one thread is faster than two on a busy machine (the shared conftest
    fixture restores the thread count afterwards)."""
    torch.set_num_threads(1)


def tiny_cfg(**overrides) -> AudioCodecConfig:
    base = dict(channels=4, max_channels=16, latent_dim=8, n_levels=3, codebook_size=16, teacher_dim=8)
    base.update(overrides)
    return AudioCodecConfig(**base)


def wave(B: int = 2, S: int = 3200, seed: int = 0) -> torch.Tensor:
    """Band-limited noise plus a tone, peak about 0.5."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(S) / 8000
    noise = torch.nn.functional.avg_pool1d(torch.randn(B, 1, S + 3, generator=g), 4, 1)[:, 0]
    return 0.3 * torch.sin(2 * math.pi * 440 * t) + 0.5 * noise


def clustered(M: int = 2048, D: int = 8, seed: int = 0) -> torch.Tensor:
    """Vectors with structure at several scales (so every RVQ level has something to explain)."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(6, D, generator=g)[torch.randint(0, 6, (M,), generator=g)]
    return 2.0 * coarse + 0.7 * torch.randn(M, D, generator=g)


def fitted_rvq(cfg: AudioCodecConfig, x_MD: torch.Tensor, steps: int = 15) -> ResidualVQ:
    rvq = ResidualVQ(cfg).train()
    z_BDN = x_MD.t()[None]
    for _ in range(steps):
        rvq(z_BDN)
    return rvq.eval()


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"strides": (4, 4, 4, 4)}, "frame rate sample_rate / prod(strides) = 8000 / 256 = 31.25 Hz"),
        ({"strides": (8, 8, 8, 8)}, "= 1.95312 Hz must be in [12.5, 25.0]"),
        ({"strides": ()}, "strides must have at least one stage"),
        ({"n_levels": 0}, "n_levels=0 must be >= 1"),
        ({"codebook_size": 1}, "codebook_size=1 must be >= 2"),
        ({"ema_decay": 1.0}, "ema_decay=1.0 must be in [0, 1)"),
        ({"dead_code_threshold": -0.1}, "dead_code_threshold=-0.1"),
        ({"quantizer_dropout": 1.5}, "quantizer_dropout=1.5 must be in [0, 1]"),
        ({"max_channels": 2}, "max_channels=2 must be >= channels=4"),
        ({"eps": 0.0}, "eps=0.0 must be > 0"),
        ({"distill_weight": -1.0}, "distill_weight=-1.0"),
    ],
)
def test_config_rejects(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_cfg(**overrides)


def test_config_yaml_round_trip_strict_keys_and_geometry(tmp_path):
    cfg = tiny_cfg(strides=(4, 4, 5, 8), teacher="none")
    assert cfg.hop == 640 and cfg.frame_rate == 12.5 and cfg.widths == (4, 8, 16, 16, 16)
    assert cfg.bitrate == 12.5 * 3 * 4
    path = tmp_path / "c.yaml"
    path.write_text(dump(cfg))
    assert load(AudioCodecConfig, path) == cfg
    with pytest.raises(ConfigError, match="unknown key 'n_level'"):
        from_dict(AudioCodecConfig, {"n_level": 4})
    with pytest.raises(ConfigError, match="teacher: 'hubert' is not one of"):
        from_dict(AudioCodecConfig, {"teacher": "hubert"})
    with pytest.raises(ConfigError, match=re.escape("n_levels=0 must be >= 1")):
        load(AudioCodecConfig, None, ["n_levels=0"])


# ---------------------------------------------------------------------- shapes
def test_shapes_frame_count_and_round_trip():
    codec = AudioCodec(tiny_cfg()).eval()
    assert (codec.hop, codec.frame_rate, codec.n_levels, codec.codebook_size) == (320, 25.0, 3, 16)
    assert [codec.n_frames(n) for n in (0, 1, 320, 321, 8000)] == [0, 1, 1, 2, 25]
    x = wave(2, 1000)
    codes = codec.encode(x)
    assert codes.shape == (2, 4, 3) and codes.dtype == torch.long
    assert int(codes.min()) >= 0 and int(codes.max()) < 16
    assert codec.encode(x, n_levels=2).equal(codes[..., :2])
    y = codec.decode(codes)
    assert y.shape == (2, 4 * 320) and float(y.abs().max()) <= 1.0
    assert codec.decode(codes, n_levels=1).shape == (2, 1280)
    out = codec(x)
    assert out.wave_BS.shape == x.shape and out.codes_BNQ.equal(codes)
    assert out.z_BDN.shape == out.quantized_BDN.shape == out.level1_BDN.shape == (2, 8, 4)
    assert out.n_q_B.tolist() == [3, 3]
    assert codec.semantic(out.level1_BDN).shape == (2, 4, 8)
    assert set(out.usage) == {"perplexity", "used_fraction"} and len(out.usage["perplexity"]) == 3


def test_bad_inputs_name_the_problem():
    codec = AudioCodec(tiny_cfg()).eval()
    with pytest.raises(ValueError, match=r"wave must be \(B, S\)"):
        codec.encode(torch.zeros(320))
    with pytest.raises(ValueError, match="wave has no samples"):
        codec.encode(torch.zeros(1, 0))
    codes = codec.encode(wave(1, 640))
    with pytest.raises(ValueError, match=r"n_levels=3 must be in \[1, 2\]"):
        codec.decode(codes[..., :2], n_levels=3)
    with pytest.raises(ValueError, match=r"codes must be in \[0, 16\)"):
        codec.decode(codes + 16)
    with pytest.raises(ValueError, match="codes must be long"):
        codec.decode(codes.int())
    with pytest.raises(ValueError, match=r"n_levels=4 must be in \[1, 3\]"):
        codec.encode(wave(1, 640), n_levels=4)


def test_non_causal_codec_keeps_the_frame_count():
    codec = AudioCodec(tiny_cfg(causal=False)).eval()
    assert codec.encode(wave(1, 1000)).shape == (1, 4, 3)
    assert codec.decode(codec.encode(wave(1, 1000))).shape == (1, 1280)


# ---------------------------------------------------------------------- causality
@pytest.mark.parametrize("n", [0, 3, 6])
def test_codes_of_frame_n_ignore_samples_after_it(n):
    codec = AudioCodec(tiny_cfg()).eval()
    hop, x = codec.hop, wave(1, 3200, seed=1)
    y = x.clone()
    y[:, (n + 1) * hop :] = torch.randn(1, 3200 - (n + 1) * hop)
    zx, zy = codec.encode_latent(x), codec.encode_latent(y)
    assert zx[..., : n + 1].equal(zy[..., : n + 1])
    assert not torch.allclose(zx[..., n + 1 :], zy[..., n + 1 :])  # the change is seen afterwards
    assert codec.encode(x)[:, : n + 1].equal(codec.encode(y)[:, : n + 1])
    # and one sample before the frame's end is seen by frame n
    y2 = x.clone()
    y2[:, (n + 1) * hop - 1] += 1.0
    assert not codec.encode_latent(y2)[..., n].equal(zx[..., n])


def test_decoded_samples_of_frame_n_ignore_later_codes():
    codec = AudioCodec(tiny_cfg()).eval()
    codes = codec.encode(wave(1, 3200))
    other = codes.clone()
    other[:, 5:] = (other[:, 5:] + 7) % 16
    a, b = codec.decode(codes), codec.decode(other)
    assert a[:, : 5 * codec.hop].equal(b[:, : 5 * codec.hop])
    assert not torch.allclose(a[:, 5 * codec.hop :], b[:, 5 * codec.hop :])


# ---------------------------------------------------------------------- RVQ
def test_residual_property_error_falls_with_every_level():
    cfg = tiny_cfg(n_levels=4, quantizer_dropout=0.0)
    x = clustered()
    rvq = fitted_rvq(cfg, x)
    z = x.t()[None]
    codes = rvq.encode(z)
    errors = [float((rvq.decode(codes, n_levels=n) - z).square().mean()) for n in range(1, 5)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.5 * errors[0]
    # encode/decode agree with the training-mode forward's output value in eval mode
    out = rvq(z)
    assert out.codes_BNQ.equal(codes) and torch.allclose(out.quantized_BDN, rvq.decode(codes), atol=1e-6)


def test_kmeans_init_runs_once_on_the_first_training_batch():
    cfg = tiny_cfg(quantizer_dropout=0.0)
    rvq = ResidualVQ(cfg)
    x = clustered()
    rvq.eval()(x.t()[None])
    assert not any(bool(b.initialized) for b in rvq.levels)  # eval never initialises
    before = rvq.levels[0].embedding.clone()
    rvq.train()(x.t()[None])
    assert all(bool(b.initialized) for b in rvq.levels)
    assert not rvq.levels[0].embedding.equal(before)
    centroids, _ = kmeans(x, 16, 10, torch.Generator().manual_seed(0))
    err_init = (x - rvq.levels[0].embedding[rvq.levels[0].quantize(x)]).square().mean()
    err_kmeans = (x - centroids[torch.cdist(x, centroids).argmin(1)]).square().mean()
    assert err_init < 1.5 * err_kmeans


def test_ema_update_follows_the_formula():
    book = EMACodebook(dim=2, codebook_size=4, decay=0.9, eps=1e-5, dead_code_threshold=0.0)
    book.cluster_usage.copy_(torch.tensor([4.0, 3.0, 2.0, 1.0]))
    book.embedding_sum.copy_(torch.arange(8.0).reshape(4, 2))
    x = torch.tensor([[1.0, 1.0], [3.0, 5.0], [0.0, 2.0]])
    codes = torch.tensor([0, 0, 2])
    assert book.update(x, codes) == 0
    usage = torch.tensor([4.0, 3.0, 2.0, 1.0]) * 0.9 + 0.1 * torch.tensor([2.0, 0.0, 1.0, 0.0])
    sums = torch.arange(8.0).reshape(4, 2) * 0.9 + 0.1 * torch.tensor([[4.0, 6.0], [0, 0], [0, 2.0], [0, 0]])
    assert torch.allclose(book.cluster_usage, usage)
    assert torch.allclose(book.embedding_sum, sums)
    n = usage.sum()
    smoothed = (usage + 1e-5) / (n + 4 * 1e-5) * n
    assert torch.allclose(book.embedding, sums / smoothed[:, None])


def test_dead_codes_restart_from_batch_vectors():
    book = EMACodebook(dim=3, codebook_size=8, decay=0.99, dead_code_threshold=0.1)
    book.cluster_usage.copy_(torch.tensor([10.0, 10, 10, 10, 10, 10, 0.5, 0.01]))
    book.embedding_sum.copy_(book.embedding * book.cluster_usage[:, None])
    x = torch.randn(50, 3) + 100.0  # far from every code: all assigned to code 0
    usage = 0.99 * book.cluster_usage.clone()
    usage[0] += 0.01 * 50
    share = float(usage.sum()) / 8  # the uniform share after the EMA step, before the restart
    n = book.update(x, torch.zeros(50, dtype=torch.long))
    assert n == 2  # codes 6 and 7 (below 0.1 of the uniform share); the others stay
    for k in (6, 7):
        assert any(torch.allclose(book.embedding[k], row, atol=1e-3) for row in x)
        assert float(book.cluster_usage[k]) == pytest.approx(share, rel=1e-5)
    assert all(float(book.embedding[k].abs().max()) < 50 for k in range(1, 6))
    # a restarted codebook now quantises the new data with the new codes too
    assert len(set(book.quantize(x).tolist())) >= 2


def test_quantizer_dropout_per_element_in_training_only():
    cfg = tiny_cfg(n_levels=4, quantizer_dropout=1.0)
    x = clustered(M=64 * 5)
    rvq = fitted_rvq(dataclasses.replace(cfg, quantizer_dropout=0.0), x)
    rvq.cfg = cfg  # same codebooks, dropout on
    z_BDN = x.reshape(64, 5, 8).transpose(1, 2)
    rvq.train()
    torch.manual_seed(0)
    out = rvq(z_BDN)
    assert set(out.n_q_B.tolist()) == {1, 2, 3, 4}
    assert out.codes_BNQ.shape == (64, 5, 4)  # every level is still coded
    rvq.eval()
    assert rvq(z_BDN).n_q_B.tolist() == [4] * 64
    rvq.cfg = dataclasses.replace(cfg, quantizer_dropout=0.0)
    assert rvq.train()(z_BDN).n_q_B.tolist() == [4] * 64


def test_quantizer_dropout_output_is_the_sum_of_the_used_levels():
    cfg = tiny_cfg(n_levels=3, quantizer_dropout=1.0)
    rvq = fitted_rvq(dataclasses.replace(cfg, quantizer_dropout=0.0), clustered(M=40 * 4))
    rvq.cfg = cfg
    books = [b.embedding.clone() for b in rvq.levels]
    z_BDN = clustered(M=40 * 4, seed=3).reshape(40, 4, 8).transpose(1, 2)
    out = rvq.train()(z_BDN)
    for b in range(40):
        n_q = int(out.n_q_B[b])
        q = sum(books[level][out.codes_BNQ[b, :, level]] for level in range(n_q))
        assert torch.allclose(out.quantized_BDN[b].t(), q, atol=1e-5)
        assert torch.allclose(out.level1_BDN[b].t(), books[0][out.codes_BNQ[b, :, 0]], atol=1e-5)


def test_straight_through_gradient_and_commitment():
    rvq = fitted_rvq(tiny_cfg(quantizer_dropout=0.0), clustered())
    z = clustered(M=40, seed=5).t()[None].clone().requires_grad_()
    out = rvq(z)
    g = torch.randn_like(z)
    (out.quantized_BDN * g).sum().backward(retain_graph=True)
    assert torch.allclose(z.grad, g)
    z.grad = None
    assert out.commit_loss.item() > 0
    out.commit_loss.backward()
    assert z.grad is not None and float(z.grad.abs().sum()) > 0


def test_code_usage_statistics():
    codes = torch.tensor([[[0, 1], [1, 1], [2, 1], [3, 1]]])
    usage = code_usage(codes, codebook_size=8)
    assert usage["perplexity"] == pytest.approx([4.0, 1.0])
    assert usage["used_fraction"] == pytest.approx([0.5, 0.125])


# ---------------------------------------------------------------------- persistence
def test_save_load_round_trip_gives_identical_codes(tmp_path):
    codec = AudioCodec(tiny_cfg())
    x = wave(2, 2000)
    codec.train()(x)  # k-means init + an EMA step: the buffers differ from a fresh codec's
    codes = codec.eval().encode(x)
    path = codec.save(tmp_path / "codec", meta={"note": "test"})
    loaded = AudioCodec.load(path)
    assert not loaded.training and loaded.cfg == codec.cfg
    assert loaded.encode(x).equal(codes)
    assert loaded.decode(codes).equal(codec.decode(codes))
    assert all(bool(b.initialized) for b in loaded.quantizer.levels)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["note"] == "test" and meta["n_params"] == sum(p.numel() for p in codec.parameters())
    assert not list(tmp_path.glob(".codec.tmp-*"))


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(AudioCodecError, match="missing meta.json"):
        AudioCodec.load(tmp_path)
    path = AudioCodec(tiny_cfg()).save(tmp_path / "c")
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "version": "other/0"}))
    with pytest.raises(AudioCodecError, match="version 'other/0'"):
        AudioCodec.load(path)
    path = AudioCodec(tiny_cfg()).save(tmp_path / "d")
    (path / "config.yaml").write_text(dump(tiny_cfg(latent_dim=4)))
    with pytest.raises(AudioCodecError, match=r"config\.yaml: sha256 differs from meta\.json"):
        AudioCodec.load(path)  # the manifest sees the edit first
    without_manifest(path)
    with pytest.raises(AudioCodecError, match="has shape"):
        AudioCodec.load(path)


# ---------------------------------------------------------------------- teachers
def test_pool_to_frames_shapes_and_alignment():
    feats = torch.arange(40.0).reshape(1, 40, 1).expand(2, 40, 3)
    pooled = pool_to_frames(feats, 10)
    assert pooled.shape == (2, 10, 3)
    assert pooled[0, :, 0].tolist() == [1.5 + 4 * i for i in range(10)]
    assert pool_to_frames(torch.ones(1, 7, 2), 3).equal(torch.ones(1, 3, 2))
    with pytest.raises(ValueError, match=r"features must be \(B, T, D\)"):
        pool_to_frames(torch.ones(7, 2), 3)


def test_mfcc_teacher_targets_fit_loss_and_save(tmp_path):
    codec = AudioCodec(tiny_cfg())
    teacher = MFCCKMeansTeacher(n_clusters=8)
    assert isinstance(teacher, SemanticTeacher) and teacher.target_dim == 8
    x = wave(3, 3000)
    feats = teacher.features(x, 8000)
    assert feats.shape == (3, 1 + 3000 // 80, 39)  # 10 ms hop, centred frames
    targets = codec.teacher_targets(teacher, x)
    assert targets.shape == (3, codec.n_frames(3000), 39)
    with pytest.raises(ValueError, match="not fitted"):
        teacher.assign(targets)
    teacher.fit(targets.reshape(-1, 39), seed=0, iters=10)
    ids = teacher.assign(targets)
    assert ids.shape == (3, 10) and int(ids.max()) < 8
    out = codec(x)
    loss = codec.distill_loss(teacher, out.level1_BDN, targets)
    assert loss.ndim == 0 and loss.item() > 0
    loss.backward()
    assert codec.semantic_head.weight.grad is not None
    assert codec.encoder.layers[0].weight.grad is not None  # through the straight-through level 1
    loaded = load_teacher(teacher.save(tmp_path / "teacher"))
    assert isinstance(loaded, MFCCKMeansTeacher) and loaded.assign(targets).equal(ids)
    assert build_teacher("none", 8) is None
    assert isinstance(build_teacher("mfcc_kmeans", 16), MFCCKMeansTeacher)


def test_resample_fft_is_band_limited_exact_for_periodic_signals():
    t8 = torch.arange(800) / 8000
    t16 = torch.arange(1600) / 16000
    x = torch.sin(2 * math.pi * 500 * t8)[None]
    y = resample_fft(x, 8000, 16000)
    assert y.shape == (1, 1600)
    assert torch.allclose(y[0], torch.sin(2 * math.pi * 500 * t16), atol=1e-4)


def test_whisper_teacher_with_a_tiny_random_config():
    transformers = pytest.importorskip("transformers")
    from ernie5.tokenizers.audio_teacher import WhisperTeacher

    config = transformers.WhisperConfig(
        d_model=16,
        encoder_layers=1,
        encoder_attention_heads=2,
        encoder_ffn_dim=32,
        num_mel_bins=80,
        max_source_positions=50,  # a 1 s window: 100 mel frames -> 50 encoder frames
    )
    teacher = WhisperTeacher.from_config(config)
    assert isinstance(teacher, SemanticTeacher) and teacher.target_dim == 16
    codec = AudioCodec(tiny_cfg(teacher="whisper", teacher_dim=16))
    x = wave(2, 6000)  # 0.75 s at 8 kHz -> 12000 samples at 16 kHz -> 38 encoder frames
    feats = teacher.features(x, 8000)
    assert feats.shape == (2, 38, 16)
    targets = codec.teacher_targets(teacher, x)
    assert targets.shape == (2, codec.n_frames(6000), 16)
    loss = codec.distill_loss(teacher, codec(x).level1_BDN, targets)
    assert 0.0 <= loss.item() <= 2.0
    with pytest.raises(ValueError, match="longer than one encoder window"):
        teacher.features(wave(1, 9000), 8000)


# ---------------------------------------------------------------------- metrics
def test_snr_and_mel_distance():
    x = wave(1, 4000)[0]
    assert snr_db(x, x) == math.inf
    assert snr_db(x, 0.9 * x) == pytest.approx(20.0)
    assert snr_db(x, torch.zeros_like(x)) == pytest.approx(0.0)
    assert snr_db(x.numpy(), x[:-10].numpy() * 0.9) == pytest.approx(20.0)
    assert mel_distance(x, x, 8000) == 0.0
    assert mel_distance(x, 0.5 * x, 8000) > mel_distance(x, 0.9 * x, 8000) > 0
