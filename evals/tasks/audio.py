"""Audio tasks: recognition (ASR), spoken-digit and speaker understanding, synthesis (TTS) judged by a
recogniser, and the codec's reconstruction quality.

Layouts are the pretraining mixture's (``ernie5.data.audio_sources``):
  * ASR: ``BOA <audio> EOA Transcript:`` then greedy generation up to a newline. Hypothesis and
    reference go through the one fixed normaliser (``ernie5.data.audio.normalize_text``); the metrics
    are corpus-level WER and CER (total edits over total reference words/characters, jiwer
    alignment) and the fraction of utterances transcribed exactly.
  * Understanding: ``BOA <audio> EOA Question: Which digit is spoken?\\nAnswer:`` (or ``Who is
    speaking?``), every choice scored by log-likelihood; ``acc``.
  * TTS: ``Say: seven three.`` (with the speaker's embedding) or ``Dial: five star.`` -> Next-Codec
    Prediction -> codec decoder -> a judge transcribes the waveform: the project's reference
    recogniser (``evals.audio_judges``, a CTC model trained on the FSDD train split; its version and
    held-out WER are in every sample record), or the exact Goertzel decoder for keypad tones, as
    Seed-TTS-eval does with Whisper. WER/CER against the prompt's words.
  * Codec: round trip through the checkpoint's codec; SNR (dB) and log-mel L1 distance.

Data: DTMF tasks are generated with a seed (always available: what the main job runs on a fresh
machine). FSDD tasks use the standard **test** split of the seen speakers (recordings 0-4 of each
speaker and digit; the pretraining mixture, the codec and the judge train on 5-49 of the same speakers);
multi-digit utterances are test recordings of one speaker joined with short silences. One FSDD speaker,
``FSDD_UNSEEN_SPEAKER``, is never trained on (``ernie5.data.audio``); ``asr_fsdd`` and
``spoken_digit_qa`` also score a fixed, seeded subset of its recordings (:data:`UNSEEN_PER_DIGIT` per
digit, :func:`unseen_eval_files`) and report it separately. ``ljspeech_mini`` (32 sentences) is a
sentence-level codec check.

Seen and unseen speakers (``asr_fsdd``, ``spoken_digit_qa``): every example belongs to one group,
``seen`` or ``unseen`` (``info["group"]``, and ``group`` in its sample record). The task's usual metrics
(``wer``, ``cer``, ``exact_match``; ``acc``), the primary one first, are over the **seen** speakers only;
the same metrics with the suffix ``_unseen`` are over the unseen speaker only, each with its own ``n``.
An example's score of the other group's metrics is None (left out of its sample record). A ``limit``
draws the two groups alternately, each in its own seeded order, so a small limit still measures both.

Chance levels: ``spoken_digit_qa`` 10 %, ``speaker_id`` 25 %; a model that outputs nothing has WER 1.

References:
  1. Z. Jackson et al., Free Spoken Digit Dataset (the standard split: index 0-4 test, 5-49 train).
  2. Seed-TTS-eval (Anastassiou et al., 2024, arXiv:2406.02430): TTS judged by transcribing the output.

Deviations:
  1. The standard FSDD split is per utterance (every speaker in train and test); here one speaker is also
     held out entirely, so the ASR and spoken-digit scores come in two groups, seen and unseen speaker.
  2. ``speaker_id`` is a closed-set choice over the seen (training) speakers only: the held-out speaker
     has no name the model could have learned, so its recordings never appear there. ``tts_digits`` asks
     for seen speakers only (the held-out one has no speaker id).
  3. The unseen-speaker group is a balanced subset of the held-out speaker's recordings (25 of 50 per
     digit, 250 of 500), the size of the seen test split; it draws from every index 0..49, since none of
     them is trained on.
"""

from __future__ import annotations

