"""Special tokens reserved in the text vocabulary for every modality, at fixed ids 0..9."""

from __future__ import annotations

PAD, BOS, EOS, BOI, EOI, BOV, EOV, BOA, EOA, SEP = range(10)
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|boi|>",
    "<|eoi|>",
    "<|bov|>",
    "<|eov|>",
    "<|boa|>",
    "<|eoa|>",
    "<|sep|>",
)
"""Token strings, indexed by id: pad, begin/end of sequence, image, video, audio, and separator."""
N_SPECIAL = len(SPECIAL_TOKENS)
