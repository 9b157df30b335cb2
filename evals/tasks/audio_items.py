"""What the audio tasks share: their items (DTMF sequences, the seen speakers' FSDD test split, the held-out
speaker's subset), the seen/unseen groups, and the error scores. The tasks are by family:
:mod:`evals.tasks.audio_understanding` (ASR, spoken digits, speakers), :mod:`evals.tasks.audio_generation`
(TTS judged by a recogniser) and :mod:`evals.tasks.audio_quality` (the codec's reconstruction).

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ernie5.data.audio import (
    DIGIT_WORDS,
    FSDD_DIR,
    FSDD_HOW_TO_GET,
    FSDD_INDICES,
    FSDD_TEST_INDICES,
    FSDD_TRAIN_SPEAKERS,
    FSDD_UNSEEN_SPEAKER,
    SAMPLE_RATE,
    Utterance,
    fsdd_files,
    normalize_text,
    read_wav,
)
from ernie5.data.dtmf import DTMF_KEYS, dtmf_utterance
from ernie5.data.root import require_file
from evals.api import (
    MediaPart,
    Response,
)
from evals.metrics import char_errors, word_errors
from evals.task import Example, Score, UnitResult
from evals.tasks.media import CountOptions

GENERATED_TONES = "nothing to get: keypad tones are generated from the seed"


FRAME_RATE = 25.0
"""Codec frames per second assumed when sizing a TTS request's frame budget."""


UNSEEN = "_unseen"
"""Suffix of a metric over the held-out (unseen) speaker's examples."""


UNSEEN_PER_DIGIT = 25
"""Recordings of the unseen speaker scored per digit (250 in all, the size of the seen test split)."""


UNSEEN_SEED = "fsdd-unseen-speaker-eval"
"""Seed of the unseen speaker's evaluated subset (fixed: the subset never changes)."""


def fsdd_test_files() -> tuple[str, ...]:
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


def with_unseen(metrics: dict[str, bool]) -> dict[str, bool]:
    """``metrics`` (over the seen speakers, the primary first) followed by their ``_unseen`` twins."""
    return {**metrics, **{m + UNSEEN: hib for m, hib in metrics.items()}}


@dataclass(frozen=True)
class AudioExample(Example):
    """An example with its waveform (float32, 8 kHz) and any judge targets."""

    wave: Any = field(default=None, hash=False, compare=False)
    info: dict = field(default_factory=dict, hash=False, compare=False)


def audio_part(wave: np.ndarray) -> MediaPart:
    return MediaPart("audio", np.asarray(wave, dtype=np.float32), {"sample_rate": SAMPLE_RATE})


def error_scores(reference: str, hypothesis: str) -> dict[str, Score]:
    ref, hyp = normalize_text(reference), normalize_text(hypothesis)
    return {
        "wer": word_errors(ref, hyp),
        "cer": char_errors(ref, hyp),
        "exact_match": float(ref == hyp),
    }


def dtmf_examples(name: str, n: int) -> list[AudioExample]:
    out = []
    for i in range(n):
        rng = random.Random(f"{name}/{i}")
        keys = "".join(rng.choice(DTMF_KEYS) for _ in range(rng.randint(1, 5)))
        u = dtmf_utterance(keys, rng)
        out.append(AudioExample(id=f"{name}-{i}", prompt=keys, target=u.text, wave=u.wave))
    return out


class DtmfSequences:
    """Mixin: held-out keypad-tone sequences generated with a seed (no data needed)."""

    splits = ("generated",)
    how_to_get = GENERATED_TONES
    Options = CountOptions

    def all_examples(self, data_dir: str | Path | None) -> list[Example]:
        return dtmf_examples(self.name, self.options.n_examples)


class FsddTest:
    """Mixin: the FSDD test split (takes 0-4) under the data root."""

    splits = ("test",)
    data_files = fsdd_test_files()
    how_to_get = FSDD_HOW_TO_GET


class SeenUnseen:
    """Mixin: examples in two groups, the seen speakers' test split and the held-out (unseen) speaker.

    ``all_examples`` returns every example with ``info["group"]`` ``seen`` or ``unseen``. Scores: the base
    task's metrics for a seen example, the same metrics suffixed ``_unseen`` for an unseen one; the other
    group's metrics are None, which :meth:`aggregate` skips and :meth:`evaluate` leaves out of the sample
    records (and out of each metric's ``n``). See the module docstring.
    """

    splits = ("test", "unseen")
    data_files = fsdd_test_files() + unseen_eval_files()
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
