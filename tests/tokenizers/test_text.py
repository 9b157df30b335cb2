"""Tests of the byte-level BPE text tokenizer."""

from __future__ import annotations

import pickle
import random

import pytest
from tokenizers import pre_tokenizers

from ernie5.tokenizers.special import EOS, N_SPECIAL, SPECIAL_TOKENS
from ernie5.tokenizers.text import MIN_VOCAB_SIZE, TextTokenizer, TokenizerError

PARAGRAPH = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
    "And by opposing end them. To die—to sleep,\n"
    "No more; and by a sleep to say we end\n"
    "The heart-ache and the thousand natural shocks\n"
    "That flesh is heir to: 'tis a consummation\n"
    "Devoutly to be wish'd. To die, to sleep;\n"
    "To sleep, perchance to dream—ay, there's the rub:\n"
)
CORPUS = [PARAGRAPH] * 20 + ["统一的多模态模型 理解与生成 😀👍🏽", "naïve café, Ünïcödé — ok?"] * 5
RANDOM_BYTES = bytes(random.Random(0).randrange(256) for _ in range(300)).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.train(CORPUS, vocab_size=400)


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "a",
        "hello world",
        "  leading and trailing  ",
        "multiple     spaces\tand\ttabs",
        "line\r\nbreak\rcarriage\nnewline\n\n",
        "emoji 😀👍🏽👨‍👩‍👧 done",
        "汉字和かなと한국어",
        "control \x00\x01\x1b[31m\x7f chars",
        "<|eos|>",
        "text <|bos|> with <|pad|><|sep|> specials",
        "<|eos",
        "\ufeffbom and \u200bzero width",
        "combining e\u0301 vs é (not normalised)",
        RANDOM_BYTES,
        PARAGRAPH,
        PARAGRAPH * 3,
    ],
)
def test_round_trip(tok: TextTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(N_SPECIAL <= i < tok.vocab_size for i in ids)  # raw text never yields a special id
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, text]) == [ids, ids]


def test_merges_compress_training_text(tok: TextTokenizer) -> None:
    assert len(tok.encode(PARAGRAPH)) < len(PARAGRAPH.encode()) / 2


@pytest.mark.parametrize("i, token", list(enumerate(SPECIAL_TOKENS)))
def test_special_ids_fixed(tok: TextTokenizer, i: int, token: str) -> None:
    assert tok.special_id(token) == i
    assert tok.special_id(token[2:-2]) == i
    assert tok.decode([i]) == token


def test_special_ids_decode_inline(tok: TextTokenizer) -> None:
    assert tok.decode([*tok.encode("hi"), EOS, *tok.encode(" there")]) == "hi<|eos|> there"


def test_unknown_special_name(tok: TextTokenizer) -> None:
    with pytest.raises(KeyError, match="unknown special token"):
        tok.special_id("nope")


def test_byte_alphabet_follows_specials(tok: TextTokenizer) -> None:
    byte_tokens = {tok._tok.id_to_token(i) for i in range(N_SPECIAL, MIN_VOCAB_SIZE)}
    assert byte_tokens == set(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 300, 400])
def test_vocab_size_respected(vocab_size: int) -> None:
    tok = TextTokenizer.train(CORPUS, vocab_size=vocab_size)
    assert MIN_VOCAB_SIZE <= tok.vocab_size <= vocab_size
    assert tok.decode(tok.encode(PARAGRAPH)) == PARAGRAPH


def test_vocab_size_too_small() -> None:
    with pytest.raises(ValueError, match="vocab_size=265 must be >= 266"):
        TextTokenizer.train(CORPUS, vocab_size=265)


@pytest.mark.parametrize("bad", [-1, 400])
def test_decode_rejects_out_of_range_ids(tok: TextTokenizer, bad: int) -> None:
    with pytest.raises(ValueError, match=f"token id {bad} is outside"):
        tok.decode([5, bad])


def test_deterministic(tok: TextTokenizer, tmp_path) -> None:
    again = TextTokenizer.train(iter(CORPUS), vocab_size=400)
    assert tok.save(tmp_path / "a.json").read_bytes() == again.save(tmp_path / "b.json").read_bytes()


@pytest.mark.parametrize("into_dir", [False, True])
def test_save_load(tok: TextTokenizer, tmp_path, into_dir: bool) -> None:
    target = tmp_path if into_dir else tmp_path / "tok.json"
    path = tok.save(target)
    assert path.name == ("tokenizer.json" if into_dir else "tok.json")
    loaded = TextTokenizer.load(target)
    assert loaded == tok
    for text in ["<|eos|> x", PARAGRAPH, RANDOM_BYTES]:  # loading restores raw-text handling of specials
        assert loaded.encode(text) == tok.encode(text)


def test_pickle_keeps_raw_text_handling(tok: TextTokenizer) -> None:
    clone = pickle.loads(pickle.dumps(tok))  # as DataLoader workers receive it
    assert clone == tok
    assert clone.encode("a<|eos|>") == tok.encode("a<|eos|>") and EOS not in clone.encode("a<|eos|>")


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "tokenizer file not found"),
        (b"", "invalid tokenizer file"),
        (b"{not json", "invalid tokenizer file"),
        (b"\xff\xfe\x00", "invalid tokenizer file"),
        (b'{"version": "1.0"}', "invalid tokenizer file"),
    ],
)
def test_load_errors(tmp_path, content: bytes | None, match: str) -> None:
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TokenizerError, match=match) as err:
        TextTokenizer.load(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_load_truncated_file(tok: TextTokenizer, tmp_path) -> None:
    path = tok.save(tmp_path / "tokenizer.json")
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(TokenizerError, match="invalid tokenizer file"):
        TextTokenizer.load(path)