import math
import random
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ernie5.data.audio import (
    DIGIT_WORDS,
    FSDD_DIR,
    FSDD_HOW_TO_GET,
    FSDD_INDICES,
    FSDD_TEST_INDICES,
    FSDD_TRAIN_SPEAKERS,
    FSDD_UNSEEN_SPEAKER,
    LJSPEECH_HOW_TO_GET,
    LJSPEECH_METADATA,
    SAMPLE_RATE,
    Utterance,
    fsdd_files,
    fsdd_sequences,
    fsdd_utterances,
    ljspeech_utterances,
    normalize_text,
    read_wav,
    sequences_from,
)
from ernie5.data.audio_sources import (
    DIGIT_SPOKEN_QUESTION,
    SPEAKER_QUESTION,
    TRANSCRIPT_PREFIX,
    dial_prompt,
    say_prompt,
)
from ernie5.data.dtmf import DTMF_KEYS, dtmf_utterance
from ernie5.data.root import require_file
from evals.api import (
    GenerationRequest,
    GenerationResult,
    LoglikelihoodRequest,
    MediaPart,
    MediaResult,
    ReconstructionRequest,
    Request,
    Response,
    SpeechGenerationRequest,
)
from evals.metrics import char_errors, word_errors
from evals.task import TASKS, Example, Score, Task, UnitResult
from evals.tasks.vision import CountOptions, _ChoiceOverMedia, _question

GENERATED = "nothing to get: keypad tones are generated from the seed"
FRAME_RATE = 25.0
"""Codec frames per second assumed when sizing a TTS request's frame budget."""


UNSEEN = "_unseen"
"""Suffix of a metric over the held-out (unseen) speaker's examples."""
UNSEEN_PER_DIGIT = 25
"""Recordings of the unseen speaker scored per digit (250 in all, the size of the seen test split)."""
UNSEEN_SEED = "fsdd-unseen-speaker-eval"
"""Seed of the unseen speaker's evaluated subset (fixed: the subset never changes)."""


def _fsdd_test_files() -> tuple[str, ...]:
    return tuple(
        f"{FSDD_DIR}/{d}_{spk}_{i}.wav"
        for d in range(10)
        for spk in FSDD_TRAIN_SPEAKERS
        for i in FSDD_TEST_INDICES
    )


def unseen_eval_indices(digit: int) -> list[int]:
    """The recording indices of the unseen speaker scored for ``digit``: a fixed, seeded choice of
    :data:`UNSEEN_PER_DIGIT` of 0..49, sorted."""
    return sorted(random.Random(f"{UNSEEN_SEED}/{digit}").sample(range(FSDD_INDICES), UNSEEN_PER_DIGIT))


def unseen_eval_files() -> tuple[str, ...]:
    """The unseen speaker's scored recordings, relative to the data root (in (digit, index) order)."""
    return tuple(
        f"{FSDD_DIR}/{d}_{FSDD_UNSEEN_SPEAKER}_{i}.wav" for d in range(10) for i in unseen_eval_indices(d)
    )


def unseen_utterances(data_dir: str | Path | None) -> list[Utterance]:
    """The unseen speaker's scored recordings (:func:`unseen_eval_files`) as ``fsdd`` utterances.

    Raises:
        DataMissing: no FSDD recordings of the unseen speaker under ``data_dir``.
    """
    keep = {(d, i) for d in range(10) for i in unseen_eval_indices(d)}
    present = {(d, i): p for d, _, i, p in fsdd_files(data_dir, "unseen") if (d, i) in keep}
    out = []
    for d, i in sorted(keep):
        rel = f"{FSDD_DIR}/{d}_{FSDD_UNSEEN_SPEAKER}_{i}.wav"
        path = present.get((d, i)) or require_file(data_dir, rel, FSDD_HOW_TO_GET)
        out.append(
            Utterance(
                read_wav(path),
                DIGIT_WORDS[d],
                FSDD_UNSEEN_SPEAKER,
                "fsdd",
                f"fsdd/{d}_{FSDD_UNSEEN_SPEAKER}_{i}",
            )
        )
    return out


def _with_unseen(metrics: dict[str, bool]) -> dict[str, bool]:
    """``metrics`` (over the seen speakers, the primary first) followed by their ``_unseen`` twins."""
    return {**metrics, **{m + UNSEEN: hib for m, hib in metrics.items()}}


@dataclass(frozen=True)
class AudioExample(Example):
    """An example with its waveform (float32, 8 kHz) and any judge targets."""

    wave: Any = field(default=None, hash=False, compare=False)
    info: dict = field(default_factory=dict, hash=False, compare=False)


