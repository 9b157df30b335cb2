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
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ernie5.data import procedural
from ernie5.data import text as text_data
from ernie5.data.audio_sources import AudioDoc
from ernie5.data.root import DataMissing
from ernie5.data.vision_sources import MediaDoc
from ernie5.sequence import audio as audio_docs
from ernie5.sequence.audio import encode_waves
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


def _science_qa(items: list[text_data.ChoiceItem]) -> DocFn:
    """Multiple-choice train questions in the harness's context, answered with the correct choice
    (the continuation the ``arc_*``/``openbookqa`` tasks score: ``" " + choice``)."""

    def doc(rng: random.Random) -> str:
        it = rng.choice(items)
        return f"Question: {it.question.strip()}\nAnswer: {it.choices[it.answer]}\n"

    return doc


def _arc(data_dir: Path | None) -> DocFn:
    return _science_qa(
        text_data.read_arc(data_dir, "Easy", "train") + text_data.read_arc(data_dir, "Challenge", "train")
    )


def _openbookqa(data_dir: Path | None) -> DocFn:
    return _science_qa(text_data.read_openbookqa(data_dir, "train"))


def _svamp(data_dir: Path | None) -> DocFn:
    items = text_data.read_svamp(data_dir, "train")

    def doc(rng: random.Random) -> str:
        it = rng.choice(items)
        return f"Question: {it.question.strip()}\nAnswer: {it.answer}\n"

    return doc


def _procedural(data_dir: Path | None) -> DocFn:
    return procedural.procedural_document


SOURCES: dict[str, Callable[[Path | None], DocFn]] = {
    "shakespeare": _shakespeare,
    "procedural": _procedural,
    "babi": _babi,
    "gsm8k": _gsm8k,
    "svamp": _svamp,
    "arc": _arc,
    "openbookqa": _openbookqa,
}


@dataclass
class OpenedSources:
    """Sources that could be opened, with renormalised weights, and the ones skipped (and why)."""

    names: list[str]
    weights: list[float]
    fns: list[DocFn]
    skipped: dict[str, str]


def open_sources(cfg: DataConfig, data_dir: Path | None, image_size: int = 32) -> OpenedSources:
    """Open every configured source; a source with missing data is skipped with its reason.

    Text sources return strings; media sources (``ernie5.data.vision_sources.MEDIA_SOURCES``)
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
        try:
            if name in SOURCES:
                fns.append(SOURCES[name](data_dir))
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
        text = d if isinstance(d, str) else f"{d.prompt}\n{d.text}"
        docs.append(text)
        total += len(text)
    return docs


class MixtureStream:
    """Deterministic packed batches for (step, global micro-batch index), text and media mixed.

    Rows are filled with documents in the order they are drawn; a text document is cut to the room
    left in its row, a media document never is (a row it does not fit is closed with padding and the
    document starts the next row). Media go through the frozen vision tokenizer and audio through the
    frozen codec once per micro-batch.
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

    def _media_len(self, doc, p_ids: list[int], text_ids: list[int]) -> int:
        from ernie5.model.vision import und_layout

        if isinstance(doc, AudioDoc):
            frames = max(1, self.audio_codec.n_frames(len(doc.wave)))
            if doc.kind == "gen":
                return 1 + len(p_ids) + 1 + 1 + frames + 2
            return 2 + frames + 1 + len(text_ids) + 1

        frames = doc.media.shape[0] if doc.clip else 1
        if doc.kind == "gen":
            return 1 + len(p_ids) + 1 + frames * self.vision_cfg.tokens_per_frame + 2
        return 2 + und_layout(self.vision_cfg, frames)["positions"].shape[1] + 1 + len(text_ids) + 1

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
                rows[-1].append(ids)
                room -= len(ids)
            else:
                if isinstance(doc, AudioDoc):
                    if self.audio_codec is None:
                        raise ValueError("audio sources need data.audio_codec and model.audio.enabled")
                elif self.vision_tokenizer is None:
                    raise ValueError("media sources need data.vision_tokenizer and model.vision.enabled")
                drop = isinstance(doc, MediaDoc) and doc.kind == "gen" and rng.random() < self.cfg.cfg_dropout
                p_ids = [] if drop else prompt_ids(self.tokenizer, doc.prompt)
                text_ids = self.tokenizer.encode(doc.text)
                n = self._media_len(doc, p_ids, text_ids)
                if n > seq_len:
                    raise ValueError(
                        f"a {doc.kind} media document needs {n} positions > data.seq_len={seq_len}"
                    )
                if n > room:
                    if len(rows) == n_rows:
                        break
                    rows.append([])
                    room = seq_len
                rows[-1].append((doc, p_ids, text_ids))
                room -= n
            if room <= 1:
                if room == 1:
                    rows[-1].append([BOS])  # a lone BOS keeps the row exactly full
                if len(rows) == n_rows:
                    break
                rows.append([])
                room = seq_len
        return pack(self._segments([d for row in rows for d in row], rng), seq_len, n_rows=n_rows)

    def _segments(self, docs: list, rng: random.Random) -> list[list[Segment]]:
        """Text id lists and media docs -> segment lists, encoding the media in batched tokenizer calls."""
        media = [d[0] for d in docs if not isinstance(d, list) and isinstance(d[0], MediaDoc)]
        encoded = self._encode(media, rng) if media else {}
        audio = [d[0] for d in docs if not isinstance(d, list) and isinstance(d[0], AudioDoc)]
        if audio:
            codes = encode_waves(self.audio_codec, [a.wave for a in audio])
            encoded.update({id(a): c for a, c in zip(audio, codes, strict=True)})
        out = []
        for d in docs:
            if isinstance(d, list):
                out.append([text_segment(d)])
                continue
            doc, p_ids, text_ids = d
            if isinstance(doc, AudioDoc):
                codes = encoded[id(doc)]
                if doc.kind == "gen":
                    seg = audio_docs.generation_segment(codes, doc.speaker)
                else:
                    seg = audio_docs.understanding_segment(codes)
                out.append(audio_docs.audio_document(seg, doc.kind, p_ids, text_ids))
                continue
            frames = doc.media.shape[0] if doc.clip else 1
            out.append(media_document(encoded[id(doc)], doc.kind, frames, p_ids, text_ids))
        return out

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
