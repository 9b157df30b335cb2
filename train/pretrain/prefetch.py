"""Tokenizer disaggregation: micro-batches built ahead of the trainer in data-loader worker processes.

A micro-batch is a pure function of its key ``(step, index)``
(:class:`train.pretrain.data.MixtureStream`), and building it includes the media tokenization: images and
clips through the frozen vision tokenizer, waves through the frozen audio codec. :class:`PrefetchStream`
runs that work in ``torch.utils.data.DataLoader`` worker processes, each holding its own
:class:`MixtureStream` (and so its own copy of the frozen tokenizer and codec), over the keys the trainer
will ask for, in order, so that a slow tokenizer delays the backbone only when the workers fall behind.

Contract: ``PrefetchStream(...).batch(step, index)`` returns exactly what ``MixtureStream.batch(step,
index)`` returns (every tensor equal). Steps:
  1. ``keys`` is the sequence of ``(step, index)`` the trainer will ask for (:class:`TrainKeys` for
     the pretraining loop); the loader hands key ``i`` to worker ``i mod workers`` and yields the
     batches in key order, at most ``depth`` batches ahead per worker (``prefetch_factor``);
  2. each worker builds its stream once (``make_stream()`` in ``worker_init_fn``, with one intra-op
     thread so that workers do not oversubscribe the trainer's cores);
  3. ``batch(step, index)`` takes the next prefetched batch when ``(step, index)`` is the next key;
     any other key is built synchronously in the trainer's process (a stream made there on first
     need), counted in ``n_sync`` and warned about once, and the prefetch order is left as it was;
  4. every call records the seconds the trainer waited for its batch (``wait_s``; ``pop_wait_s``
     sums them since the last pop, e.g. per optimizer step).
``workers=0`` is the synchronous path: ``make_stream()`` in the trainer's process and
``MixtureStream.batch`` per call, ``wait_s`` then being the whole build time.

Workers die with the trainer: the loader's workers watch their parent process and exit when it is
gone (at the latest ``torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL`` = 5 s after the batch in
hand; after ``kill -9`` of the trainer they were gone within 1 s), and ``close()`` (or leaving the
``with`` block) shuts them down at once.

``make_stream`` under the default ``fork`` start method may be any callable (the worker gets a copy of
the trainer's memory, e.g. ``lambda: trainer.stream``, without pickling); under ``spawn`` or
``forkserver`` it must pickle: :class:`StreamSpec` does (it opens the sources in the worker, as
:class:`~train.pretrain.data.OpenedSources` holds closures that do not pickle). Forked workers must not use
CUDA, and do not: the frozen tokenizer and codec of the stream stay on the CPU, and batches come back
as CPU tensors for the trainer to move.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §5.2: tokenizers disaggregated from the backbone,
    run as independent data-parallel services whose encodings the backbone fetches.
  * PyTorch ``torch.utils.data.DataLoader`` (``num_workers``, ``prefetch_factor``,
    ``persistent_workers``, ``worker_init_fn``).

Deviations:
  1. The report's tokenizers are separate services on their own GPU nodes, reached by remote calls;
     here they run in CPU worker processes of the trainer's machine, one copy of the frozen
     tokenizer and codec per worker.
  2. A worker builds the whole micro-batch (text packing and media encoding), not the media
     encodings alone: the batch is a pure function of its key, so this is the same batch with one
     hand-off per micro-batch instead of one per media document.
"""

from __future__ import annotations

import pickle
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ernie5.sequence.segments import Batch
from train.pretrain.config import DataConfig
from train.pretrain.data import MixtureStream, open_sources

Key = tuple[int, int]
"""``(step, index)``: optimizer step and global micro-batch index (``micro * world + rank``)."""


@dataclass(frozen=True)
class TrainKeys(Sequence):
    """The keys the pretraining loop asks for, in its order (lazy, so a long run holds no list).

    Key ``i`` is ``(start_step + i // grad_accum, (i % grad_accum) * world + rank)``: step by step,
    micro-batch ``micro`` of process ``rank`` being global micro-batch ``micro * world + rank``.
    """

    start_step: int
    steps: int
    grad_accum: int = 1
    world: int = 1
    rank: int = 0

    def __len__(self) -> int:
        return max(0, self.steps - self.start_step) * self.grad_accum

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"key {i} out of range (0..{n - 1})")
        step, micro = divmod(i, self.grad_accum)
        return (self.start_step + step, micro * self.world + self.rank)


@dataclass(frozen=True)
class StreamSpec:
    """A picklable ``make_stream``: the arguments of :class:`MixtureStream`, sources opened on call."""

    cfg: DataConfig
    data_dir: Path | None
    tokenizer: object
    seed: int
    vision_tokenizer: object = None
    vision_cfg: object = None
    audio_codec: object = None
    image_size: int = 32

    def __call__(self) -> MixtureStream:
        sources = open_sources(self.cfg, self.data_dir, self.image_size)
        return MixtureStream(
            self.cfg,
            sources,
            self.tokenizer,
            self.seed,
            self.vision_tokenizer,
            self.vision_cfg,
            self.audio_codec,
        )


