"""A deterministic random :class:`~evals.api.EvalModel`: chance-level answers with no weights and no torch.

Every answer is a function of ``(seed, request)`` only, through sha256, so results do not depend on
batching, order or process. It treats each character as one token:

* ``loglikelihood`` / ``loglikelihood_rolling``: a sum of per-character log-probabilities in
  ``[-4.5, -0.5]``, drawn from a generator seeded by a hash of the seed, the context and the text;
  ``is_greedy`` is true about 1 time in 10;
* ``generate``: 1 to 8 characters drawn from ``vocab`` (digits, letters, a space), cut at the first
  stop string and at ``max_new_tokens``.

* ``generate_media`` / ``reconstruct``: uniform noise frames; ``refine``: nearest-neighbour 2x.

It exercises the whole task pipeline in tests and gives the chance baseline in reports.
"""

from __future__ import annotations

import hashlib
import random
import string

import numpy as np

from evals.api import (
    Answers,
    Context,
    GenerationRequest,
    GenerationResult,
    LoglikelihoodRequest,
    LoglikelihoodResult,
    MediaGenerationRequest,
    MediaPart,
    MediaResult,
    ReconstructionRequest,
    RefineRequest,
    RollingRequest,
    RollingResult,
    SpeechGenerationRequest,
)

DEFAULT_VOCAB = string.digits + string.ascii_lowercase + " "


def _context_digest(context: Context) -> bytes:
    digest = hashlib.sha256()
    for part in (context,) if isinstance(context, str) else context:
        if isinstance(part, MediaPart):
            data = part.data.tobytes() if hasattr(part.data, "tobytes") else repr(part.data).encode()
            digest.update(b"\x01" + part.modality.encode() + hashlib.sha256(data).digest())
        else:
            digest.update(b"\x00" + part.encode("utf-8"))
    return digest.digest()


class RandomModel:
    """Pseudo-random answers keyed on ``(seed, request)``; implements :class:`evals.api.EvalModel`."""

    def __init__(self, seed: int = 0, vocab: str = DEFAULT_VOCAB) -> None:
        if not vocab:
            raise ValueError("RandomModel vocab must not be empty")
        self.seed = seed
        self.vocab = vocab

    @property
    def fingerprint(self) -> str:
        vocab_hash = hashlib.sha256(self.vocab.encode("utf-8")).hexdigest()[:8]
        return f"random-v1:seed={self.seed}:vocab={vocab_hash}"

    def _rng(self, *parts: bytes) -> random.Random:
        digest = hashlib.sha256(str(self.seed).encode() + b"\x00" + b"\x00".join(parts)).digest()
        return random.Random(int.from_bytes(digest[:16], "big"))

    def _score(self, context_key: bytes, text: str) -> float:
        rng = self._rng(context_key, text.encode("utf-8"), b"score")
        return sum(-0.5 - 4.0 * rng.random() for _ in text)

    def loglikelihood(self, requests: list[LoglikelihoodRequest]) -> Answers[LoglikelihoodResult]:
        out = []
        for r in requests:
            key = _context_digest(r.context)
            greedy = self._rng(key, r.continuation.encode("utf-8"), b"greedy").random() < 0.1
            out.append(LoglikelihoodResult(self._score(key, r.continuation), greedy, len(r.continuation)))
        return Answers(out)

    def loglikelihood_rolling(self, requests: list[RollingRequest]) -> Answers[RollingResult]:
        return Answers([RollingResult(self._score(b"rolling", r.text), len(r.text)) for r in requests])

    def generate(self, requests: list[GenerationRequest]) -> Answers[GenerationResult]:
        out = []
        for r in requests:
            settings = f"{r.max_new_tokens}:{r.temperature}:{r.seed}".encode()
            rng = self._rng(_context_digest(r.context), settings)
            text = "".join(rng.choice(self.vocab) for _ in range(rng.randint(1, 8)))[: r.max_new_tokens]
            for stop in r.stop:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(GenerationResult(text, len(text)))
        return Answers(out)

    def _noise(self, key: bytes, shape: tuple[int, ...]) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(str(self.seed).encode() + key).digest()[:8], "big")
        return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)

    def generate_media(self, requests: list[MediaGenerationRequest]) -> Answers[MediaResult]:
        """Uniform noise frames of the default 32 px size, a function of the request."""
        out = []
        for r in requests:
            key = f"media:{r.prompt}:{r.n_frames}:{r.cfg_scale}:{r.temperature}:{r.seed}".encode()
            out.append(MediaResult(self._noise(key, (r.n_frames, 32, 32, 3)), r.n_frames * 85))
        return Answers(out)

    def reconstruct(self, requests: list[ReconstructionRequest]) -> Answers[MediaResult]:
        """Noise of the input's shape (a tokenizer or codec that learned nothing)."""
        out = []
        for r in requests:
            if r.media.modality == "audio":
                out.append(MediaResult(self._wave(_context_digest((r.media,)), len(r.media.data))))
                continue
            frames = _frames(r.media)
            out.append(MediaResult(self._noise(_context_digest((r.media,)), frames.shape)))
        return Answers(out)

    def generate_speech(self, requests: list[SpeechGenerationRequest]) -> Answers[MediaResult]:
        """Quiet Gaussian noise (8 kHz) of a request-dependent length up to ``max_frames`` 40 ms frames."""
        out = []
        for r in requests:
            key = f"speech:{r.prompt}:{r.speaker}:{r.max_frames}:{r.temperature}:{r.top_k}:{r.seed}".encode()
            n_frames = 1 + self._rng(key).randrange(max(1, r.max_frames))
            out.append(MediaResult(self._wave(key, n_frames * 320), n_frames))
        return Answers(out)

    def _wave(self, key: bytes, n: int) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(str(self.seed).encode() + key).digest()[:8], "big")
        return (0.1 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)

    def refine(self, requests: list[RefineRequest]) -> Answers[MediaResult]:
        """Nearest-neighbour 2x upsampling (no detail added)."""
        return Answers([MediaResult(_frames(r.media).repeat(2, axis=1).repeat(2, axis=2)) for r in requests])


def _frames(media: MediaPart) -> np.ndarray:
    """uint8 ``(T, H, W, 3)`` of an image or clip part."""
    data = np.asarray(media.data)
    return data[None] if media.modality == "image" else data
