"""Speech and tone generation, judged (``tts_dtmf``, ``tts_digits``): ``Say: seven three.`` (with the
speaker's embedding) or ``Dial: five star.`` -> Next-Codec Prediction -> codec decoder -> a judge transcribes
the waveform (the reference recogniser of ``evals.audio_judges``, or the exact Goertzel decoder for tones,
as Seed-TTS-eval does with Whisper); WER/CER against the prompt's words.

References:
  * Seed-TTS-eval (Anastassiou et al., 2024, arXiv:2406.02430): TTS judged by transcribing the output.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from ernie5.data.audio import (
    DIGIT_WORDS,
    FSDD_HOW_TO_GET,
    FSDD_TRAIN_SPEAKERS,
    SAMPLE_RATE,
    normalize_text,
)
from ernie5.data.audio_sources import (
    dial_prompt,
    say_prompt,
)
from ernie5.data.dtmf import DTMF_KEYS
from evals.api import (
    MediaResult,
    Request,
    Response,
    SpeechGenerationRequest,
)
from evals.task import TASKS, Example, Score, Task
from evals.tasks.audio_items import FRAME_RATE, GENERATED_TONES, AudioExample, error_scores, fsdd_test_files
from evals.tasks.media import CountOptions


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
    packages = ("jiwer",)  # WER and CER
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
        return error_scores(example.target, heard)

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
    how_to_get = GENERATED_TONES
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
    data_files = fsdd_test_files()
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
