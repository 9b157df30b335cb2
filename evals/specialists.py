"""Specialist baselines: a small model trained for one job on the same train split, asked the same items.

A score of the unified model means little alone: 0.70 on a digit question is good if a classifier
trained for exactly that job on the same pictures gets 0.72, and poor if it gets 0.97. A specialist
here is an :class:`~evals.api.EvalModel` that answers a task's own requests, so the task scores it with
its own code, on its own items (the same ``limit`` and ``seed`` draw the same examples), with the same
stderr:

  * ``digits`` answers ``Which digit is this?`` about an image (``digit_vqa`` and the cross-source
    ``digit_vqa_*``) with the project's digit judge (:mod:`evals.judges`: a two-layer CNN trained on the
    MNIST train split the pretraining mixture draws from): the log-likelihood of choice ``d`` is the
    judge's log-probability of ``d``.
  * ``speech`` answers the FSDD speech tasks (``asr_fsdd``: its transcript; ``spoken_digit_qa``: the
    choice it transcribes) with the reference recogniser (:mod:`evals.audio_judges`: a CTC recogniser
    trained on the FSDD train recordings of the seen speakers and DTMF tones; never on the unseen one).
  * ``speech_voices`` answers the same tasks with the speech-content encoder the shipped reference reads
    (:mod:`ernie5.tokenizers.speech_content`: CTC over FSDD's seen speakers, eSpeak NG voices and
    LJSpeech; never the unseen speaker), by its greedy transcript: the specialist trained on the same
    voices as the reference, where ``speech`` is trained on FSDD's four.

``ernie5 specialists --suite SUITE`` evaluates every task of a suite that has a specialist
(:func:`suite_specialists`) and prints their scores in the shape of ``results.csv`` rows, subnet
``specialist``.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from evals.api import Answers, GenerationResult, LoglikelihoodResult, MediaPart

DIGIT_TASKS = ("digit_vqa", "digit_vqa_strokes", "digit_vqa_usps", "digit_vqa_semeion")
SPEECH_TASKS = ("asr_fsdd", "spoken_digit_qa")
MISS = -30.0
"""Log-likelihood given to a choice the specialist did not pick (a choice it picked gets 0)."""


def _media(context: Any, modality: str) -> np.ndarray:
    parts = [p for p in (context if isinstance(context, tuple) else (context,)) if isinstance(p, MediaPart)]
    if len(parts) != 1 or parts[0].modality != modality:
        raise ValueError(
            f"a specialist request needs one {modality} part, got {[type(p).__name__ for p in parts]}"
        )
    return np.asarray(parts[0].data)


class DigitSpecialist:
    """The digit judge as an eval model: ``log P(d | image)`` for the choice `` d``."""

    def __init__(self, judge: Any) -> None:
        self.judge = judge
        self.name = f"specialist:{judge.version}"

    def loglikelihood(self, requests: list) -> Answers[LoglikelihoodResult]:
        images = [_media(r.context, "image") for r in requests]
        probs = self.judge.probabilities(np.stack(images)) if images else np.zeros((0, 10))
        out = []
        for r, p in zip(requests, probs):
            digit = r.continuation.strip()
            if not (len(digit) == 1 and digit.isdigit()):
                raise ValueError(f"the digit specialist answers digits 0-9, got choice {r.continuation!r}")
            out.append(LoglikelihoodResult(math.log(max(float(p[int(digit)]), 1e-30)), False, 1))
        return Answers(out)


class SpeechSpecialist:
    """The reference recogniser as an eval model: its transcript, and choices by that transcript."""

    def __init__(self, recognizer: Any) -> None:
        self.recognizer = recognizer
        self.name = f"specialist:{recognizer.name}"

    def _transcripts(self, requests: list) -> list[str]:
        return self.recognizer.transcribe([_media(r.context, "audio").astype(np.float32) for r in requests])

    def generate(self, requests: list) -> Answers[GenerationResult]:
        return Answers([GenerationResult(t, len(t.split())) for t in self._transcripts(requests)])

    def loglikelihood(self, requests: list) -> Answers[LoglikelihoodResult]:
        said = self._transcripts(requests)
        return Answers(
            [
                LoglikelihoodResult(0.0 if r.continuation.strip() == t else MISS, False, 1)
                for r, t in zip(requests, said)
            ]
        )


def _digits(data_dir: str | Path | None) -> DigitSpecialist:
    from evals.judges import load_digit_judge

    return DigitSpecialist(load_digit_judge(data_dir))


def _speech(data_dir: str | Path | None) -> SpeechSpecialist:
    from evals.audio_judges import load_digit_recognizer

    return SpeechSpecialist(load_digit_recognizer(data_dir))


class ContentRecognizer:
    """A speech-content encoder's greedy CTC transcripts, as the speech specialist asks for them."""

    def __init__(self, encoder: Any, name: str) -> None:
        self.encoder, self.name = encoder, name

    def transcribe(self, waves: list[np.ndarray]) -> list[str]:
        import torch

        out: list[str] = []
        for i in range(0, len(waves), 32):
            chunk = waves[i : i + 32]
            wave_BS = torch.zeros(len(chunk), max(1, max(len(w) for w in chunk)))
            for j, w in enumerate(chunk):
                wave_BS[j, : len(w)] = torch.from_numpy(np.asarray(w, dtype=np.float32))
            out += self.encoder.transcribe(wave_BS, torch.tensor([max(1, len(w)) for w in chunk]))
        return out


