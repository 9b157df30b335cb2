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
  * ``babi``, ``gsm8k``, ``svamp``: training splits of bAbI task 1, GSM8K and SVAMP, in the harness's
    prompt format (``Question: ...\nAnswer: ...``);
  * ``arc``, ``openbookqa``: the training splits of ARC (Easy and Challenge) and OpenBookQA, each
    question answered with its correct choice in the multiple-choice tasks' context.
  The test (and validation) splits, which the harness scores, are never read.

``data.format: chat`` (supervised fine-tuning, ``ernie5 sft``): the text sources give instruction
turns instead (``CHAT_SOURCES``: one problem per turn, the harness task's prompt as context and its
answer and stop text scored; ``shakespeare`` has none), and media documents score only what follows
their question cue, or only the markers and media after a generation prompt (see
:mod:`ernie5.sequence.chat`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ernie5.config import ConfigError
from ernie5.data import procedural
from ernie5.data import text as text_data
from ernie5.data.audio_sources import AudioDoc
from ernie5.data.root import DataMissing
from ernie5.data.vision_sources import MediaDoc
from ernie5.sequence import audio as audio_docs
from ernie5.sequence.audio import encode_waves
from ernie5.sequence.chat import Turn, chat_turn, chat_turn_len, split_cue, split_ids, turn_ids
from ernie5.sequence.segments import Batch, Segment, pack, text_segment
from ernie5.sequence.vision import (
    encode_media,
    generation_segment,
    media_document,
    prompt_ids,
    to_pixels,
    understanding_segment,
)
from ernie5.tokenizers.special import BOS, EOS
from ernie5.tokenizers.text import TextTokenizer
from train.pretrain.config import DataConfig

DocFn = Callable[[random.Random], str]
TurnFn = Callable[[random.Random], Turn]
QAFn = Callable[[random.Random], Turn]
"""A question-answering source: turns whose answer has no stop text yet."""


def _shakespeare(data_dir: Path | None) -> DocFn:
    train_text, _ = text_data.shakespeare_split(text_data.read_shakespeare(data_dir))

    def doc(rng: random.Random) -> str:
        n = rng.randint(400, 2000)
        start = rng.randrange(0, max(1, len(train_text) - n))
        return train_text[start : start + n]

    return doc


def _babi(data_dir: Path | None) -> QAFn:
    items = text_data.read_babi_qa1(data_dir, "train")

    def qa(rng: random.Random) -> Turn:
        it = rng.choice(items)
        story = "".join(f"{s}\n" for s in it.story)
        return Turn(f"{story}Question: {it.question}\nAnswer:", f" {it.answer}")

    return qa


def _gsm8k(data_dir: Path | None) -> QAFn:
    items = text_data.read_gsm8k(data_dir, "train")

    def qa(rng: random.Random) -> Turn:
        it = rng.choice(items)
        solution = text_data.strip_calculator_annotations(it.solution)
        return Turn(f"Question: {it.question.strip()}\nAnswer:", f" {solution}\n#### {it.answer}")

    return qa


def _science_qa(items: list[text_data.ChoiceItem]) -> QAFn:
    """Multiple-choice train questions in the harness's context, answered with the correct choice
    (the continuation the ``arc_*``/``openbookqa`` tasks score: ``" " + choice``)."""

    def qa(rng: random.Random) -> Turn:
        it = rng.choice(items)
        return Turn(f"Question: {it.question.strip()}\nAnswer:", f" {it.choices[it.answer]}")

    return qa


def _arc(data_dir: Path | None) -> QAFn:
    return _science_qa(
        text_data.read_arc(data_dir, "Easy", "train") + text_data.read_arc(data_dir, "Challenge", "train")
    )


def _openbookqa(data_dir: Path | None) -> QAFn:
    return _science_qa(text_data.read_openbookqa(data_dir, "train"))


def _svamp(data_dir: Path | None) -> QAFn:
    items = text_data.read_svamp(data_dir, "train")

    def qa(rng: random.Random) -> Turn:
        it = rng.choice(items)
        return Turn(f"Question: {it.question.strip()}\nAnswer:", f" {it.answer}")

    return qa


QA_SOURCES: dict[str, tuple[Callable[[Path | None], QAFn], str]] = {
    "babi": (_babi, "\n"),
    "gsm8k": (_gsm8k, "\n\n"),
    "svamp": (_svamp, "\n\n"),
    "arc": (_arc, "\n"),
    "openbookqa": (_openbookqa, "\n"),
}
"""Question-answering sources: opener of (prompt, answer without stop text) turns, and the stop text
of the harness task that scores them (``evals/tasks``: babi and the multiple-choice tasks end an
answer at a newline, the math word problems at a blank line)."""


def _as_document(opener: Callable[[Path | None], QAFn]) -> Callable[[Path | None], DocFn]:
    """Pretraining documents of a QA source: prompt, answer and a newline as one text."""

    def open_docs(data_dir: Path | None) -> DocFn:
        qa = opener(data_dir)

        def doc(rng: random.Random) -> str:
            turn = qa(rng)
            return f"{turn.prompt}{turn.answer}\n"

        return doc

    return open_docs


def _as_turns(opener: Callable[[Path | None], QAFn], stop: str) -> Callable[[Path | None], TurnFn]:
    """Instruction turns of a QA source: the answer followed by the task's stop text."""

    def open_turns(data_dir: Path | None) -> TurnFn:
        qa = opener(data_dir)

        def turn(rng: random.Random) -> Turn:
            t = qa(rng)
            return Turn(t.prompt, t.answer + stop)

        return turn

    return open_turns


def _procedural(data_dir: Path | None) -> DocFn:
    return procedural.procedural_document


def _procedural_turns(data_dir: Path | None) -> TurnFn:
    def turn(rng: random.Random) -> Turn:
        kind = rng.choice(procedural.KINDS)
        ex = procedural.generate(kind, rng.randint(*procedural.TRAIN_DIFFICULTY[kind]), rng)
        return Turn(ex.prompt, ex.answer + procedural.STOP)

    return turn


SOURCES: dict[str, Callable[[Path | None], DocFn]] = {
    "shakespeare": _shakespeare,
    "procedural": _procedural,
    **{name: _as_document(opener) for name, (opener, _) in QA_SOURCES.items()},
}
"""Text sources of pretraining (``data.format: packed``): name -> opener of a document function."""

CHAT_SOURCES: dict[str, Callable[[Path | None], TurnFn]] = {
    "procedural": _procedural_turns,
    **{name: _as_turns(opener, stop) for name, (opener, stop) in QA_SOURCES.items()},
}
"""Text sources of instruction tuning (``data.format: chat``): name -> opener of a turn function, one
problem per turn (``shakespeare`` has no instruction form)."""


@dataclass
class OpenedSources:
    """Sources that could be opened, with renormalised weights, and the ones skipped (and why)."""

    names: list[str]
    weights: list[float]
    fns: list[DocFn]
    skipped: dict[str, str]


def open_sources(cfg: DataConfig, data_dir: Path | None, image_size: int = 32) -> OpenedSources:
    """Open every configured source; a source with missing data is skipped with its reason.

    Text sources return strings (``data.format: chat``: :class:`~ernie5.sequence.chat.Turn` objects);
    media sources (``ernie5.data.vision_sources.MEDIA_SOURCES``)
    return :class:`~ernie5.data.vision_sources.MediaDoc` objects and audio sources
    (``ernie5.data.audio_sources.AUDIO_SOURCES``) :class:`~ernie5.data.audio_sources.AudioDoc`
    objects.
    """
    from ernie5.data.audio_sources import AUDIO_SOURCES, open_audio_source
    from ernie5.data.vision_sources import MEDIA_SOURCES, open_media_source

    names, weights, fns, skipped = [], [], [], {}
    known = sorted([*SOURCES, *MEDIA_SOURCES, *AUDIO_SOURCES])
    for name, w in cfg.sources.items():
        if name not in known:
            raise ValueError(f"data.sources: unknown source {name!r} (known: {', '.join(known)})")
        if w <= 0:
            continue
        if cfg.format == "chat" and name in SOURCES and name not in CHAT_SOURCES:
            raise ConfigError(f"data.sources: {name!r} has no instruction form (data.format=chat)")
        try:
            if name in SOURCES:
                fns.append((CHAT_SOURCES if cfg.format == "chat" else SOURCES)[name](data_dir))
            elif name in AUDIO_SOURCES:
                fns.append(open_audio_source(name, data_dir))
            else:
                fns.append(open_media_source(name, data_dir, image_size, cfg.media_understanding))
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
        if isinstance(d, str):
            text = d
        elif isinstance(d, Turn):
            text = d.prompt + d.answer
        else:
            text = f"{d.prompt}\n{d.text}"
        docs.append(text)
        total += len(text)
    return docs


@dataclass
class _MediaItem:
    """A media document drawn into a row, with its text ids: ``prompt`` (scored, before the media of a
    generation document), ``context`` (no loss) and ``answer`` (scored, after the media)."""

    doc: MediaDoc | AudioDoc
    prompt: list[int]
    context: list[int]
    answer: list[int]


class MixtureStream:
    """Deterministic packed batches for (step, global micro-batch index), text and media mixed.

    Rows are filled with documents in the order they are drawn; a text document is cut to the room
    left in its row, a media document never is (a row it does not fit is closed with padding and the
    document starts the next row). Media go through the frozen vision tokenizer and audio through the
    frozen codec once per micro-batch.

    ``data.format: chat`` (instruction tuning, :mod:`ernie5.sequence.chat`): text sources give one
    turn per document, laid out like a media document (never cut, except one longer than a row); the
    loss is on answers only: the question cue of an understanding document and the prompt of a
    generation document are context.
    """

    def __init__(
        self,
        cfg: DataConfig,
        sources: OpenedSources,
        tokenizer: TextTokenizer,
        seed: int,
        vision_tokenizer=None,
        vision_cfg=None,
        audio_codec=None,
    ) -> None:
        self.cfg = cfg
        self.sources = sources
        self.tokenizer = tokenizer
        self.seed = seed
        self.vision_tokenizer = vision_tokenizer
        self.vision_cfg = vision_cfg
        self.audio_codec = audio_codec

    def _media_len(self, doc, n_prompt: int, n_text: int) -> int:
        """Positions of a media document with ``n_prompt`` ids before and ``n_text`` ids after the media."""
        from ernie5.model.vision import und_layout

        if isinstance(doc, AudioDoc):
            frames = max(1, self.audio_codec.n_frames(len(doc.wave)))
            if doc.kind == "gen":
                return 1 + n_prompt + 1 + 1 + frames + 2
            return 2 + frames + 1 + n_text + 1

        frames = doc.media.shape[0] if doc.clip else 1
        if doc.kind == "gen":
            return 1 + n_prompt + 1 + frames * self.vision_cfg.tokens_per_frame + 2
        return 2 + und_layout(self.vision_cfg, frames)["positions"].shape[1] + 1 + n_text + 1

    def _media_item(self, doc: MediaDoc | AudioDoc, rng: random.Random) -> _MediaItem:
        """The text ids of a media document (the classifier-free-guidance dropout drawn from ``rng``)."""
        if isinstance(doc, AudioDoc):
            if self.audio_codec is None:
                raise ValueError("audio sources need data.audio_codec and model.audio.enabled")
        elif self.vision_tokenizer is None:
            raise ValueError("media sources need data.vision_tokenizer and model.vision.enabled")
        drop = isinstance(doc, MediaDoc) and doc.kind == "gen" and rng.random() < self.cfg.cfg_dropout
        p_ids = [] if drop else prompt_ids(self.tokenizer, doc.prompt)
        if self.cfg.format != "chat":
            return _MediaItem(doc, p_ids, [], self.tokenizer.encode(doc.text))
        if doc.kind == "gen":
            return _MediaItem(doc, [], p_ids, [])
        return _MediaItem(doc, [], *split_ids(self.tokenizer, *split_cue(doc.text)))

    def _draw(self, doc, rng: random.Random) -> tuple[list[Segment] | _MediaItem, int]:
        """A turn or media document drawn into a row (never cut), and its positions."""
        seq_len = self.cfg.seq_len
        if isinstance(doc, Turn):
            p_ids, a_ids = turn_ids(self.tokenizer, doc)
            return chat_turn(p_ids, a_ids), min(chat_turn_len(p_ids, a_ids), seq_len)  # pack cuts it
        item = self._media_item(doc, rng)
        n = self._media_len(doc, len(item.prompt) + len(item.context), len(item.context) + len(item.answer))
        if n > seq_len:
            raise ValueError(f"a {doc.kind} media document needs {n} positions > data.seq_len={seq_len}")
        return item, n

    def batch(self, step: int, index: int = 0) -> Batch:
        """Micro-batch ``index`` of optimizer step ``step`` (the index is global across processes)."""
        rng = random.Random(f"data/{self.seed}/{step}/{index}")
        seq_len, n_rows = self.cfg.seq_len, self.cfg.batch_size
        rows: list[list] = [[]]
        room = seq_len
        while True:
            fn = rng.choices(self.sources.fns, weights=self.sources.weights)[0]
            doc = fn(rng)
            if isinstance(doc, str):
                ids = [BOS, *self.tokenizer.encode(doc), EOS][:room]
                rows[-1].append([text_segment(ids)])
                room -= len(ids)
            else:
                item, n = self._draw(doc, rng)
                if n > room:
                    if len(rows) == n_rows:
                        break
                    rows.append([])
                    room = seq_len
                rows[-1].append(item)
                room -= n
            if room <= 1:
                if room == 1:
                    rows[-1].append([text_segment([BOS])])  # a lone BOS keeps the row exactly full
                if len(rows) == n_rows:
                    break
                rows.append([])
                room = seq_len
        return pack(self._segments([d for row in rows for d in row], rng), seq_len, n_rows=n_rows)

    def _segments(self, docs: list, rng: random.Random) -> list[list[Segment]]:
        """Ready documents and media items -> segment lists, encoding the media in batched tokenizer calls."""
        items = [d for d in docs if isinstance(d, _MediaItem)]
        media = [d.doc for d in items if isinstance(d.doc, MediaDoc)]
        encoded = self._encode(media, rng) if media else {}
        audio = [d.doc for d in items if isinstance(d.doc, AudioDoc)]
        if audio:
            codes = encode_waves(self.audio_codec, [a.wave for a in audio])
            encoded.update({id(a): c for a, c in zip(audio, codes, strict=True)})
            und = [a for a in audio if a.kind != "gen"]
            encoder = self.audio_codec.content_encoder
            if und and encoder is not None:  # understanding frames also carry content features
                feats = audio_docs.content_features(encoder, self.audio_codec, [a.wave for a in und])
                encoded.update({("feats", id(a)): f for a, f in zip(und, feats, strict=True)})
        return [d if isinstance(d, list) else self._media_segments(d, encoded) for d in docs]

    def _media_segments(self, item: _MediaItem, encoded: dict) -> list[Segment]:
        """The segments of one media item (``encoded``: its tokenizer segment or codec codes by id)."""
        doc = item.doc
        if isinstance(doc, AudioDoc):
            codes = encoded[id(doc)]
            if doc.kind == "gen":
                seg = audio_docs.generation_segment(codes, doc.speaker)
            else:
                seg = audio_docs.understanding_segment(codes, encoded.get(("feats", id(doc))))
            return audio_docs.audio_document(seg, doc.kind, item.prompt, item.answer, context=item.context)
        frames = doc.media.shape[0] if doc.clip else 1
        return media_document(
            encoded[id(doc)], doc.kind, frames, item.prompt, item.answer, context=item.context
        )

    def _encode(self, media: list[MediaDoc], rng: random.Random) -> dict[int, Segment]:
        groups: dict[tuple, list[MediaDoc]] = {}
        for doc in media:
            frames = doc.media.shape[0] if doc.clip else 1
            groups.setdefault((doc.kind, frames), []).append(doc)
        out = {}
        for (kind, _), docs in groups.items():
            pixels = torch.cat([to_pixels(d.media, d.clip) for d in docs])
            # Bitwise self-correction: one flip probability per group, from the batch's own generator.
            flip = self.cfg.vision_flip_max * rng.random() if kind == "gen" else 0.0
            gen = torch.Generator().manual_seed(rng.randrange(2**63))
            enc = encode_media(
                self.vision_tokenizer, pixels, codes=kind == "gen", flip_prob=flip, generator=gen
            )
            for i, doc in enumerate(docs):
                if kind == "gen":
                    bits = [b[i] for b in enc.bits]
                    inputs = [b[i] for b in enc.input_bits]
                    out[id(doc)] = generation_segment(self.vision_tokenizer, self.vision_cfg, bits, inputs)
                else:
                    out[id(doc)] = understanding_segment(self.vision_cfg, enc.pixels[i], enc.cnn[i])
        return out
