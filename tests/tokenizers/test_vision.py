"""Vision tokenizer: shapes, exact code round trips, causality, inflation, persistence, training."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ernie5 import metrics
from ernie5.config import ConfigError, dump, from_dict
from ernie5.tokenizers.vision import (
    CausalConv3d,
    VisionTokenizer,
    VisionTokenizerError,
    clips_to_pixels,
    images_to_pixels,
    inflate,
    pixels_to_uint8,
    reconstruct,
)
from ernie5.tokenizers.vision_config import VisionTokenizerConfig
from ernie5.tokenizers.vision_losses import gradient_loss, perceptual_loss, ssim
from ernie5.tokenizers.vision_quant import area_downsample
from tests.conftest import without_manifest


def tiny_cfg(**overrides) -> VisionTokenizerConfig:
    base = dict(image_size=16, base_channels=8, norm_groups=4, latent_bits=6, scales=(1, 2, 4))
    base.update(overrides)
    return VisionTokenizerConfig(**base)


def pixels(B: int = 2, T: int = 1, size: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, 3, T, size, size, generator=g) * 2 - 1


def randomize_temporal(tok: VisionTokenizer, seed: int = 0) -> None:
    """Give every causal kernel non-zero weights in all temporal slices."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in tok.modules():
            if isinstance(m, CausalConv3d):
                m.weight.add_(0.3 * torch.randn(m.weight.shape, generator=g) * m.weight.std())