def _speech_voices(_data_dir: str | Path | None) -> SpeechSpecialist:
    from ernie5.store.checkpoint import load_checkpoint

    ckpt = load_checkpoint("reference", fast=False)
    encoder = None if ckpt.audio_codec is None else ckpt.audio_codec.content_encoder
    if encoder is None:
        raise ValueError("the shipped reference carries no speech-content encoder")
    return SpeechSpecialist(ContentRecognizer(encoder, "speech-content-encoder"))


SPECIALISTS: dict[str, tuple[tuple[str, ...], Callable[[str | Path | None], Any]]] = {
    "digits": (DIGIT_TASKS, _digits),
    "speech": (SPEECH_TASKS, _speech),
    "speech_voices": (SPEECH_TASKS, _speech_voices),
}
"""Specialist name -> (the tasks it answers, how it is loaded for a data root)."""


def specialists_for(task: str) -> list[str]:
    """The names of the specialists that answer ``task`` (none: empty)."""
    return [name for name, (tasks, _) in SPECIALISTS.items() if task in tasks]


def specialist_rows(
    units: list[tuple[str, dict[str, Any], int | None, int]], data_dir: str | Path | None
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Evaluate the specialists on ``units`` (``(task, kwargs, limit, seed)``, as a suite plans them:
    the same arguments draw the same items as the sweep).

    Returns ``(rows, skipped)``: one row per task and metric (``subnet="specialist"``, ``task``,
    ``metric``, ``value``, ``stderr``, ``n``, ``specialist``), and ``{"task", "reason"}`` for tasks with
    no specialist or whose data is missing.
    """
    from evals.task import TASKS

    loaded: dict[str, Any] = {}
    rows, skipped = [], []
    for name, kwargs, limit, seed in units:
        names = specialists_for(name)
        task = TASKS.get(name)(**kwargs)
        ok, why = task.available(data_dir)
        if not names or not ok:
            skipped.append({"task": name, "reason": why if names else "no specialist for this task"})
            continue
        for which in names:
            if which not in loaded:
                loaded[which] = SPECIALISTS[which][1](data_dir)
            with tempfile.TemporaryDirectory() as work:
                result = task.evaluate(
                    loaded[which], data_dir=data_dir, limit=limit, seed=seed, work_dir=Path(work)
                )
            for metric, agg in result.metrics.items():
                rows.append(
                    {
                        "subnet": "specialist",
                        "task": name,
                        "metric": metric,
                        "value": agg["value"],
                        "stderr": agg["stderr"],
                        "n": agg["n"],
                        "specialist": loaded[which].name,
                    }
                )
    return rows, skipped


def suite_specialists(suite: str | Path, data_dir: str | Path | None) -> dict[str, Any]:
    """:func:`specialist_rows` over the tasks of ``suite`` (a name or YAML), with their limits and seeds."""
    from evals.suite import load_suite

    cfg = load_suite(suite).cfg
    units = [
        (e.task, dict(e.kwargs), e.limit, cfg.seed if e.seed is None else e.seed)
        for e in cfg.tasks
        if specialists_for(e.task)
    ]
    rows, skipped = specialist_rows(units, data_dir)
    return {"suite": cfg.name, "rows": rows, "skipped": skipped}
