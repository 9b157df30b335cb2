"""Text tokenizer: byte-level BPE (GPT-2 style) trained with Hugging Face ``tokenizers``.

Vocabulary layout, fixed for every trained tokenizer:

* ids ``0..9``: the special tokens of :mod:`ernie5.tokenizers.special`, in that order;
* ids ``10..265``: the 256 byte-level alphabet tokens, so every UTF-8 string is encodable;
* ids ``266..vocab_size-1``: learned merges, in merge order.

``decode(encode(s)) == s`` holds for every string ``s``: there is no normaliser, no prefix space,
and special tokens are never matched in raw text (``"<|eos|>"`` typed by a user is encoded as
ordinary bytes, so untrusted text cannot inject a control token). Special ids are only produced by
code that inserts them explicitly, and decode to their token strings.

References:
  * Radford et al. 2019, GPT-2 (byte-level BPE and its pre-tokenisation regex).
  * Hugging Face ``tokenizers`` (``models.BPE``, ``pre_tokenizers.ByteLevel``, ``BpeTrainer``).

Deviations:
  1. The ERNIE 5.0 report does not describe its text tokenizer; we use GPT-2 byte-level BPE.
  2. Special tokens are registered as added tokens (standard ``tokenizer.json``) but with
     ``encode_special_tokens = True``, which the file does not record and :meth:`TextTokenizer.load`
     sets; other loaders of the same file will match them in raw text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ernie5.tokenizers.special import N_SPECIAL, SPECIAL_TOKENS

N_BYTES = 256
"""Size of the byte-level alphabet."""
MIN_VOCAB_SIZE = N_SPECIAL + N_BYTES
"""Special tokens plus the full byte alphabet."""
FILENAME = "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer file is missing or invalid. The message is one line and names the path."""


def _file(path: str | Path) -> Path:
    path = Path(path)
    return path / FILENAME if path.is_dir() else path


class TextTokenizer:
    """Byte-level BPE text tokenizer with the shared special tokens at ids 0..9."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        """Wrap a ``tokenizers.Tokenizer``; use :meth:`train` or :meth:`load` instead of calling this."""
        for i, token in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(token) != i:
                raise ValueError(f"special token {token!r} must have id {i}")
        tokenizer.encode_special_tokens = True  # raw "<|eos|>" is text, not the EOS id
        self._tok = tokenizer

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> TextTokenizer:
        """Train a tokenizer on ``texts``; deterministic for the same texts and arguments.

        Args:
            texts: training documents (any iterable; consumed once).
            vocab_size: upper bound on the vocabulary, special and byte tokens included; fewer
                tokens result when the corpus has no more pairs seen ``min_frequency`` times.
            min_frequency: minimum count of a pair to be merged.

        Raises:
            ValueError: ``vocab_size < 266`` (10 special + 256 byte tokens).
        """
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size={vocab_size} must be >= {MIN_VOCAB_SIZE} "
                f"({N_SPECIAL} special + {N_BYTES} byte tokens)"
            )
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (special tokens included); ids are ``0..vocab_size-1``."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def special_id(self, name: str) -> int:
        """Id of a special token, by token string (``"<|eos|>"``) or short name (``"eos"``)."""
        token = name if name.startswith("<|") else f"<|{name.lower()}|>"
        if token not in SPECIAL_TOKENS:
            raise KeyError(f"unknown special token {name!r} (valid: {', '.join(SPECIAL_TOKENS)})")
        return SPECIAL_TOKENS.index(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added or recognised."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the Rust batch encoder."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # _fast: tokenizers>=0.21
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special ids render as their token strings.

        Byte sequences that are not valid UTF-8 (e.g. half a multi-byte character) decode to
        U+FFFD. ``decode(encode(s)) == s`` for every string ``s``.

        Raises:
            ValueError: an id is outside ``[0, vocab_size)``.
        """
        ids = list(ids)
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside [0, vocab_size={self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=False)

    def to_str(self) -> str:
        """The ``tokenizer.json`` text (deterministic)."""
        return self._tok.to_str()

    def save(self, path: str | Path) -> Path:
        """Write ``tokenizer.json`` to ``path`` (a file path, or a directory to write it into)."""
        path = _file(path)
        path.write_text(self.to_str(), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> TextTokenizer:
        """Read a tokenizer saved by :meth:`save` (a file path, or the directory holding it).

        Raises:
            TokenizerError: the file is missing, is not a tokenizer file, or lacks the special tokens.
        """
        path = _file(path)
        if not path.is_file():
            raise TokenizerError(f"{path}: tokenizer file not found")
        try:
            return cls(Tokenizer.from_str(path.read_text(encoding="utf-8")))
        except Exception as e:  # tokenizers raises plain Exception; bad UTF-8 raises UnicodeDecodeError
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{path}: invalid tokenizer file ({msg})") from None

    def __getstate__(self) -> str:
        return self.to_str()

    def __setstate__(self, state: str) -> None:
        # Pickling the inner Tokenizer would drop ``encode_special_tokens`` (e.g. in DataLoader workers).
        self.__init__(Tokenizer.from_str(state))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TextTokenizer) and self.to_str() == other.to_str()

    def __hash__(self) -> int:
        return hash(self.to_str())

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size})"
