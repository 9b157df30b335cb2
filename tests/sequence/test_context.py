"""Prompt contexts as documents: the layout the harness and the RL engine share."""

from __future__ import annotations

import numpy as np
import pytest

from ernie5.sequence.context import ContextError, context_document
from ernie5.tokenizers.special import BOI, BOS, EOI


class _Tok:
    def encode(self, text: str) -> list[int]:
        return [100 + ord(c) % 50 for c in text]


class _Part:
    def __init__(self, modality, data, meta=None):
        self.modality, self.data, self.meta = modality, data, meta or {}


def test_text_context_is_bos_then_ids():
    doc = context_document("Q: 1+1=\nA:", _Tok())
    assert doc[0].token_ids.tolist() == [BOS]
    assert doc[1].token_ids.tolist() == _Tok().encode("Q: 1+1=\nA:")


def test_parts_in_order_and_empty_strings_skipped():
    from tests.conftest import micro_multimodal_parts

    model, _, vt, _ = micro_multimodal_parts()
    cfg = model.cfg.vision
    image = np.zeros((cfg.image_size, cfg.image_size, 3), dtype=np.uint8)
    doc = context_document(
        ("", _Part("image", image), "Question?"), _Tok(), vision_tokenizer=vt, vision_cfg=cfg
    )
    kinds = [s.kind for s in doc]
    assert kinds == ["ids", "ids", "und", "ids", "ids"]
    assert doc[1].token_ids.tolist() == [BOI] and doc[3].token_ids.tolist() == [EOI]


def test_media_without_its_model_is_a_one_line_error():
    with pytest.raises(ContextError, match="no vision tokenizer"):
        context_document((_Part("image", np.zeros((8, 8), np.uint8)),), _Tok())
    with pytest.raises(ContextError, match="no audio codec"):
        context_document((_Part("audio", np.zeros(80, np.float32)),), _Tok())
    with pytest.raises(ContextError, match="cannot read text inputs"):
        context_document((_Part("text", None),), _Tok())
