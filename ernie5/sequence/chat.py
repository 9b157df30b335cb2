"""Instruction turns for supervised fine-tuning: a prompt that is context only, then a scored answer.

One turn is one document: ``BOS <prompt> <answer> EOS``, where the prompt (and BOS) carry no loss and
the answer, which ends with the task's stop text (``"\\n"``, or ``"\\n\\n"`` for the math word
problems), and EOS are the prediction targets. Turns are packed into rows like pretraining documents
(document masking keeps them apart), so a model is fine-tuned on exactly the text the evaluation
harness prompts it with and the continuation the harness scores or generates.

References:
  - Ouyang et al. 2022, https://arxiv.org/abs/2203.02155 (SFT: loss on the demonstration's answer).
  - Krell et al. 2021, https://arxiv.org/abs/2107.02027 (packing without cross-contamination).
  - ERNIE 5.0 technical report, post-training: SFT of the unified model over all modalities.

Deviations:
  1. No role tokens (``<user>``/``<assistant>``): the vocabulary is fixed (special ids 0..9 in
     :mod:`ernie5.tokenizers.special`) and the harness prompts in each task's own turn format
     (``Q: ...\\nA:``, ``Question: ...\\nAnswer:``, ``Transcript:``), so that format *is* the chat
     template; new role tokens would need new embedding rows and a template the harness never uses.
  2. One turn per document (no multi-turn conversations): every harness task is single-turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ernie5.sequence.segments import Segment, text_segment
from ernie5.tokenizers.special import BOS, EOS


@dataclass(frozen=True)
class Turn:
    """One instruction turn: ``prompt`` is context only; ``answer`` (its stop text included) is scored."""

    prompt: str
    answer: str


def split_ids(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of ``context`` and of ``continuation`` after it, as the harness splits them: the
    continuation is the tail of ``encode(context + continuation)`` when ``encode(context)`` is its
    prefix, else ``encode(continuation)`` alone (BPE merged across the boundary)."""
    ctx = tokenizer.encode(context)
    whole = tokenizer.encode(context + continuation)
    cont = whole[len(ctx) :] if whole[: len(ctx)] == ctx else tokenizer.encode(continuation)
    return ctx, cont


def turn_ids(tokenizer, turn: Turn) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a turn (see :func:`split_ids`)."""
    return split_ids(tokenizer, turn.prompt, turn.answer)


def context_segment(modality: str, ids: list[int] | tuple[int, ...]) -> Segment:
    """Token ids of ``modality`` that are context only (no position of them is a target)."""
    return Segment(
        modality,
        token_ids=torch.tensor(ids, dtype=torch.long),
        loss_mask=torch.zeros(len(ids), dtype=torch.bool),
    )


def chat_turn(prompt_ids: list[int], answer_ids: list[int]) -> list[Segment]:
    """The segments of one turn: ``BOS <prompt>`` without loss, then ``<answer> EOS`` with loss."""
    return [context_segment("text", [BOS, *prompt_ids]), text_segment([*answer_ids, EOS])]


def chat_turn_len(prompt_ids: list[int], answer_ids: list[int]) -> int:
    """Positions of :func:`chat_turn` (BOS and EOS included)."""
    return len(prompt_ids) + len(answer_ids) + 2


CUES = ("Answer:", "Caption:", "Transcript:")
"""Where the context of a media understanding text ends (the cue is context, what follows is scored)."""


def split_cue(text: str) -> tuple[str, str]:
    """``"Question: q\\nAnswer: 7\\n"`` -> ``("Question: q\\nAnswer:", " 7\\n")``: the text up to and
    including the first cue of :data:`CUES` (none: empty context) and the rest."""
    ends = [text.find(c) + len(c) for c in CUES if c in text]
    cut = min(ends) if ends else 0
    return text[:cut], text[cut:]
