"""The model as the harness sees it: the request kinds (:data:`REQUEST_KINDS`) and the EvalModel protocol.

Tasks build requests; a model answers them in batches. Contexts are plain text or, for
multimodal tasks, a tuple of parts (text strings and :class:`MediaPart` items) that the model
adapter turns into segments of the unified sequence. The contracts follow lm-eval's ``LM``:

* ``loglikelihood``: log P(continuation | context), summed over the continuation's tokens, and
  whether greedy decoding would have produced the continuation exactly. The context ends where
  the continuation begins: any separating space belongs to the continuation (``" Paris"``).
* ``loglikelihood_rolling``: log P(text) of a whole document, scored with as much left context as
  fits, in windows when the document is longer than the model's context.
* ``generate``: a continuation of the context, greedy unless ``temperature > 0``, cut at the first
  stop string (the stop string itself is not returned) or after ``max_new_tokens`` tokens.
* ``generate_media`` (optional): an image or clip for a text prompt; ``generate_speech``
  (optional): a waveform for a text prompt (Next-Codec Prediction, optionally with a speaker);
  ``reconstruct`` (optional): a vision-tokenizer or audio-codec round trip; ``refine`` (optional):
  the cascaded refiner's 2x upsampling. All four answer with :class:`MediaResult`.

Every method answers a list of requests with :class:`Answers`: the results in request order, what
each cost (HELM-style latency and token counts, which the response cache stores with the answer),
the seconds spent inside model forwards and, for a mixture-of-experts model, how many (token,
slot) pairs each expert of each layer received from the real (non-padding) tokens. Nothing about a
call comes back any other way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, runtime_checkable


@dataclass(frozen=True)
class MediaPart:
    """A non-text input inside a context (an image, a clip or a waveform)."""

    modality: Literal["image", "video", "audio"]
    data: Any
    """A numpy array: image (H, W) or (H, W, C) uint8; video (T, H, W[, C]); audio (samples,) float32."""
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """E.g. ``{"sample_rate": 8000}`` for audio."""


Context = str | tuple[str | MediaPart, ...]


@dataclass(frozen=True)
class LoglikelihoodRequest:
    """Score ``continuation`` after ``context``."""

    context: Context
    continuation: str


@dataclass(frozen=True)
class RollingRequest:
    """Score a whole document."""

    text: str


@dataclass(frozen=True)
class GenerationRequest:
    """Continue ``context``."""

    context: Context
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class MediaGenerationRequest:
    """Generate an image (``n_frames = 1``) or a clip from a text prompt (Next-Frame-and-Scale)."""

    prompt: str
    n_frames: int = 1
    cfg_scale: float = 3.0
    """Classifier-free guidance scale (1 = no guidance)."""
    temperature: float = 1.0
    """Bit sampling temperature (0 = the sign of each bit logit)."""
    seed: int = 0


@dataclass(frozen=True)
class SpeechGenerationRequest:
    """Synthesise audio for a text prompt (Next-Codec Prediction); the answer is a float32 waveform."""

    prompt: str
    speaker: str = ""
    """A speaker the model was trained with (its speaker embedding conditions the audio); "" = none."""
    max_frames: int = 64
    temperature: float = 0.0
    """Code sampling temperature (0 = argmax)."""
    top_k: int = 0
    seed: int = 0


@dataclass(frozen=True)
class ReconstructionRequest:
    """Round-trip media through the model's vision tokenizer or audio codec (encode, decode)."""

    media: MediaPart


@dataclass(frozen=True)
class RefineRequest:
    """Upsample a low-resolution image or clip with the model's cascaded refiner."""

    media: MediaPart
    steps: int = 0
    """Sampling steps (0 = the refiner's default)."""
    seed: int = 0


Request = (
    LoglikelihoodRequest
    | RollingRequest
    | GenerationRequest
    | MediaGenerationRequest
    | SpeechGenerationRequest
    | ReconstructionRequest
    | RefineRequest
)


@dataclass(frozen=True)
class LoglikelihoodResult:
    """Answer to a :class:`LoglikelihoodRequest`."""

    logprob: float
    is_greedy: bool
    n_tokens: int


@dataclass(frozen=True)
class RollingResult:
    """Answer to a :class:`RollingRequest` (natural-log probability)."""

    logprob: float
    n_tokens: int


@dataclass(frozen=True)
class GenerationResult:
    """Answer to a :class:`GenerationRequest`."""

    text: str
    n_tokens: int


