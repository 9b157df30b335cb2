"""Instruction turns (``ernie5.sequence.chat``) and the no-loss context of media and audio documents."""

from __future__ import annotations

import pytest
import torch

from ernie5.model.inputs import IGNORE
from ernie5.sequence.audio import audio_document
from ernie5.sequence.chat import Turn, chat_turn, chat_turn_len, split_cue, split_ids, turn_ids
from ernie5.sequence.segments import AudioSeg, Segment, pack
from ernie5.sequence.vision import media_document
from ernie5.tokenizers.special import BOA, BOI, BOS, EOA, EOI, EOS


@pytest.fixture(scope="module")
def tokenizer():
    from ernie5.tokenizers.text import TextTokenizer

    corpus = ["Q: 37+485=\nA: 522\n", "Question: Which digit is this?\nAnswer: 7\n", "Transcript: seven\n"]
    return TextTokenizer.train(corpus * 30, 300)


def _targets(docs: list[list[Segment]], seq_len: int = 64) -> list[int]:
    tgt = pack(docs, seq_len).targets.ids_BT[0]
    return tgt[tgt != IGNORE].tolist()


def test_a_turn_scores_its_answer_and_eos_only(tokenizer):
    turn = Turn("Q: 37+485=\nA:", " 522\n")
    p_ids, a_ids = turn_ids(tokenizer, turn)
    assert tokenizer.decode(p_ids) == turn.prompt and tokenizer.decode(a_ids) == turn.answer
    doc = chat_turn(p_ids, a_ids)
    assert sum(len(s) for s in doc) == chat_turn_len(p_ids, a_ids)
    assert _targets([doc]) == [*a_ids, EOS]
    batch = pack([doc], 64)
    assert batch.inputs.ids_BT[0, : chat_turn_len(p_ids, a_ids)].tolist() == [BOS, *p_ids, *a_ids, EOS]


def test_split_ids_follows_the_harness_boundary(tokenizer):
    ctx, cont = split_ids(tokenizer, "Question: Which digit is this?\nAnswer:", " 7\n")
    whole = tokenizer.encode("Question: Which digit is this?\nAnswer: 7\n")
    assert ctx == tokenizer.encode("Question: Which digit is this?\nAnswer:")
    assert ctx + cont == whole or cont == tokenizer.encode(" 7\n")


@pytest.mark.parametrize(
    ("text", "cue", "rest"),
    [
        ("Question: Which digit is this?\nAnswer: 7\n", "Question: Which digit is this?\nAnswer:", " 7\n"),
        ("Caption: a red circle.\n", "Caption:", " a red circle.\n"),
        ("Transcript: seven three\n", "Transcript:", " seven three\n"),
        ("no cue\n", "", "no cue\n"),
    ],
)
def test_split_cue(text, cue, rest):
    assert split_cue(text) == (cue, rest)


def _und_image() -> Segment:
    return Segment("image", embeds=torch.zeros(3, 4))


def test_media_document_without_context_is_unchanged():
    seg = _und_image()
    doc = media_document(seg, "und", 1, [], [20, 21])
    assert [s.token_ids.tolist() if s.token_ids is not None else "media" for s in doc] == [
        [BOS, BOI],
        "media",
        [EOI],
        [20, 21, EOS],
    ]
    gen = media_document(seg, "gen", 1, [30, 31], [])
    assert [s.token_ids.tolist() if s.token_ids is not None else "media" for s in gen] == [
        [BOS, 30, 31, BOI],
        "media",
        [EOI, EOS],
    ]


def test_context_ids_are_never_targets():
    und = media_document(_und_image(), "und", 1, [], [20, 21], context=[40, 41])
    assert _targets([und]) == [20, 21, EOS]
    gen = media_document(_und_image(), "gen", 1, [], [], context=[30, 31])
    assert _targets([gen]) == [BOI, EOI, EOS]  # the prompt is context; the markers keep their loss
    audio_und = Segment("audio", audio=AudioSeg(torch.zeros(2, 2, dtype=torch.long)))
    assert _targets([audio_document(audio_und, "und", [], [20], context=[40])]) == [20, EOS]
    audio_gen = Segment(
        "audio", audio=AudioSeg(torch.zeros(2, 2, dtype=torch.long), start=True, targets=True)
    )
    assert _targets([audio_document(audio_gen, "gen", [], [], context=[30, 31])]) == [BOA, EOA, EOS]
    assert _targets([audio_document(audio_gen, "gen", [30, 31], [])]) == [30, 31, BOA, EOA, EOS]