def smooth_latent(B: int, D: int, T: int, h: int, seed: int = 0) -> torch.Tensor:
    """A unit-norm latent with a global, a coarse and a fine component (like an encoder's)."""
    g = torch.Generator().manual_seed(seed)
    glob = torch.randn(B * T, D, 1, 1, generator=g)
    coarse = F.interpolate(torch.randn(B * T, D, 2, 2, generator=g), size=(h, h), mode="bilinear")
    z = glob + 0.7 * coarse + 0.3 * torch.randn(B * T, D, h, h, generator=g)
    return F.normalize(z, dim=1).reshape(B, T, D, h, h).transpose(1, 2)


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"scales": (1, 2, 8)}, "scales[-1]=8 must equal the latent grid side 4"),
        ({"scales": (2, 1, 4)}, "strictly increasing"),
        ({"image_size": 18}, "divisible by 2**len(channel_mult)=4"),
        ({"norm_groups": 3}, "norm_groups=3 must divide"),
        ({"latent_bits": 0}, "latent_bits=0"),
        ({"temporal_kernel": 0}, "temporal_kernel=0"),
        ({"channel_mult": ()}, "at least one stage"),
    ],
)
def test_config_rejects(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_cfg(**overrides)


def test_config_yaml_round_trip_and_strict_keys():
    cfg = tiny_cfg(phi=True, mode="3d")
    import yaml

    assert from_dict(VisionTokenizerConfig, yaml.safe_load(dump(cfg))) == cfg
    with pytest.raises(ConfigError, match="unknown key 'bits'"):
        from_dict(VisionTokenizerConfig, {"bits": 4})
    with pytest.raises(ConfigError, match="mode"):
        from_dict(VisionTokenizerConfig, {"mode": "4d"})
    assert VisionTokenizerConfig().latent_size == 8 and VisionTokenizerConfig().tokens_per_frame == 85


# ---------------------------------------------------------------------- shapes
@pytest.mark.parametrize(("mode", "T"), [("2d", 1), ("2d", 3), ("3d", 1), ("3d", 3)])
def test_shapes(mode, T):
    cfg = tiny_cfg(mode=mode)
    tok = VisionTokenizer(cfg)
    x = pixels(B=2, T=T)
    feats, z = tok.encode_features(x)
    assert feats.shape == (2, tok.feature_channels, T, 4, 4) and tok.feature_channels == 16
    assert z.shape == (2, 6, T, 4, 4)
    torch.testing.assert_close(z.norm(dim=1), torch.ones(2, T, 4, 4))
    codes = tok.quantize(z)
    assert [tuple(b.shape) for b in codes.bits] == [(2, T, n, n, 6) for n in cfg.scales]
    assert all(set(b.unique().tolist()) <= {-1.0, 1.0} for b in codes.bits)
    assert codes.f_hat.shape == z.shape
    assert [tuple(s.shape) for s in tok.scale_inputs(codes.bits)] == [(2, T, n, n, 6) for n in cfg.scales]
    x_rec = tok.decode(codes.f_hat)
    assert x_rec.shape == x.shape and x_rec.abs().max() <= 1


def test_default_tokenizer_shapes():
    tok = VisionTokenizer(VisionTokenizerConfig())
    codes = tok.encode(pixels(B=1, size=32))
    assert [tuple(b.shape) for b in codes.bits] == [(1, 1, n, n, 10) for n in (1, 2, 4, 8)]
    assert codes.f_hat.shape == (1, 10, 1, 8, 8) and tok.feature_channels == 64


def test_bad_inputs_raise():
    tok = VisionTokenizer(tiny_cfg())
    with pytest.raises(ValueError, match="pixels must be"):
        tok.encode_features(torch.zeros(2, 3, 16, 16))
    with pytest.raises(ValueError, match="n_bits=7"):
        tok.quantize(tok.encode_features(pixels())[1], n_bits=7)
    with pytest.raises(ValueError, match="expected"):
        tok.codes_to_fhat([torch.ones(1, 1, 2, 2, 6)] * 3)


# ---------------------------------------------------------------------- quantiser
@pytest.mark.parametrize(
    ("phi", "n_bits", "flip_prob"), [(False, None, 0.0), (True, None, 0.0), (False, 4, 0.2), (True, 3, 0.3)]
)
def test_codes_to_fhat_is_exact(phi, n_bits, flip_prob):
    tok = VisionTokenizer(tiny_cfg(phi=phi))
    z = tok.encode_features(pixels(T=2))[1]
    codes = tok.quantize(z, n_bits=n_bits, flip_prob=flip_prob, generator=torch.Generator().manual_seed(1))
    assert torch.equal(tok.codes_to_fhat(codes.input_bits), codes.f_hat)


def test_scale_inputs_are_downsampled_cumulative_and_predict_the_targets():
    tok = VisionTokenizer(tiny_cfg())
    z = tok.encode_features(pixels(B=3, T=2))[1]
    codes = tok.quantize(z)
    inputs = tok.scale_inputs(codes.bits)
    assert torch.equal(inputs[0], torch.zeros_like(inputs[0]))
    D = 6
    radius = tok.quantizer.log_radius.detach().exp()
    z_NDhw = z.transpose(1, 2).flatten(0, 1)
    f_hat = torch.zeros_like(z_NDhw)
    for k, n in enumerate(tok.cfg.scales):
        expect = area_downsample(f_hat, n).unflatten(0, (3, 2)).permute(0, 1, 3, 4, 2)
        torch.testing.assert_close(inputs[k], expect)
        # The target of scale k is the sign of the downsampled latent minus the scale's input.
        r = area_downsample(z_NDhw, n).unflatten(0, (3, 2)).permute(0, 1, 3, 4, 2) - inputs[k]
        agree = (torch.where(r >= 0, 1.0, -1.0) == codes.bits[k]).float().mean()
        assert agree > 0.99
        b = codes.bits[k].flatten(0, 1).permute(0, 3, 1, 2)
        f_hat = f_hat + F.interpolate(b * radius[k] / math.sqrt(D), size=(4, 4), mode="bilinear")


def test_more_scales_and_more_bits_explain_more_of_the_latent():
    tok = VisionTokenizer(tiny_cfg(latent_bits=8, scales=(1, 2, 4)))
    z = smooth_latent(B=16, D=8, T=1, h=4)
    codes = tok.quantize(z)
    errors = [z.square().mean().item()]
    for k in range(1, 4):
        bits = [b if j < k else torch.zeros_like(b) for j, b in enumerate(codes.bits)]
        errors.append((tok.codes_to_fhat(bits) - z).square().mean().item())
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    by_bits = [(tok.quantize(z, n_bits=n).f_hat - z).square().mean().item() for n in (2, 4, 6, 8)]
    assert all(a > b for a, b in zip(by_bits, by_bits[1:])), by_bits


def test_progressive_bit_depth_nests_codes():
    tok = VisionTokenizer(tiny_cfg(latent_bits=10))
    z = tok.encode_features(pixels(T=2))[1]
    full, low = tok.quantize(z), tok.quantize(z, n_bits=6)
    assert all(b.shape[-1] == 6 for b in low.bits) and low.n_bits == 6
    assert torch.equal(low.f_hat[:, 6:], torch.zeros_like(low.f_hat[:, 6:]))
    for b_low, b_full in zip(low.bits, full.bits):
        assert torch.equal(b_low, b_full[..., :6])
    torch.testing.assert_close(low.f_hat[:, :6], full.f_hat[:, :6])
    assert all(s[..., 6:].abs().max() == 0 for s in tok.scale_inputs(low.bits))


def test_bitwise_self_correction_flips():
    tok = VisionTokenizer(tiny_cfg())
    z = tok.encode_features(pixels(B=4, T=2))[1]
    clean = tok.quantize(z)
    assert clean.input_bits is clean.bits or all(a is b for a, b in zip(clean.input_bits, clean.bits))

    def run(seed):
        return tok.quantize(z, flip_prob=0.3, generator=torch.Generator().manual_seed(seed))

    a, b, c = run(5), run(5), run(6)
    for x, y in zip(a.bits + a.input_bits + [a.f_hat], b.bits + b.input_bits + [b.f_hat]):
        assert torch.equal(x, y)  # deterministic given the generator
    assert torch.equal(a.bits[0], clean.bits[0])  # the first target sees no corrupted history
    flipped = (a.input_bits[0] != a.bits[0]).float().mean()
    assert 0 < flipped < 0.7
    # later targets are recomputed from the corrupted cumulative map, so they move
    assert not all(torch.equal(x, y) for x, y in zip(a.bits[1:], clean.bits[1:]))
    assert not all(torch.equal(x, y) for x, y in zip(a.input_bits, c.input_bits))
    inputs = tok.scale_inputs(a.input_bits)
    z_NDhw = z.transpose(1, 2).flatten(0, 1)
    for k, n in enumerate(tok.cfg.scales):
        r = area_downsample(z_NDhw, n).unflatten(0, (4, 2)).permute(0, 1, 3, 4, 2) - inputs[k]
        assert (torch.where(r >= 0, 1.0, -1.0) == a.bits[k]).float().mean() > 0.99


def test_straight_through_gradients_reach_encoder_and_radii():
    tok = VisionTokenizer(tiny_cfg(phi=True))
    x_rec, codes = tok(pixels())
    (x_rec.square().mean() + codes.commit_loss).backward()
    for p in (
        tok.encoder.conv_in.weight,
        tok.encoder.proj.weight,
        tok.quantizer.log_radius,
        tok.quantizer.phi.weight,
    ):
        assert p.grad is not None and p.grad.abs().sum() > 0
    tok.zero_grad()
    _, codes = tok(pixels())
    codes.commit_loss.backward()
    assert tok.encoder.conv_in.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------- causal 3D
def test_causal_conv3d_matches_conv3d_with_front_replicate_padding():
    conv = CausalConv3d(4, 5, (3, 3, 3), stride=2)
    x_BTCHW = torch.randn(2, 5, 4, 8, 8)
    x_BCTHW = x_BTCHW.transpose(1, 2)
    padded = torch.cat([x_BCTHW[:, :, :1]] * 2 + [x_BCTHW], dim=2)
    ref = F.conv3d(padded, conv.weight, conv.bias, stride=(1, 2, 2), padding=(0, 1, 1))
    torch.testing.assert_close(conv(x_BTCHW), ref.transpose(1, 2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_temporal_causality(t):
    tok = VisionTokenizer(tiny_cfg(mode="3d"))
    randomize_temporal(tok)
    x = pixels(B=2, T=5)
    x2 = x.clone()
    x2[:, :, t:] = pixels(B=2, T=5 - t, seed=9)
    with torch.no_grad():
        (f1, z1), (f2, z2) = tok.encode_features(x), tok.encode_features(x2)
        c1, c2 = tok.quantize(z1), tok.quantize(z2)
        d1, d2 = tok.decode(c1.f_hat), tok.decode(c2.f_hat)
    assert torch.equal(f1[:, :, :t], f2[:, :, :t]) and torch.equal(z1[:, :, :t], z2[:, :, :t])
    for b1, b2 in zip(c1.bits, c2.bits):
        assert torch.equal(b1[:, :t], b2[:, :t])
    assert torch.equal(d1[:, :, :t], d2[:, :, :t])
    assert not torch.equal(z1[:, :, t], z2[:, :, t])  # the changed frame itself does change


def test_3d_tokenizer_uses_the_past():
    tok = VisionTokenizer(tiny_cfg(mode="3d"))
    randomize_temporal(tok)
    x = pixels(B=1, T=3)
    x2 = x.clone()
    x2[:, :, 0] = -x2[:, :, 0]
    with torch.no_grad():
        assert not torch.equal(tok.encode_features(x)[1][:, :, 1], tok.encode_features(x2)[1][:, :, 1])


def test_2d_mode_is_frame_by_frame():
    tok = VisionTokenizer(tiny_cfg())
    x = pixels(B=2, T=3)
    with torch.no_grad():
        feats, z = tok.encode_features(x)
        for t in range(3):
            ft, zt = tok.encode_features(x[:, :, t : t + 1])
            torch.testing.assert_close(ft[:, :, 0], feats[:, :, t])
            torch.testing.assert_close(zt[:, :, 0], z[:, :, t])


@pytest.mark.parametrize("phi", [False, True])
def test_inflation_reproduces_2d(phi):
    tok2d = VisionTokenizer(tiny_cfg(phi=phi))
    tok3d = inflate(tok2d)
    assert tok3d.cfg == dataclasses.replace(tok2d.cfg, mode="3d")
    assert isinstance(tok3d.encoder.conv_in, CausalConv3d) and tok3d.encoder.conv_in.weight.shape[2] == 3
    with torch.no_grad():
        for T in (1, 3):
            x = pixels(B=3, T=T)
            (f2, z2), (f3, z3) = tok2d.encode_features(x), tok3d.encode_features(x)
            torch.testing.assert_close(f3, f2)
            c2, c3 = tok2d.quantize(z2), tok3d.quantize(z3)
            for b2, b3 in zip(c2.bits, c3.bits):
                assert torch.equal(b2, b3)
            torch.testing.assert_close(tok3d.decode(c3.f_hat), tok2d.decode(c2.f_hat))
    with pytest.raises(ValueError, match="expects a 2d tokenizer"):
        inflate(tok3d)


# ---------------------------------------------------------------------- persistence and pixels
def test_save_load_round_trip(tmp_path):
    tok = VisionTokenizer(tiny_cfg(mode="3d", phi=True))
    randomize_temporal(tok)
    tok.save(tmp_path / "tok", meta={"step": 7})
    loaded = VisionTokenizer.load(tmp_path / "tok")
    assert loaded.cfg == tok.cfg
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    assert meta["step"] == 7 and meta["version"].startswith("ernie5-vision-tokenizer")
    x = pixels(T=2)
    with torch.no_grad():
        a, b = tok.encode(x), loaded.encode(x)
    assert all(torch.equal(p, q) for p, q in zip(a.bits, b.bits)) and torch.equal(a.f_hat, b.f_hat)
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda d: (d / "config.yaml").unlink(), "missing config.yaml"),
        (lambda d: (d / "meta.json").write_text('{"version": "other/9"}'), "version 'other/9'"),
        (lambda d: (d / "config.yaml").write_text(dump(tiny_cfg(latent_bits=5))), "has shape"),
        (lambda d: (d / "config.yaml").write_text(dump(tiny_cfg(n_res_blocks=2))), "does not match"),
        (lambda d: (d / "config.yaml").write_text("colours: 3\n"), "unknown key 'colours'"),
        (lambda d: (d / "tokenizer.safetensors").write_bytes(b"garbage"), "unreadable"),
    ],
)
def test_load_errors_are_one_line(tmp_path, corrupt, message):
    VisionTokenizer(tiny_cfg()).save(tmp_path / "tok")
    corrupt(tmp_path / "tok")
    without_manifest(
        tmp_path / "tok"
    )  # the manifest would name any edit first (tests/tokenizers/test_folder.py)
    with pytest.raises(VisionTokenizerError, match=message) as info:
        VisionTokenizer.load(tmp_path / "tok")
    assert "\n" not in str(info.value)


