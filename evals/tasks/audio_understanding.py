"""Audio understanding: recognition (``asr_dtmf``, ``asr_fsdd``: ``BOA <audio> EOA Transcript:`` then greedy
generation, corpus WER/CER and exact match) and multiple choice after a waveform (``spoken_digit_qa``,
``speaker_id``). Items, groups and scores: :mod:`evals.tasks.audio_items`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from ernie5.data.audio import (
    DIGIT_WORDS,
    FSDD_TRAIN_SPEAKERS,
    fsdd_sequences,
    fsdd_utterances,
    sequences_from,
)
from ernie5.data.audio_sources import (
    DIGIT_SPOKEN_QUESTION,
    SPEAKER_QUESTION,
    TRANSCRIPT_PREFIX,
)
from evals.api import (
    GenerationRequest,
    GenerationResult,
    LoglikelihoodRequest,
    Request,
    Response,
)
from evals.task import TASKS, Example, Score, Task
from evals.tasks.audio_items import (
    AudioExample,
    DtmfSequences,
    FsddTest,
    SeenUnseen,
    audio_part,
    error_scores,
    unseen_utterances,
    with_unseen,
)
from evals.tasks.media import ChoiceOverMedia, CountOptions, question_prompt


# ---------------------------------------------------------------------- recognition
class _Asr(Task):
    requires = ("audio",)
    packages = ("jiwer",)  # WER and CER
    capability = "understanding"
    modality = "audio"
    metrics: ClassVar[dict[str, bool]] = {"wer": False, "cer": False, "exact_match": True}
    max_new_tokens: ClassVar[int] = 32

    def requests(self, example: AudioExample) -> list[Request]:
        return [
            GenerationRequest(
                (audio_part(example.wave), TRANSCRIPT_PREFIX),
                max_new_tokens=self.max_new_tokens,
                stop=("\n",),
            )
        ]

    def score(self, example: Example, responses: list[Response]) -> dict[str, Score]:
        if len(responses) != 1 or not isinstance(responses[0], GenerationResult):
            raise ValueError(f"{self.name}/{example.id}: expected one generation result")
        return error_scores(example.target, responses[0].text)


@TASKS.register("asr_dtmf")
class AsrDtmf(DtmfSequences, _Asr):
    """Transcribe keypad-tone sequences (1-5 keys of 0-9, *, #) into key words."""

    name = "asr_dtmf"
    version = 1


@TASKS.register("asr_fsdd")
class AsrFsdd(SeenUnseen, _Asr):
    """Transcribe spoken digit strings (2-4 FSDD recordings of one speaker, joined): ``n_examples`` from the
    seen speakers' test split (``wer``) and ``n_examples`` from the unseen speaker (``wer_unseen``)."""

    name = "asr_fsdd"
    version = 2
    Options = CountOptions
    metrics: ClassVar[dict[str, bool]] = with_unseen(_Asr.metrics)

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
class _ChoiceOverAudio(FsddTest, ChoiceOverMedia):
    """Multiple choice by log-likelihood after a waveform (the vision tasks' scoring, audio inputs)."""

    requires = ("audio",)
    modality = "audio"

    def requests(self, example: AudioExample) -> list[Request]:
        return [
            LoglikelihoodRequest((audio_part(example.wave), example.prompt), " " + c) for c in example.choices
        ]


@TASKS.register("spoken_digit_qa")
class SpokenDigitQA(SeenUnseen, _ChoiceOverAudio):
    """Which digit is spoken? 10-way choice over the seen speakers' test recordings (200, ``acc``) and
    250 recordings of the unseen speaker (``acc_unseen``)."""

    name = "spoken_digit_qa"
    version = 2
    metrics: ClassVar[dict[str, bool]] = with_unseen(_ChoiceOverAudio.metrics)

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        groups = (("seen", fsdd_utterances(data_dir, "test")), ("unseen", unseen_utterances(data_dir)))
        return [
            AudioExample(
                id=u.uid,
                prompt=question_prompt(DIGIT_SPOKEN_QUESTION),
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
                prompt=question_prompt(SPEAKER_QUESTION),
                target=u.speaker,
                choices=FSDD_TRAIN_SPEAKERS,
                gold=FSDD_TRAIN_SPEAKERS.index(u.speaker),
                wave=u.wave,
            )
            for u in fsdd_utterances(data_dir, "test")
        ]