def _part(wave: np.ndarray) -> MediaPart:
    return MediaPart("audio", np.asarray(wave, dtype=np.float32), {"sample_rate": SAMPLE_RATE})


def _error_scores(reference: str, hypothesis: str) -> dict[str, Score]:
    ref, hyp = normalize_text(reference), normalize_text(hypothesis)
    return {
        "wer": word_errors(ref, hyp),
        "cer": char_errors(ref, hyp),
        "exact_match": float(ref == hyp),
    }


def _dtmf_examples(name: str, n: int) -> list[AudioExample]:
    out = []
    for i in range(n):
        rng = random.Random(f"{name}/{i}")
        keys = "".join(rng.choice(DTMF_KEYS) for _ in range(rng.randint(1, 5)))
        u = dtmf_utterance(keys, rng)
        out.append(AudioExample(id=f"{name}-{i}", prompt=keys, target=u.text, wave=u.wave))
    return out


class _DtmfSequences:
    """Mixin: held-out keypad-tone sequences generated with a seed (no data needed)."""

    splits = ("generated",)
    how_to_get = GENERATED
    Options = CountOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        return _dtmf_examples(self.name, self.options.n_examples)


class _FsddTest:
    """Mixin: the FSDD test split (takes 0-4) under the data root."""

    splits = ("test",)
    data_files = _fsdd_test_files()
    how_to_get = FSDD_HOW_TO_GET


class _SeenUnseen:
    """Mixin: examples in two groups, the seen speakers' test split and the held-out (unseen) speaker.

    ``all_examples`` returns every example with ``info["group"]`` ``seen`` or ``unseen``. Scores: the base
    task's metrics for a seen example, the same metrics suffixed ``_unseen`` for an unseen one; the other
    group's metrics are None, which :meth:`aggregate` skips and :meth:`evaluate` leaves out of the sample
    records (and out of each metric's ``n``). See the module docstring.
    """

    splits = ("test", "unseen")
    data_files = _fsdd_test_files() + unseen_eval_files()
    how_to_get = FSDD_HOW_TO_GET

    def examples(
        self, data_dir: str | Path | None, *, limit: int | None = None, seed: int = 0
    ) -> list[Example]:
        """All examples (seen first), or the first ``limit`` of the two groups alternated, each group in
        its own seeded order (a smaller limit selects a prefix of a larger one)."""
        exs = self.all_examples(data_dir)
        if limit is None:
            return exs
        if limit < 0:
            raise ValueError(f"limit={limit} must be >= 0")
        groups = []
        for g in ("seen", "unseen"):
            members = [e for e in exs if e.info["group"] == g]
            order = list(range(len(members)))
            random.Random(f"{self.name}/{g}:{seed}").shuffle(order)
            groups.append([members[i] for i in order])
        out = [e for pair in zip(*groups) for e in pair]
        shorter = min(len(x) for x in groups)
        out += [e for x in groups for e in x[shorter:]]
        return out[:limit]

    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        base = super().score(example, responses)  # type: ignore[misc]
        unseen = example.info["group"] == "unseen"  # type: ignore[attr-defined]
        return {
            **{m: None if unseen else v for m, v in base.items()},
            **{m + UNSEEN: v if unseen else None for m, v in base.items()},
        }

    def aggregate(self, metric: str, values: Sequence[Score | None], seed: int = 0) -> tuple[float, float]:
        """The base aggregate of the group's values (None skipped); ``(nan, nan)`` for a group with none."""
        kept = [v for v in values if v is not None]
        if not kept:
            return math.nan, math.nan
        return super().aggregate(metric.removesuffix(UNSEEN), kept, seed=seed)  # type: ignore[misc]

    def evaluate(
        self, model: Any, *, data_dir: str | Path | None, limit: int | None, seed: int, work_dir: Path
    ) -> UnitResult:
        """The base evaluation; then each metric's ``n`` counts its own group's examples (value and stderr
        None for a group without any) and the sample records keep only their group's scores."""
        result = super().evaluate(  # type: ignore[misc]
            model, data_dir=data_dir, limit=limit, seed=seed, work_dir=work_dir
        )
        for s in result.samples:
            s["scores"] = {k: v for k, v in s["scores"].items() if v is not None}
        for metric, m in result.metrics.items():
            m["n"] = sum(metric in s["scores"] for s in result.samples)
            if m["n"] == 0:
                m["value"] = m["stderr"] = None
        return result

    def describe_sample(self, example, responses, scores) -> dict:
        out = super().describe_sample(example, responses, scores)  # type: ignore[misc]
        out["scores"] = {k: v for k, v in out.get("scores", {}).items() if v is not None}
        return {**out, "group": example.info["group"], "speaker": example.info["speaker"]}


