"""The audio codec's quality: a round trip through the checkpoint's codec (``codec_dtmf``, ``codec_fsdd``,
``codec_ljspeech``); SNR (dB) and log-mel L1 distance.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np

from ernie5.data.audio import (
    LJSPEECH_HOW_TO_GET,
    LJSPEECH_METADATA,
    SAMPLE_RATE,
    fsdd_utterances,
    ljspeech_utterances,
)
from evals.api import (
    ReconstructionRequest,
    Request,
    Response,
)
from evals.task import TASKS, Example, Score, Task
from evals.tasks.audio_generation import _wave_result
from evals.tasks.audio_items import AudioExample, DtmfSequences, FsddTest, audio_part


# ---------------------------------------------------------------------- codec
class _CodecReconstruction(Task):
    """SNR and log-mel distance of the checkpoint's codec round trip."""

    requires = ("audio",)
    capability = "generation"
    modality = "audio"
    metrics: ClassVar[dict[str, bool]] = {"snr_db": True, "mel_distance": False}

    def requests(self, example: AudioExample) -> list[Request]:
        return [ReconstructionRequest(audio_part(example.wave))]

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
class CodecDtmf(DtmfSequences, _CodecReconstruction):
    """Codec round trip of held-out keypad-tone sequences."""

    name = "codec_dtmf"
    version = 1


@TASKS.register("codec_fsdd")
class CodecFsdd(FsddTest, _CodecReconstruction):
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
