"""Unified sequence format: segments packed into (B, T) with targets, documents and positions."""

from __future__ import annotations

import pytest
import torch

from ernie5.model.inputs import IGNORE
from ernie5.sequence.segments import MODALITY_ID, Segment, pack, text_segment
from ernie5.tokenizers.special import PAD


def test_pack_two_documents_in_one_row():
    b = pack([[text_segment([1, 20, 21, 2])], [text_segment([1, 30, 2])]], seq_len=8)
    assert b.inputs.ids_BT.tolist() == [[1, 20, 21, 2, 1, 30, 2, PAD]]
    assert b.inputs.doc_ids_BT.tolist() == [[0, 0, 0, 0, 1, 1, 1, -1]]
    # targets never cross a document boundary
    assert b.targets.ids_BT.tolist() == [[20, 21, 2, IGNORE, 30, 2, IGNORE, IGNORE]]
    # positions restart per document; t = h = w for text
    assert b.inputs.positions_3BT[0].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert torch.equal(b.inputs.positions_3BT[0], b.inputs.positions_3BT[1]) and torch.equal(
        b.inputs.positions_3BT[0], b.inputs.positions_3BT[2]
    )


def test_prompt_segment_without_loss():
    b = pack([[text_segment([1, 5, 6], loss=False), text_segment([7, 8])]], seq_len=5)
    assert b.targets.ids_BT.tolist() == [[IGNORE, IGNORE, 7, 8, IGNORE]]


def test_overflow_starts_a_new_row_and_long_documents_are_cut():
    b = pack(
        [[text_segment([1] * 5)], [text_segment([2] * 5)], [text_segment(list(range(10, 30)))]], seq_len=8
    )
    assert b.inputs.ids_BT.shape == (3, 8)
    assert b.inputs.ids_BT[2].tolist() == list(range(10, 18))
    with pytest.raises(ValueError, match="rows"):
        pack([[text_segment([1] * 5)], [text_segment([2] * 5)]], seq_len=8, n_rows=1)


def test_embedding_segments_have_no_loss_and_go_to_the_model():
    emb = torch.randn(3, 16)
    seg = Segment(
        "image",
        embeds=emb,
        block_ids=torch.zeros(3, dtype=torch.long),
        positions=torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 0]]),
    )
    b = pack([[text_segment([1, 3]), seg, text_segment([4, 5])]], seq_len=8)
    assert b.inputs.embed_mask_BT[0].tolist() == [False, False, True, True, True, False, False, False]
    assert torch.equal(b.inputs.embeds_MD, emb)
    assert b.modality[0, 2:5].tolist() == [MODALITY_ID["image"]] * 3
    # one image block: positions 2..4 share a block id, the text after it gets the next one
    assert b.inputs.block_ids_BT[0, :7].tolist() == [0, 1, 2, 2, 2, 3, 4]
    assert b.targets.ids_BT[0].tolist()[1:5] == [IGNORE, IGNORE, IGNORE, 4]


def test_segment_validation():
    with pytest.raises(ValueError, match="modality"):
        Segment("smell", token_ids=torch.tensor([1]))
    with pytest.raises(ValueError, match="exactly one"):
        Segment("text")


def test_packed_batch_runs_through_the_model(tiny_cfg):
    from ernie5.model.model import Ernie5Model

    m = Ernie5Model(tiny_cfg)
    b = pack([[text_segment([1, 5, 6, 7])], [text_segment([1, 9, 10])]], seq_len=10, n_rows=2)
    out = m(b.inputs, targets=b.targets)
    assert out.losses.text is not None and torch.isfinite(out.losses.text)
    # the text loss is the mean NLL of the packed targets (IGNORE positions left out)
    want = torch.nn.functional.cross_entropy(
        out.logits_BTV.flatten(0, 1).float(), b.targets.ids_BT.flatten(), ignore_index=IGNORE
    )
    torch.testing.assert_close(out.losses.text, want, rtol=1e-5, atol=1e-6)
