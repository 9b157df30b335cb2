"""Specialist baselines: the tasks' own scoring of a one-job model on the tasks' own items."""

from __future__ import annotations

import numpy as np
import pytest

import evals.tasks  # noqa: F401  (registers every task)
from evals import specialists
from evals.specialists import DigitSpecialist, SpeechSpecialist, specialist_rows, specialists_for
from evals.task import TASKS
from jobs.cli import main


class _ThreeJudge:
    """Says 3 (probability 0.9) about every image."""

    version = "fake"

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        p = np.full((len(images), 10), 0.1 / 9, np.float32)
        p[:, 3] = 0.9
        return p


class _Recognizer:
    name = "fake-asr"

    def transcribe(self, waves: list[np.ndarray]) -> list[str]:
        return ["seven" if w.mean() > 0 else "one" for w in waves]


def test_digit_specialist_is_scored_by_the_task(tmp_path) -> None:
    task = TASKS.get("digit_vqa_strokes")()
    result = task.evaluate(DigitSpecialist(_ThreeJudge()), data_dir=None, limit=50, seed=0, work_dir=tmp_path)
    threes = sum(e.target == "3" for e in task.examples(None, limit=50, seed=0))
    assert result.metrics["acc"]["n"] == 50
    assert result.metrics["acc"]["value"] == pytest.approx(threes / 50)


def test_digit_specialist_rejects_what_it_cannot_answer() -> None:
    from evals.api import LoglikelihoodRequest, MediaPart

    image = MediaPart("image", np.zeros((32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="answers digits 0-9, got choice ' red'"):
        DigitSpecialist(_ThreeJudge()).loglikelihood([LoglikelihoodRequest((image, "Q"), " red")])
    with pytest.raises(ValueError, match="needs one image part"):
        DigitSpecialist(_ThreeJudge()).loglikelihood([LoglikelihoodRequest("text only", " 3")])


def test_speech_specialist_transcribes_and_chooses_what_it_heard() -> None:
    from evals.api import GenerationRequest, LoglikelihoodRequest, MediaPart

    up, down = MediaPart("audio", np.ones(800, np.float32)), MediaPart("audio", -np.ones(800, np.float32))
    s = SpeechSpecialist(_Recognizer())
    assert [
        r.text for r in s.generate([GenerationRequest((up, "Transcript:")), GenerationRequest((down, "T"))])
    ] == [
        "seven",
        "one",
    ]
    lls = s.loglikelihood(
        [LoglikelihoodRequest((up, "Q"), " seven"), LoglikelihoodRequest((up, "Q"), " one")]
    )
    assert lls.results[0].logprob > lls.results[1].logprob


def test_rows_and_skips(tmp_path, monkeypatch) -> None:
    assert specialists_for("digit_vqa_usps") == ["digits"]
    assert specialists_for("asr_fsdd") == ["speech", "speech_voices"]
    assert specialists_for("arith_d1") == []
    monkeypatch.setitem(
        specialists.SPECIALISTS, "digits", (specialists.DIGIT_TASKS, lambda d: DigitSpecialist(_ThreeJudge()))
    )
    rows, skipped = specialist_rows(
        [("digit_vqa_strokes", {}, 20, 0), ("digit_vqa_usps", {}, 20, 0), ("arith_d1", {}, 5, 0)], tmp_path
    )
    assert [(r["subnet"], r["task"], r["metric"], r["n"]) for r in rows] == [
        ("specialist", "digit_vqa_strokes", "acc", 20)
    ]
    assert rows[0]["specialist"] == "specialist:fake"
    assert skipped[0]["task"] == "digit_vqa_usps" and "usps/zip.test.gz" in skipped[0]["reason"]
    assert skipped[1] == {"task": "arith_d1", "reason": "no specialist for this task"}


def test_cli_specialists(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(
        specialists.SPECIALISTS, "digits", (specialists.DIGIT_TASKS, lambda d: DigitSpecialist(_ThreeJudge()))
    )
    suite = tmp_path / "s.yaml"
    suite.write_text(
        "name: s\ndescription: d\ntasks:\n"
        "  - {task: digit_vqa_strokes, limit: 10}\n"
        "  - {task: arith_d1, limit: 5}\n"
    )
    assert main(["specialists", "--suite", str(suite), "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "digit_vqa_strokes" in out and "n=10" in out and "arith_d1" not in out
    )  # only tasks with a specialist
    assert main(["specialists", "--suite", str(tmp_path / "none.yaml")]) == 2


def test_the_content_recognizer_transcribes_through_its_encoder() -> None:
    import torch

    from ernie5.tokenizers.speech_content import SpeechContentConfig, SpeechContentEncoder

    torch.manual_seed(0)
    enc = SpeechContentEncoder(SpeechContentConfig(width=8, dilations=(1,))).eval()
    rec = specialists.ContentRecognizer(enc, "enc")
    waves = [
        np.random.default_rng(i).standard_normal(n).astype(np.float32) * 0.1
        for i, n in enumerate((900, 4000))
    ]
    one_by_one = [rec.transcribe([w])[0] for w in waves]
    assert rec.transcribe(waves) == one_by_one  # padding beside an utterance changes nothing
    lengths = torch.tensor([len(w) for w in waves])
    padded = torch.zeros(2, 4000)
    for j, w in enumerate(waves):
        padded[j, : len(w)] = torch.from_numpy(w)
    assert one_by_one == enc.transcribe(padded, lengths)


@pytest.mark.slow
def test_the_digit_judge_reads_the_cross_source_digits(data_root, tmp_path) -> None:
    """The pen digits are legible: the MNIST-trained judge reads nearly all of them."""
    rows, _ = specialist_rows([("digit_vqa_strokes", {}, 200, 0)], data_root)
    assert rows[0]["value"] >= 0.9