class _KeyedBatches(Dataset):
    """Item ``i``: ``(keys[i], batch)``, or ``(keys[i], exception)`` when building the batch failed
    (re-raised by the trainer with its own type and message, instead of the loader's wrapper)."""

    def __init__(self, make_stream: Callable[[], MixtureStream], keys: Sequence[Key]):
        self.make_stream = make_stream
        self.keys = keys
        self.stream: MixtureStream | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> tuple[Key, Batch | Exception]:
        key = tuple(self.keys[i])
        try:
            if self.stream is None:
                self.stream = self.make_stream()
            return key, self.stream.batch(*key)
        except Exception as e:  # noqa: BLE001 - handed to the trainer, which raises it
            try:
                pickle.dumps(e)
            except Exception:  # noqa: BLE001 - an error the loader cannot send would hang the trainer
                e = RuntimeError(f"{type(e).__name__}: {e}")
            return key, e


def _init_worker(worker_id: int) -> None:
    torch.set_num_threads(1)
    data = get_worker_info().dataset
    try:
        data.stream = data.make_stream()
    except Exception:  # noqa: BLE001 - __getitem__ retries and hands the error to the trainer
        data.stream = None


def _items(item):
    return item


class PrefetchStream:
    """``MixtureStream.batch`` results for ``keys``, built ahead by ``workers`` processes.

    Args:
        make_stream: zero-argument callable returning the :class:`MixtureStream` (called once per
            worker, and in this process for ``workers=0`` or for a key asked out of order).
        keys: the ``(step, index)`` keys in the order :meth:`batch` will be asked for them
            (a :class:`TrainKeys`, or any iterable: it is then held as a list).
        workers: worker processes (0: build each batch synchronously in :meth:`batch`).
        depth: batches each worker builds ahead (the loader's ``prefetch_factor``).
        mp_context: multiprocessing start method for the workers (``None``: the platform default).
    """

    def __init__(
        self,
        make_stream: Callable[[], MixtureStream],
        keys: Iterable[Key],
        workers: int = 0,
        depth: int = 2,
        *,
        mp_context: str | None = None,
    ) -> None:
        if workers < 0:
            raise ValueError(f"workers={workers} must be >= 0")
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1")
        self.make_stream = make_stream
        self.keys: Sequence[Key] = keys if isinstance(keys, Sequence) else [tuple(k) for k in keys]
        self.workers = workers
        self.depth = depth
        self.wait_s = 0.0
        """Seconds the last :meth:`batch` call waited (the whole build when it was synchronous)."""
        self.n_sync = 0
        """Batches built in this process because their key was not the next prefetched one."""
        self._waited = 0.0
        self._pos = 0
        self._stream: MixtureStream | None = None
        self._iter = None
        if workers == 0:
            self._stream = make_stream()
            return
        loader = DataLoader(
            _KeyedBatches(make_stream, self.keys),
            batch_size=None,
            shuffle=False,
            num_workers=workers,
            prefetch_factor=depth,
            persistent_workers=True,
            collate_fn=_items,
            worker_init_fn=_init_worker,
            multiprocessing_context=mp_context,
        )
        self._iter = iter(loader)  # starts the workers; they begin building at once

    @classmethod
    def from_config(
        cls, make_stream: Callable[[], MixtureStream], cfg: DataConfig, keys: Iterable[Key]
    ) -> PrefetchStream:
        """The stream ``data.workers`` and ``data.prefetch`` ask for (defaults 0 and 2)."""
        return cls(make_stream, keys, getattr(cfg, "workers", 0), getattr(cfg, "prefetch", 2))

    # ------------------------------------------------------------------ use
    def batch(self, step: int, index: int = 0) -> Batch:
        """Micro-batch ``index`` of optimizer step ``step``, equal to ``MixtureStream.batch(step, index)``."""
        t0 = time.perf_counter()
        key = (step, index)
        if self._iter is not None and self._pos < len(self.keys) and tuple(self.keys[self._pos]) == key:
            got, out = next(self._iter)
            self._pos += 1
            if got != key:  # the loader yields in key order; anything else is a bug here
                raise RuntimeError(f"prefetched batch {got} arrived for key {key}")
            if isinstance(out, Exception):
                raise out
        else:
            if self._iter is not None:
                self.n_sync += 1
                if self.n_sync == 1:
                    expected = tuple(self.keys[self._pos]) if self._pos < len(self.keys) else None
                    warnings.warn(
                        f"PrefetchStream: key {key} asked while {expected} was next; built synchronously "
                        "(every key out of the prefetch order is)",
                        stacklevel=2,
                    )
            if self._stream is None:
                self._stream = self.make_stream()
            out = self._stream.batch(step, index)
        self.wait_s = time.perf_counter() - t0
        self._waited += self.wait_s
        return out

    def pop_wait_s(self) -> float:
        """Seconds waited in :meth:`batch` since the last pop (e.g. one optimizer step's ``data_wait_s``)."""
        waited, self._waited = self._waited, 0.0
        return waited

    def close(self) -> None:
        """Stop the workers now (idempotent); :meth:`batch` then builds every batch synchronously."""
        it, self._iter = self._iter, None
        if it is not None:
            it._shutdown_workers()  # what the loader's own __del__ does, but now, not at collection

    def __enter__(self) -> PrefetchStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
