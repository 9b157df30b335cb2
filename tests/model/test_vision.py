"""Vision in the backbone: NFSP layout and masks, patch merger, teacher-forced loss, sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ernie5.generation.vision import generate_media
from ernie5.model.config import VisionConfig
from ernie5.model.inputs import IGNORE
from ernie5.model.model import Ernie5Model
from ernie5.model.vision import cell_centres, nfsp_layout, scale_loss_weights, und_layout
from ernie5.sequence.segments import pack, text_segment
from ernie5.sequence.vision import encode_media, generation_segment, to_pixels, understanding_segment
from ernie5.store.checkpoint import load_checkpoint, save_checkpoint
from ernie5.tokenizers.special import BOI, BOS, EOI
from ernie5.tokenizers.vision import VisionTokenizer
from ernie5.tokenizers.vision_config import VisionTokenizerConfig
from tests.conftest import tiny_config

VCFG = VisionConfig(enabled=True, cnn_channels=16, vit_dim=16, vit_layers=1, vit_heads=2, latent_bits=6)


@pytest.fixture(scope="module")
def vtok() -> VisionTokenizer:
    torch.manual_seed(0)
    cfg = VisionTokenizerConfig(base_channels=8, channel_mult=(1, 2), norm_groups=4, latent_bits=6, mode="3d")
    return VisionTokenizer(cfg).eval()


def _model(**kw) -> Ernie5Model:
    torch.manual_seed(0)
    return Ernie5Model(tiny_config(max_seq_len=512, vision=VCFG, **kw))


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)


def test_nfsp_layout_is_frame_major_scale_minor_with_centred_coordinates():
    lay = nfsp_layout(VCFG, n_frames=2)
    assert lay["positions"].shape == (3, 2 * 85)
    assert lay["block_ids"].unique().tolist() == list(range(8))  # one block per (frame, scale)
    assert lay["frame"][:85].eq(0).all() and lay["frame"][85:].eq(1).all()
    assert cell_centres(1, 8).tolist() == [7] and cell_centres(2, 8).tolist() == [3, 11]
    assert cell_centres(8, 8).tolist() == list(range(0, 15, 2))
    assert lay["positions"][0, :1].tolist() == [0] and lay["positions"][1:, 0].tolist() == [7, 7]
    w = scale_loss_weights(VCFG, 1)
    assert w.mean() == pytest.approx(1.0) and w[0] > w[-1]  # coarse scales weigh more


def test_understanding_layout_groups_patches():
    assert und_layout(VCFG, 1)["positions"].shape[1] == 16  # 2x2 groups of an 8x8 grid
    assert und_layout(VCFG, 8)["positions"].shape[1] == 32  # and 4 frames per group
    assert und_layout(VCFG, 1)["block_ids"].unique().tolist() == [0]  # one bidirectional block


def _gen_doc(vtok, images):
    enc = encode_media(vtok, to_pixels(images, clip=False), codes=True)
    segs = []
    for i in range(len(images)):
        bits = [b[i] for b in enc.bits]
        seg = generation_segment(vtok, VCFG, bits, bits)
        segs.append([text_segment([BOS, 20 + i, 21, BOI]), seg, text_segment([EOI])])  # a prompt per image
    return segs


def test_packed_generation_document(vtok):
    batch = pack(_gen_doc(vtok, _images(1)), seq_len=128)
    vision = batch.inputs.vision
    g = vision.gen
    assert vision.gen_mask_BT.sum() == 85 and g.targets_PD.shape == (85, 6)
    assert set(g.targets_PD.unique().tolist()) <= {0.0, 1.0}
    assert g.start_P.sum() == 1  # the first scale of the first frame starts from the start embedding
    gen_pos = vision.gen_mask_BT[0].nonzero().flatten()
    # no text target inside the image; the last image position predicts EOI
    tgt = batch.targets.ids_BT
    assert (tgt[0, gen_pos[:-1]] == IGNORE).all() and tgt[0, gen_pos[-1]] == EOI


def test_block_causal_mask_in_the_model(vtok):
    m = _model().eval()
    batch = pack(_gen_doc(vtok, _images(1)), seq_len=128)

    def hidden(b):
        with torch.no_grad():
            return m(b.inputs).hidden_BTD[0]

    base = hidden(batch)
    gen_pos = batch.inputs.vision.gen_mask_BT[0].nonzero().flatten()
    # perturb the input of the last scale (positions 21..84 of the image): earlier scales must not change,
    # every position of the last scale (one bidirectional block) must
    batch.inputs.vision.gen.inputs_PD[21:] += 1.0
    moved = hidden(batch)
    assert torch.allclose(base[gen_pos[:21]], moved[gen_pos[:21]], atol=1e-5)
    assert not torch.allclose(base[gen_pos[21]], moved[gen_pos[21]])
    assert not torch.allclose(base[gen_pos[21 + 63]], moved[gen_pos[21 + 63]])


def test_patch_merger_embeds_images_and_clips(vtok):
    m = _model()
    for frames, expected in ((1, 16), (4, 16), (8, 32)):
        clip = np.random.default_rng(frames).integers(0, 256, (frames, 32, 32, 3), dtype=np.uint8)
        enc = encode_media(vtok, to_pixels(clip, clip=True), codes=False)
        emb = m.vision.understanding_embeds(enc.pixels, enc.cnn)
        assert emb.shape == (expected, m.cfg.d_model)
        seg = understanding_segment(VCFG, enc.pixels[0], enc.cnn[0])
        assert len(seg) == expected


def test_nfsp_teacher_forced_loss_falls_when_overfitting(vtok):
    m = _model()
    batch = pack(_gen_doc(vtok, _images(2)), seq_len=128, n_rows=2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        out = m(batch.inputs, targets=batch.targets)
        opt.zero_grad()
        out.losses.vision.backward()
        opt.step()
        losses.append(float(out.losses.vision.detach()))
    assert losses[-1] < 0.5 * losses[0]


def test_understanding_answers_are_learned_from_the_image(vtok):
    # Four images, one question, four answers: only the merged image embeddings tell them apart.
    m = _model()
    enc = encode_media(vtok, to_pixels(_images(4, seed=3), clip=False), codes=False)
    docs = [
        [
            text_segment([BOS, BOI], loss=False),
            understanding_segment(VCFG, enc.pixels[i], enc.cnn[i]),
            text_segment([EOI], loss=False),
            text_segment([30, 31, 40 + i]),
        ]
        for i in range(4)
    ]
    batch = pack(docs, seq_len=32, n_rows=4, one_per_row=True)
    answer = (batch.targets.ids_BT >= 40) & (batch.targets.ids_BT < 44)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for _ in range(60):
        out = m(batch.inputs, targets=batch.targets)
        opt.zero_grad()
        out.losses.text.backward()
        opt.step()
    with torch.no_grad():
        logits = m(batch.inputs, targets=batch.targets, return_logits=True).logits_BTV
    assert logits[answer].argmax(-1).tolist() == [40, 41, 42, 43]


def test_generate_media_is_deterministic_and_shaped(vtok):
    m = _model().eval()
    a = generate_media(m, vtok, [[BOS, 5, 6], [BOS, 7]], n_frames=1, cfg_scale=2.0, seed=3)
    b = generate_media(m, vtok, [[BOS, 5, 6], [BOS, 7]], n_frames=1, cfg_scale=2.0, seed=3)
    assert a.shape == (2, 1, 32, 32, 3) and a.dtype == np.uint8 and np.array_equal(a, b)
    clip = generate_media(m, vtok, [[BOS, 5]], n_frames=2, cfg_scale=1.0, temperature=0.0)
    assert clip.shape == (1, 2, 32, 32, 3)
    with pytest.raises(ValueError, match="n_frames"):
        generate_media(m, vtok, [[BOS]], n_frames=99)


def test_checkpoint_carries_the_vision_tokenizer(vtok, tmp_path):
    m = _model()
    path = save_checkpoint(tmp_path / "c", m, vision_tokenizer=vtok)
    ck = load_checkpoint(path)
    assert ck.vision_tokenizer is not None
    x = to_pixels(_images(2), clip=False)
    assert torch.equal(ck.vision_tokenizer.encode(x).bits[-1], vtok.encode(x).bits[-1])


def test_conv_stem_gives_the_patch_stems_grid(vtok):
    from dataclasses import replace

    torch.manual_seed(0)
    conv = Ernie5Model(tiny_config(max_seq_len=512, vision=replace(VCFG, vit_stem="conv")))
    assert isinstance(conv.vision.vit.embed, torch.nn.Sequential)
    enc = encode_media(vtok, to_pixels(_images(2), clip=False), codes=False)
    emb = conv.vision.understanding_embeds(enc.pixels, enc.cnn)
    assert emb.shape == _model().vision.understanding_embeds(enc.pixels, enc.cnn).shape
    emb.sum().backward()
    assert conv.vision.vit.embed[0].weight.grad.abs().sum() > 0


def test_vision_config_checks_the_stem():
    with pytest.raises(ValueError, match=r"vit_stem='pixels': expected patch\|conv"):
        VisionConfig(enabled=True, vit_stem="pixels")
    with pytest.raises(ValueError, match="vit_stem='conv' needs a patch of 4 pixels, got .*=8"):
        VisionConfig(enabled=True, vit_stem="conv", latent_size=4, scales=(1, 2, 4))


def test_merger_positions_tell_the_order_of_frames():
    """Without positions the merger pools a set (frame order within a group is invisible); with them
    the same tokens in another frame order merge to another vector. Default off: no new parameters."""
    from dataclasses import replace

    from ernie5.model.vision import PatchMerger

    cells, frames = VCFG.merge * VCFG.merge, VCFG.merge_frames
    cnn = torch.randn(3, frames * cells, VCFG.cnn_channels)
    vit = torch.randn(3, frames * cells, VCFG.vit_dim)
    reverse = torch.arange(frames * cells).view(frames, cells).flip(0).reshape(-1)
    torch.manual_seed(0)
    plain = PatchMerger(VCFG, 32)
    assert not any("frame_emb" in k or "cell_emb" in k for k in plain.state_dict())
    torch.testing.assert_close(plain(cnn, vit), plain(cnn[:, reverse], vit[:, reverse]))
    torch.manual_seed(0)
    placed = PatchMerger(replace(VCFG, merger_positions=True), 32)
    with torch.no_grad():
        placed.frame_emb.normal_()
        placed.cell_emb.normal_()
    assert not torch.allclose(placed(cnn, vit), placed(cnn[:, reverse], vit[:, reverse]), atol=1e-4)
    image = placed(cnn[:, :cells], vit[:, :cells])  # an image's group: one frame
    assert image.shape == (3, 32)