def test_pixel_conversions_round_trip():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(3, 16, 16, 3), dtype=np.uint8)
    x = images_to_pixels(images)
    assert x.shape == (3, 3, 1, 16, 16) and x.min() >= -1 and x.max() <= 1
    assert np.array_equal(pixels_to_uint8(x)[:, 0], images)
    clips = rng.integers(0, 256, size=(2, 4, 16, 16, 3), dtype=np.uint8)
    assert np.array_equal(pixels_to_uint8(clips_to_pixels(clips)), clips)
    tok = VisionTokenizer(tiny_cfg())
    assert reconstruct(tok, images).shape == images.shape and reconstruct(tok, clips).shape == clips.shape


# ---------------------------------------------------------------------- losses
def test_perceptual_terms():
    x = pixels(B=4).flatten(1, 2)
    assert ssim(x, x).item() == pytest.approx(1.0, abs=1e-6)
    assert gradient_loss(x, x).item() == 0.0
    y = (x + 0.3 * torch.randn_like(x)).clamp(-1, 1)
    ssim_loss, grad = perceptual_loss(y, x)
    assert 0 < ssim_loss.item() < 2 and grad.item() > 0
    # The training SSIM (on [-1, 1]) equals the eval metric (on uint8) up to rounding.
    a = pixels_to_uint8(x[:, :, None])[:, 0]
    b = pixels_to_uint8(y[:, :, None])[:, 0]
    xa, xb = images_to_pixels(a).flatten(1, 2), images_to_pixels(b).flatten(1, 2)
    assert ssim(xa, xb).item() == pytest.approx(metrics.ssim(a, b), abs=1e-4)


# ---------------------------------------------------------------------- training
def test_short_overfit_raises_psnr():
    cfg = tiny_cfg(image_size=32, base_channels=16, norm_groups=8, latent_bits=8, scales=(1, 2, 4, 8))
    torch.manual_seed(0)
    tok = VisionTokenizer(cfg)
    g = torch.Generator().manual_seed(0)
    # 16 images of coloured rectangles on black
    images = np.zeros((16, 32, 32, 3), dtype=np.uint8)
    for i in range(16):
        r0, c0 = torch.randint(0, 20, (2,), generator=g).tolist()
        h, w = torch.randint(6, 12, (2,), generator=g).tolist()
        images[i, r0 : r0 + h, c0 : c0 + w] = torch.randint(60, 256, (3,), generator=g).numpy()
    before = metrics.psnr(images, reconstruct(tok, images))
    x = images_to_pixels(images)
    opt = torch.optim.Adam(tok.parameters(), lr=3e-3)
    for _ in range(150):
        x_rec, codes = tok(x)
        loss = (x_rec - x).abs().mean() + (x_rec - x).square().mean() + codes.commit_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = metrics.psnr(images, reconstruct(tok, images))
    assert after > before + 10 and after > 20, (before, after)