# ---------------------------------------------------------------------- recognition
class _Asr(Task):
    requires = ("audio",)
    capability = "understanding"
    modality = "audio"
    metrics: ClassVar[dict[str, bool]] = {"wer": False, "cer": False, "exact_match": True}
    max_new_tokens: ClassVar[int] = 32

    def requests(self, example: AudioExample) -> list[Request]:
        return [
            GenerationRequest(
                (_part(example.wave), TRANSCRIPT_PREFIX), max_new_tokens=self.max_new_tokens, stop=("\n",)
            )
        ]

    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        if len(responses) != 1 or not isinstance(responses[0], GenerationResult):
            raise ValueError(f"{self.name}/{example.id}: expected one generation result")
        return _error_scores(example.target, responses[0].text)


@TASKS.register("asr_dtmf")
class AsrDtmf(_DtmfSequences, _Asr):
    """Transcribe keypad-tone sequences (1-5 keys of 0-9, *, #) into key words."""

    name = "asr_dtmf"
    version = 1


@TASKS.register("asr_fsdd")
class AsrFsdd(_SeenUnseen, _Asr):
    """Transcribe spoken digit strings (2-4 FSDD recordings of one speaker, joined): ``n_examples`` from the
    seen speakers' test split (``wer``) and ``n_examples`` from the unseen speaker (``wer_unseen``)."""

    name = "asr_fsdd"
    version = 2
    Options = CountOptions
    metrics: ClassVar[dict[str, bool]] = _with_unseen(_Asr.metrics)

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        n = self.options.n_examples
        seen = fsdd_sequences(data_dir, "test", n, 2, 4, seed=12345)
        unseen = sequences_from(unseen_utterances(data_dir), n, 2, 4, seed=12345, uid_prefix="unseen")
        return [
            AudioExample(
                id=f"{self.name}-{'unseen-' if g == 'unseen' else ''}{i}",
                prompt="",
                target=u.text,
                wave=u.wave,
                info={"speaker": u.speaker, "group": g},
            )
            for g, seqs in (("seen", seen), ("unseen", unseen))
            for i, u in enumerate(seqs)
        ]


# ---------------------------------------------------------------------- understanding
class _ChoiceOverAudio(_FsddTest, _ChoiceOverMedia):
    """Multiple choice by log-likelihood after a waveform (the vision tasks' scoring, audio inputs)."""

    requires = ("audio",)
    modality = "audio"

    def requests(self, example: AudioExample) -> list[Request]:
        return [LoglikelihoodRequest((_part(example.wave), example.prompt), " " + c) for c in example.choices]


@TASKS.register("spoken_digit_qa")
class SpokenDigitQA(_SeenUnseen, _ChoiceOverAudio):
    """Which digit is spoken? 10-way choice over the seen speakers' test recordings (200, ``acc``) and
    250 recordings of the unseen speaker (``acc_unseen``)."""

    name = "spoken_digit_qa"
    version = 2
    metrics: ClassVar[dict[str, bool]] = _with_unseen(_ChoiceOverAudio.metrics)

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        groups = (("seen", fsdd_utterances(data_dir, "test")), ("unseen", unseen_utterances(data_dir)))
        return [
            AudioExample(
                id=u.uid,
                prompt=_question(DIGIT_SPOKEN_QUESTION),
                target=u.text,
                choices=DIGIT_WORDS,
                gold=DIGIT_WORDS.index(u.text),
                wave=u.wave,
                info={"speaker": u.speaker, "group": g},
            )
            for g, utts in groups
            for u in utts
        ]


