"""The pretraining data stream: weighted text sources packed into fixed-length rows.

A batch is a pure function of ``(seed, step, index)``, ``index`` being the micro-batch's global
index across processes: every row is filled with documents drawn from a generator seeded by those
numbers. Resuming at step ``s`` therefore reproduces the exact batches of an uninterrupted run,
processes never see each other's data, and W processes x A micro-batches see the same batches as
one process accumulating W*A.

Sources (``data.sources`` weights; the ones whose files are missing under the data root are left
out and the weights renormalised, so a fresh machine trains on the procedural source alone):
  * ``shakespeare``: random windows of the *training* part of Tiny Shakespeare (the held-out tail
    that the ``shakespeare_bpb`` task scores is never used, see ``ernie5.data.text``);
  * ``procedural``: the project's seeded arithmetic / copy / reverse / sort tasks;
  * ``babi``, ``gsm8k``: training splits of bAbI task 1 and GSM8K, in the harness's prompt format
    (``Question: ...\nAnswer: ...``); their test splits, which the harness scores, are never read.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ernie5.data import procedural
from ernie5.data import text as text_data
from ernie5.data.root import DataMissing
from ernie5.sequence import Batch, pack, text_segment
from ernie5.tokenizers.special import BOS, EOS
from ernie5.tokenizers.text import TextTokenizer
from train.config import DataConfig

DocFn = Callable[[random.Random], str]


def _shakespeare(data_dir: Path | None) -> DocFn:
    train_text, _ = text_data.shakespeare_split(text_data.read_shakespeare(data_dir))

    def doc(rng: random.Random) -> str:
        n = rng.randint(400, 2000)
        start = rng.randrange(0, max(1, len(train_text) - n))
        return train_text[start : start + n]

    return doc


def _babi(data_dir: Path | None) -> DocFn:
    items = text_data.read_babi_qa1(data_dir, "train")

    def doc(rng: random.Random) -> str:
        it = rng.choice(items)
        story = "".join(f"{s}\n" for s in it.story)
        return f"{story}Question: {it.question}\nAnswer: {it.answer}\n"

    return doc


def _gsm8k(data_dir: Path | None) -> DocFn:
    items = text_data.read_gsm8k(data_dir, "train")

    def doc(rng: random.Random) -> str:
        it = rng.choice(items)
        solution = text_data.strip_calculator_annotations(it.solution)
        return f"Question: {it.question.strip()}\nAnswer: {solution}\n#### {it.answer}\n"

    return doc


def _procedural(data_dir: Path | None) -> DocFn:
    return procedural.procedural_document


SOURCES: dict[str, Callable[[Path | None], DocFn]] = {
    "shakespeare": _shakespeare,
    "procedural": _procedural,
    "babi": _babi,
    "gsm8k": _gsm8k,
}


@dataclass
class OpenedSources:
    """Sources that could be opened, with renormalised weights, and the ones skipped (and why)."""

    names: list[str]
    weights: list[float]
    fns: list[DocFn]
    skipped: dict[str, str]


def open_sources(cfg: DataConfig, data_dir: Path | None) -> OpenedSources:
    """Open every configured source; a source with missing data is skipped with its reason."""
    names, weights, fns, skipped = [], [], [], {}
    for name, w in cfg.sources.items():
        if name not in SOURCES:
            raise ValueError(f"data.sources: unknown source {name!r} (known: {', '.join(sorted(SOURCES))})")
        if w <= 0:
            continue
        try:
            fns.append(SOURCES[name](data_dir))
        except DataMissing as e:
            skipped[name] = str(e)
            continue
        names.append(name)
        weights.append(w)
    if not names:
        raise ValueError(f"no data source is available: {skipped}")
    total = sum(weights)
    return OpenedSources(names, [w / total for w in weights], fns, skipped)


def tokenizer_corpus(sources: OpenedSources, n_chars: int, seed: int) -> list[str]:
    """Documents for training the BPE tokenizer: ``n_chars`` characters drawn from the mixture."""
    rng = random.Random(f"tokenizer/{seed}")
    docs, total = [], 0
    while total < n_chars:
        fn = rng.choices(sources.fns, weights=sources.weights)[0]
        d = fn(rng)
        docs.append(d)
        total += len(d)
    return docs


class TextStream:
    """Deterministic packed batches for (step, global micro-batch index)."""

    def __init__(self, cfg: DataConfig, sources: OpenedSources, tokenizer: TextTokenizer, seed: int) -> None:
        self.cfg = cfg
        self.sources = sources
        self.tokenizer = tokenizer
        self.seed = seed

    def batch(self, step: int, index: int = 0) -> Batch:
        """Micro-batch ``index`` of optimizer step ``step`` (the index is global across processes)."""
        rng = random.Random(f"data/{self.seed}/{step}/{index}")
        seq_len, rows = self.cfg.seq_len, self.cfg.batch_size
        docs = []
        for _ in range(rows):  # fill every row exactly to seq_len
            room = seq_len
            while room > 1:
                fn = rng.choices(self.sources.fns, weights=self.sources.weights)[0]
                ids = [BOS, *self.tokenizer.encode(fn(rng)), EOS][:room]
                docs.append([text_segment(ids)])
                room -= len(ids)
            if room == 1:  # a lone BOS as filler keeps every row exactly full
                docs.append([text_segment([BOS])])
        return pack(docs, seq_len, n_rows=rows)