@dataclass(frozen=True)
class MediaResult:
    """Answer to a media request: uint8 ``(T, H, W, 3)`` frames (T = 1 for an image), or a float32
    waveform ``(samples,)`` at the codec's sample rate for audio."""

    media: Any = field(hash=False, compare=False)
    n_tokens: int = 0
    """Generated visual tokens or audio frames (0 for reconstruction and refinement)."""


Response = LoglikelihoodResult | RollingResult | GenerationResult | MediaResult
R = TypeVar("R", LoglikelihoodResult, RollingResult, GenerationResult, MediaResult)


@dataclass(frozen=True)
class Cost:
    """What answering one request cost: its share of its batch's wall time and its token counts."""

    latency_s: float = 0.0
    n_input_tokens: int = 0
    n_output_tokens: int = 0


@dataclass
class Answers(Generic[R]):
    """A model's answers to a list of requests, with what they cost."""

    results: list[R]
    """One result per request, in request order."""
    costs: list[Cost] | None = None
    """One cost per request (None: all zero)."""
    model_s: float = 0.0
    """Seconds spent inside model forwards for these answers."""
    routing: dict[int, list[int]] = field(default_factory=dict)
    """MoE layer -> routed (token, slot) pairs per expert, over real tokens (empty: not recorded,
    or not an MoE model)."""

    def __post_init__(self) -> None:
        if self.costs is None:
            self.costs = [Cost()] * len(self.results)
        if len(self.costs) != len(self.results):
            raise ValueError(f"{len(self.results)} results but {len(self.costs)} costs")

    def __len__(self) -> int:
        return len(self.results)

    def __iter__(self):
        return iter(self.results)

    def __getitem__(self, i: int) -> R:
        return self.results[i]


def add_routing(total: dict[int, list[int]], more: dict[int, list[int]]) -> dict[int, list[int]]:
    """``total`` with the expert loads of ``more`` added, layer by layer (in place; returned)."""
    for layer, counts in more.items():
        old = total.get(layer)
        total[layer] = list(counts) if old is None else [a + b for a, b in zip(old, counts, strict=True)]
    return total


@runtime_checkable
class EvalModel(Protocol):
    """What every evaluated model (an ERNIE5 subnet, a random baseline) provides."""

    @property
    def fingerprint(self) -> str:
        """Identity of the weights *and* the subnet; two models with different answers never share it."""
        ...

    def loglikelihood(self, requests: list[LoglikelihoodRequest]) -> Answers[LoglikelihoodResult]:
        """One result per request, in order."""
        ...

    def loglikelihood_rolling(self, requests: list[RollingRequest]) -> Answers[RollingResult]:
        """One result per request, in order."""
        ...

    def generate(self, requests: list[GenerationRequest]) -> Answers[GenerationResult]:
        """One result per request, in order."""
        ...


@dataclass(frozen=True)
class RequestKind:
    """One kind of request: the method that answers it, its result type and its name in the cache."""

    name: str
    """Its name in the response cache's ``kind`` column and key (stored in cached rows: never renamed)."""
    request: type
    method: str
    """The :class:`EvalModel` method that answers a list of these requests with :class:`Answers`."""
    result: type

    @property
    def media(self) -> bool:
        """Whether its answers carry an image, a clip or a waveform (:class:`MediaResult`)."""
        return self.result is MediaResult


REQUEST_KINDS: tuple[RequestKind, ...] = (
    RequestKind("loglikelihood", LoglikelihoodRequest, "loglikelihood", LoglikelihoodResult),
    RequestKind("rolling", RollingRequest, "loglikelihood_rolling", RollingResult),
    RequestKind("generate", GenerationRequest, "generate", GenerationResult),
    RequestKind("generate_media", MediaGenerationRequest, "generate_media", MediaResult),
    RequestKind("generate_speech", SpeechGenerationRequest, "generate_speech", MediaResult),
    RequestKind("reconstruct", ReconstructionRequest, "reconstruct", MediaResult),
    RequestKind("refine", RefineRequest, "refine", MediaResult),
)
"""Every request kind, in the order a task's requests are answered. The one table of kinds: the task
pipeline dispatches by it (:meth:`evals.task.Task.evaluate`), the response cache names, encodes and
answers by it (:class:`evals.cache.CachedModel` has one method per row), and the checkpoint adapter and
the random model implement its methods (``tests/evals/test_request_kinds.py`` holds all three to it)."""

KIND_OF: dict[type, RequestKind] = {k.request: k for k in REQUEST_KINDS}
"""Request type -> its :class:`RequestKind`."""
"""Optional EvalModel methods for media requests (``generate_media``, ``generate_speech``,
``reconstruct``, ``refine``):
a model without one answers tasks that need it with a clear error, recorded as an error unit."""