@TASKS.register("speaker_id")
class SpeakerId(_ChoiceOverAudio):
    """Who is speaking? The seen speakers' test recordings (200), 4-way choice over the seen (training)
    speakers; the held-out speaker never appears (it has no name the model could have learned)."""

    name = "speaker_id"
    version = 2

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        return [
            AudioExample(
                id=u.uid,
                prompt=_question(SPEAKER_QUESTION),
                target=u.speaker,
                choices=FSDD_TRAIN_SPEAKERS,
                gold=FSDD_TRAIN_SPEAKERS.index(u.speaker),
                wave=u.wave,
            )
            for u in fsdd_utterances(data_dir, "test")
        ]


# ---------------------------------------------------------------------- synthesis
@dataclass(frozen=True, kw_only=True)
class TtsOptions(CountOptions):
    """Options of the synthesis tasks."""

    temperature: float = 0.0
    """Code sampling temperature (0 = argmax)."""
    top_k: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.temperature <= 5.0:
            raise ValueError(f"temperature={self.temperature} must be in [0, 5]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")


def _wave_result(name: str, example: Example, responses: list[Response]) -> np.ndarray:
    if len(responses) != 1 or not isinstance(responses[0], MediaResult):
        raise ValueError(f"{name}/{example.id}: expected one media result")
    return np.asarray(responses[0].media, dtype=np.float32).reshape(-1)


class _Tts(Task):
    requires = ("audio",)
    capability = "generation"
    modality = "audio"
    metrics: ClassVar[dict[str, bool]] = {"wer": False, "cer": False, "exact_match": True}
    Options = TtsOptions

    def _frames(self, example: Example) -> int:
        return int(FRAME_RATE * (0.3 + 0.6 * len(example.target.split()))) + 4

    def requests(self, example: AudioExample) -> list[Request]:
        i = int(example.id.rsplit("-", 1)[1])
        o = self.options
        return [
            SpeechGenerationRequest(
                example.prompt,
                speaker=example.info.get("speaker", ""),
                max_frames=self._frames(example),
                temperature=o.temperature,
                top_k=o.top_k,
                seed=i,
            )
        ]

    @abstractmethod
    def transcribe(self, wave: np.ndarray) -> str:
        """What the task's judge hears in a generated waveform (normalised words)."""

    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        heard = self.transcribe(_wave_result(self.name, example, responses))
        self.__dict__.setdefault("_heard", {})[example.id] = heard  # describe_sample reuses it
        return _error_scores(example.target, heard)

    def describe_sample(self, example, responses, scores) -> dict:
        wave = _wave_result(self.name, example, responses)
        return {
            "id": example.id,
            "prompt": example.prompt,
            "target": example.target,
            "prediction": self.__dict__.get("_heard", {}).pop(example.id, None) or self.transcribe(wave),
            "seconds": round(len(wave) / SAMPLE_RATE, 3),
            "judge": self.judge_name,
            "scores": {k: list(v) if isinstance(v, tuple) else v for k, v in scores.items()},
        }

    judge_name: ClassVar[str] = ""


@TASKS.register("tts_dtmf")
class TtsDtmf(_Tts):
    """Dial keys (``Dial: five star.``); the exact Goertzel decoder transcribes the tones."""

    name = "tts_dtmf"
    version = 1
    splits = ("generated",)
    how_to_get = GENERATED
    judge_name = "goertzel"

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        return [
            self.draw(random.Random(f"{self.name}/{i}"), f"{self.name}-{i}")
            for i in range(self.options.n_examples)
        ]

    @staticmethod
    def draw(rng: random.Random, example_id: str) -> AudioExample:
        """One prompt of 1-5 keys drawn from ``rng`` (the evaluated ones and the RL stage's training ones)."""
        words = normalize_text("".join(rng.choice(DTMF_KEYS) for _ in range(rng.randint(1, 5))))
        return AudioExample(id=example_id, prompt=dial_prompt(words), target=words)

    def transcribe(self, wave: np.ndarray) -> str:
        from evals.audio_judges import dtmf_transcribe

        return dtmf_transcribe([wave])[0]


@TASKS.register("tts_digits")
class TtsDigits(_Tts):
    """Say 1-4 digits in a seen FSDD speaker's voice (the held-out speaker has no speaker id); the project's
    reference recogniser transcribes them."""

    name = "tts_digits"
    version = 2
    splits = ("generated",)
    data_files = _fsdd_test_files()
    how_to_get = FSDD_HOW_TO_GET

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        self._load_judge(data_dir)
        n = len(FSDD_TRAIN_SPEAKERS)
        return [
            self.draw(random.Random(f"{self.name}/{i}"), f"{self.name}-{i}", FSDD_TRAIN_SPEAKERS[i % n])
            for i in range(self.options.n_examples)
        ]

    @staticmethod
    def draw(rng: random.Random, example_id: str, speaker: str = "") -> AudioExample:
        """One prompt of 1-4 digit words drawn from ``rng``, said by ``speaker`` ("" = a seen speaker drawn
        from ``rng`` after the words: the RL stage's training prompts)."""
        words = " ".join(rng.choice(DIGIT_WORDS) for _ in range(rng.randint(1, 4)))
        speaker = speaker or rng.choice(FSDD_TRAIN_SPEAKERS)
        return AudioExample(id=example_id, prompt=say_prompt(words), target=words, info={"speaker": speaker})

    def _load_judge(self, data_dir: str | Path | None):
        from evals.audio_judges import load_digit_recognizer

        if getattr(self, "_judge", None) is None:
            self._judge = load_digit_recognizer(data_dir)
            self.judge_name = f"{self._judge.name} (held-out WER {self._judge.wer:.3f})"
        return self._judge

    def transcribe(self, wave: np.ndarray) -> str:
        if getattr(self, "_judge", None) is None:
            raise ValueError(f"{self.name}: examples() loads the reference recogniser before scoring")
        return self._judge.transcribe([wave])[0] if len(wave) else ""


# ---------------------------------------------------------------------- codec
class _CodecReconstruction(Task):
    """SNR and log-mel distance of the checkpoint's codec round trip."""

    requires = ("audio",)
    capability = "generation"
    modality = "audio"
    metrics: ClassVar[dict[str, bool]] = {"snr_db": True, "mel_distance": False}

    def requests(self, example: AudioExample) -> list[Request]:
        return [ReconstructionRequest(_part(example.wave))]

    def score(self, example: AudioExample, responses: list[Response]) -> dict[str, Score]:
        from ernie5.tokenizers.audio_codec import mel_distance, snr_db

        rec = _wave_result(self.name, example, responses)
        ref = np.asarray(example.wave, dtype=np.float32)
        n = len(ref)
        rec = np.pad(rec[:n], (0, max(0, n - len(rec))))
        return {"snr_db": float(snr_db(ref, rec)), "mel_distance": float(mel_distance(ref, rec, SAMPLE_RATE))}

    def describe_sample(self, example, responses, scores) -> dict:
        return {
            "id": example.id,
            "target": example.target,
            "seconds": round(len(example.wave) / SAMPLE_RATE, 3),
            "scores": {k: round(float(v), 3) for k, v in scores.items()},
        }


@TASKS.register("codec_dtmf")
class CodecDtmf(_DtmfSequences, _CodecReconstruction):
    """Codec round trip of held-out keypad-tone sequences."""

    name = "codec_dtmf"
    version = 1


@TASKS.register("codec_fsdd")
class CodecFsdd(_FsddTest, _CodecReconstruction):
    """Codec round trip of the seen speakers' FSDD test recordings (200)."""

    name = "codec_fsdd"
    version = 2

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        return [
            AudioExample(id=u.uid, prompt="", target=u.text, wave=u.wave)
            for u in fsdd_utterances(data_dir, "test")
        ]


@TASKS.register("codec_ljspeech")
class CodecLjspeech(_CodecReconstruction):
    """Codec round trip of the 32 LJSpeech sentences (resampled to 8 kHz): a sentence-level check."""

    name = "codec_ljspeech"
    version = 1
    splits = ("sample",)
    data_files = (LJSPEECH_METADATA, *(f"ljspeech_mini/wavs/LJ001-{i:04d}.wav" for i in range(1, 33)))
    how_to_get = LJSPEECH_HOW_TO_GET

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        return [
            AudioExample(id=u.uid, prompt="", target=u.text, wave=u.wave)
            for u in ljspeech_utterances(data_dir)
        ]
