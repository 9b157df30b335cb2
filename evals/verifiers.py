"""RL verifiers: a harness task's *training* queries and the reward of a response, scored the task's way.

The RL stage (``train.rl``) never imports the harness; the job that starts it (``ernie5 rl``) builds one
:class:`TaskVerifier` per configured task and hands it over. A verifier answers three things:

* :meth:`TaskVerifier.query`: query ``i`` of a seeded, endless stream of *training* items in the task's
  own prompt format (the same context the harness gives the model, so what RL improves is what the
  harness measures). Items come from the task's training side and never from what the harness scores:
  procedural problems and shapes scenes are drawn from a generator namespace of their own and any item
  equal to one of the first :data:`HELD_OUT` items the task evaluates is skipped; MNIST digits come from
  the train split, GSM8K and SVAMP problems and bAbI stories from their train splits.
* :meth:`TaskVerifier.reward`: the task's own per-example metric on the response: generation tasks call
  :meth:`evals.task.Task.score` (``arith_d2``'s exact match, GSM8K's
  :func:`evals.answers.extract_final_number`),
  multiple-choice tasks parse the response with :func:`evals.answers.match_choice` and compare with the gold
  choice the harness uses. A lower-is-better per-example metric such as an error rate ``(errors, words)``
  becomes ``1 - min(1, errors / words)``.
* ``reference``: a correct response (GSM8K's worked solution, otherwise the answer itself).
* ``skeleton``: AHRL's thinking skeleton of the query (:mod:`evals.hints`: the first steps of a worked
  solution, never its answer; empty where the task has no reasoning to show).

Image generation (``t2i_shapes``): the query asks for an image (``Query.output == "image"``, with the
task's own guidance scale); the RL stage samples it through NFSP (``train.rl.rollout_image``) and hands the
decoded image to :meth:`TaskVerifier.reward`, which scores it with the task's own judge
(``ernie5.data.shapes.judge`` through :meth:`evals.task.Task.score`, judge version in the task). The
reward is graded: the mean of the task's four metrics (``all_correct``, ``shape_acc``, ``colour_acc``,
``position_acc``), so a scene that is nearly right scores above a wrong one; the harness's headline is
``all_correct``. Training scenes are random scenes whose prompt is none of the first :data:`HELD_OUT`
evaluated prompts; 1-shape scenes (162 distinct prompts, all of them among the evaluated
ones) therefore never occur in training. ``t2i_digits`` has no verifier: its prompts are the ten strings
``Draw the digit d.``, every one of them evaluated, so no training prompt could be held out.

Speech generation (``tts_dtmf``, ``tts_digits``): the query asks for an utterance (``Query.output ==
"audio"``, with the task's frame budget as ``max_new_tokens`` and, for ``tts_digits``, the speaker); the RL
stage samples it through Next-Codec Prediction (``train.rl.rollout_audio``) and hands the decoded waveform to
:meth:`TaskVerifier.reward`, which scores it with the task's own judge through
:meth:`evals.task.Task.score` (``tts_dtmf``: the exact Goertzel DTMF decoder; ``tts_digits``: the
project's reference recogniser, ``evals.audio_judges``). The reward is per utterance ``1 - min(1, WER)``
against the prompt's words (graded: one wrong key of four scores 0.75; a reward of 1 is an exact match).
Training prompts are drawn as the task draws its prompts (``tts_dtmf``: 1-5 keys; ``tts_digits``: 1-4
digit words, a random seen speaker) and are none of the first :data:`HELD_OUT` evaluated prompt texts
(whatever their speaker), so the short prompts (every 1- and 2-key or 1- and 2-digit one) never occur in
training.

Supported tasks: the procedural families (``arith*``, ``copy_reverse``/``copy_l*``/``reverse_l*``,
``sort*``), ``t2i_shapes`` (images, judged), ``shapes_vqa_attr``, ``shapes_vqa_rel``, ``video_shapes``,
``digit_vqa`` and ``video_digits`` (data root: MNIST train digits), ``tts_dtmf`` (speech, judged),
``tts_digits`` (speech, judged; data root: FSDD for the recogniser), ``asr_fsdd`` (data root: the seen
speakers' train recordings; the reward is ``1 - WER``), ``babi_qa1`` (data root, with the harness's
few-shot prefix), ``gsm8k`` and ``svamp`` (data root, zero-shot prompts: the
harness's few-shot prefix does not fit the small models' context).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ernie5.data import shapes
from ernie5.data.audio import fsdd_sequences
from ernie5.data.mnist import digit_image, mnist_split
from ernie5.data.moving import DIRECTIONS, moving_digits_clip, moving_shape_clip
from ernie5.data.procedural import STOP, generate
from ernie5.data.text import read_babi_qa1, read_gsm8k, read_svamp, strip_calculator_annotations
from ernie5.data.vision_sources import (
    CLIP_FRAMES,
    DIGIT_MOTION_QUESTION,
    DIGIT_QUESTION,
    MOTION_QUESTION,
    SHAPE_MOTION_QUESTION,
    shapes_prompt,
)
from evals import hints
from evals.answers import match_choice
from evals.api import GenerationRequest, GenerationResult, MediaPart, MediaResult, SpeechGenerationRequest
from evals.hints import NONE, Skeleton
from evals.task import TASKS, Example, Task
from evals.tasks.audio_generation import TtsDigits, TtsDtmf
from evals.tasks.audio_items import AudioExample
from evals.tasks.audio_understanding import AsrFsdd
from evals.tasks.babi import BabiQA1
from evals.tasks.babi import _prompt as babi_prompt
from evals.tasks.math_word import STOP as MATH_STOP
from evals.tasks.math_word import MathWordTask
from evals.tasks.media import IMAGE_SIZE, MediaExample, choice_example
from evals.tasks.procedural import ProceduralTask
from evals.tasks.vision_generation import TextToImageShapes
from evals.tasks.vision_understanding import DigitVQA, ShapesVQA, VideoDigits, VideoShapes

MC_MAX_NEW_TOKENS = 8
"""Generation budget of a multiple-choice answer (every choice is a word or two)."""
_MAX_REDRAWS = 64
FSDD_POOL, FSDD_SEED = 4000, 20251205
"""Spoken digit strings built from the seen speakers' FSDD train recordings for ``asr_fsdd``'s queries."""
HELD_OUT = 5000
"""Items of a generated task's evaluated stream that training queries never equal (``n_examples`` up to
this many are safe to evaluate after RL)."""


@dataclass(frozen=True)
class Query:
    """One RL query: what the model is asked, and what its reward is computed against."""

    task: str
    id: str
    context: Any
    """A harness context: a string, or a tuple of strings and :class:`evals.api.MediaPart`."""
    modality: str
    max_new_tokens: int
    stop: tuple[str, ...]
    reference: str
    """A correct response (the reward of it is 1)."""
    example: Example = field(repr=False, compare=False)
    output: str = "text"
    """What the response is: ``"text"``, ``"image"`` (one image generated through NFSP; the reward is
    computed on the decoded uint8 ``(1, H, W, 3)`` image) or ``"audio"`` (one utterance generated through
    NCP, at most ``max_new_tokens`` frames; the reward is computed on the decoded float32 waveform)."""
    cfg_scale: float = 1.0
    """Classifier-free guidance scale of an image response (the harness's for the task)."""
    speaker: str = ""
    """The speaker of an audio response (a seen FSDD speaker's name; "" = the generic start)."""
    skeleton: Skeleton = NONE
    """AHRL's thinking skeleton (:mod:`evals.hints`): steps of a solution, never its answer."""


class VerifierError(ValueError):
    """A task without an RL verifier, or one whose data is missing (one-line message)."""


def _media_key(prompt: str, media) -> str:
    return hashlib.sha256(prompt.encode() + memoryview(media).tobytes()).hexdigest()


class TaskVerifier:
    """Training queries and rewards of one registered harness task (see the module docstring)."""

    def __init__(self, name: str, data_dir: str | Path | None = None) -> None:
        if name not in TASKS:
            raise VerifierError(f"rl task {name!r} is not a registered task")
        if name == "t2i_digits":
            raise VerifierError(
                "rl task 't2i_digits' has no verifier: its ten prompts ('Draw the digit d.') are all "
                "evaluated, so no training prompt can be held out (t2i_shapes has one)"
            )
        self.task: Task = TASKS.get(name)()
        held = self.task
        if "n_examples" in held.kwargs and "n_examples" not in held.fixed:
            # generated tasks: hold out the first HELD_OUT items of the evaluated stream, so a suite
            # that raises n_examples (up to that) never scores an item RL trained on
            held = TASKS.get(name)(n_examples=max(HELD_OUT, held.kwargs["n_examples"]))
        self.name = name
        self.data_dir = data_dir
        ok, why = self.task.available(data_dir)
        if not ok:
            raise VerifierError(f"rl task {name}: {why}")
        if not isinstance(
            self.task,
            (
                ProceduralTask,
                ShapesVQA,
                DigitVQA,
                VideoShapes,
                VideoDigits,
                MathWordTask,
                BabiQA1,
                AsrFsdd,
                TextToImageShapes,
                TtsDtmf,
                TtsDigits,
            ),
        ):
            raise VerifierError(
                f"rl task {name!r} has no verifier "
                "(procedural, shapes_vqa_*, digit_vqa, video_shapes, video_digits, asr_fsdd, babi_qa1, "
                "gsm8k, svamp, t2i_shapes, tts_dtmf and tts_digits have)"
            )
        if isinstance(self.task, TtsDigits):
            self.task._load_judge(data_dir)  # the reference recogniser its score transcribes with
        self.modality = self.task.modality
        evaluated = held.all_examples(data_dir)
        self._held_out = {self._key(ex) for ex in evaluated}
        self._fewshot = evaluated[0].fewshot if evaluated else ""
        """The harness's few-shot prefix (babi_qa1's solved train stories): RL asks in the same context."""
        self._pool: list | None = None
        self._pool_index: dict[str, int] = {}
        """Query id -> pool position, for the math tasks' worked solutions."""

    @staticmethod
    def _key(ex: Example) -> str:
        media = getattr(ex, "media", None)
        if media is None:
            media = getattr(ex, "wave", None)
        return ex.prompt if media is None else _media_key(ex.prompt, media)

    # ------------------------------------------------------------------ queries
    def query(self, index: int, seed: int) -> Query:
        """Training query ``index`` of the stream seeded by ``seed`` (deterministic)."""
        for attempt in range(_MAX_REDRAWS):
            ex = self._draw(random.Random(f"rl/{self.name}/{seed}/{index}/{attempt}"), index)
            if self._key(ex) not in self._held_out:
                return self._as_query(ex)
        raise VerifierError(f"rl task {self.name}: {_MAX_REDRAWS} draws all hit evaluated items")

    def _draw(self, rng: random.Random, index: int) -> Example:
        task = self.task
        if isinstance(task, ProceduralTask):
            problem = generate(rng.choice(task.kinds()), task.options.difficulty, rng)
            return Example(id=f"rl-{index}", prompt=problem.prompt, target=problem.answer.strip())
        if isinstance(task, TextToImageShapes):
            scene = shapes.random_scene(rng)
            caption = shapes.caption(scene)
            return MediaExample(
                id=f"rl-{index}", prompt=shapes_prompt(caption), target=caption, info={"scene": scene}
            )
        if isinstance(task, (TtsDtmf, TtsDigits)):  # drawn as the task draws its evaluated prompts
            return task.draw(rng, f"rl-{index}")
        if isinstance(task, ShapesVQA):
            while True:
                scene = shapes.random_scene(rng)
                ask = shapes.relational_questions if task.relational else shapes.attribute_questions
                qas = ask(scene, rng)
                if qas:
                    break
            qa = qas[0]
            media = shapes.render(scene, IMAGE_SIZE)
            ex = choice_example(f"rl-{index}", media, qa.question, qa.choices, qa.answer)
            return replace(ex, info={"scene": scene})
        if isinstance(task, VideoShapes):
            shape = shapes.random_scene(rng, n_shapes=1).shapes[0]
            direction = rng.choice(DIRECTIONS)
            clip, _ = moving_shape_clip(
                shape,
                direction,
                np.random.default_rng(rng.randrange(2**32)),
                n_frames=CLIP_FRAMES,
                size=IMAGE_SIZE,
            )
            if rng.random() < 0.5:
                return choice_example(f"rl-{index}", clip, MOTION_QUESTION, DIRECTIONS, direction)
            return choice_example(f"rl-{index}", clip, SHAPE_MOTION_QUESTION, shapes.KINDS, shape.kind)
        pool = self._train_pool()
        item = pool[rng.randrange(len(pool))]
        if isinstance(task, AsrFsdd):
            return AudioExample(
                id=f"rl-{index}",
                prompt="",
                target=item.text,
                wave=item.wave,
                info={"speaker": item.speaker, "group": "seen"},
            )
        if isinstance(task, VideoDigits):
            image, label = item
            direction = rng.choice(DIRECTIONS)
            clip, _ = moving_digits_clip(
                [image],
                [direction],
                np.random.default_rng(rng.randrange(2**32)),
                n_frames=CLIP_FRAMES,
                size=IMAGE_SIZE,
            )
            if rng.random() < 0.5:
                return choice_example(f"rl-{index}", clip, MOTION_QUESTION, DIRECTIONS, direction)
            digits = tuple(str(d) for d in range(10))
            return choice_example(f"rl-{index}", clip, DIGIT_MOTION_QUESTION, digits, str(int(label)))
        if isinstance(task, DigitVQA):
            image, label = item
            digits = tuple(str(d) for d in range(10))
            return choice_example(
                f"rl-{index}", digit_image(image, IMAGE_SIZE), DIGIT_QUESTION, digits, str(int(label))
            )
        if isinstance(task, BabiQA1):
            return Example(
                id=f"rl-{item.id}", prompt=babi_prompt(item), target=item.answer, fewshot=self._fewshot
            )
        return Example(
            id=f"rl-{item.id}", prompt=f"Question: {item.question.strip()}\nAnswer:", target=item.answer
        )

    def _train_pool(self) -> list:
        if self._pool is None:
            if isinstance(self.task, (DigitVQA, VideoDigits)):
                images, labels = mnist_split(self.data_dir, "train")
                self._pool = list(zip(images, labels, strict=True))
            elif isinstance(self.task, AsrFsdd):
                # 2-4 digits of one seen speaker's train recordings joined, as the task joins its test ones
                self._pool = fsdd_sequences(self.data_dir, "train", FSDD_POOL, 2, 4, seed=FSDD_SEED)
            elif isinstance(self.task, BabiQA1):
                self._pool = read_babi_qa1(self.data_dir, "train")
            elif self.name == "gsm8k":
                self._pool = read_gsm8k(self.data_dir, "train")
            else:
                self._pool = read_svamp(self.data_dir, "train")
            if isinstance(self.task, (BabiQA1, MathWordTask)):
                self._pool_index = {f"rl-{it.id}": i for i, it in enumerate(self._pool)}
        return self._pool

    def _skeleton(self, ex: Example) -> Skeleton:
        """The query's thinking skeleton (:mod:`evals.hints`; none for tasks without one)."""
        task = self.task
        if isinstance(task, ProceduralTask):
            return hints.procedural(ex.prompt)
        if isinstance(task, ShapesVQA) and not task.relational:
            return hints.shapes_attribute(ex.info["scene"], ex.prompt, ex.target)
        if isinstance(task, (BabiQA1, MathWordTask)):
            item = self._train_pool()[self._pool_index[ex.id]]
            if isinstance(task, BabiQA1):
                return hints.babi_qa1(item.story, item.question)
            if self.name == "gsm8k":
                return hints.gsm8k(strip_calculator_annotations(item.solution))
            return hints.svamp(item.equation)
        return NONE

    def _as_query(self, ex: Example) -> Query:
        return replace(self._bare_query(ex), skeleton=hints.safe(self._skeleton(ex), ex.target))

    def _bare_query(self, ex: Example) -> Query:
        task = self.task
        if isinstance(task, TextToImageShapes):
            # the harness's guidance scale for this task (its MediaGenerationRequest's)
            scale = task.options.cfg_scale
            return Query(self.name, ex.id, ex.prompt, self.modality, 0, (), "", ex, "image", scale)
        if isinstance(task, (TtsDtmf, TtsDigits)):
            # the harness's request for the prompt: its frame budget and speaker (its temperature is
            # 0, argmax; RL samples at rollout.audio_temperature, train.rl.rollout_audio)
            (req,) = task.requests(ex)
            assert isinstance(req, SpeechGenerationRequest)
            return Query(
                self.name,
                ex.id,
                req.prompt,
                self.modality,
                req.max_frames,
                (),
                "",
                ex,
                "audio",
                speaker=req.speaker,
            )
        if ex.choices:
            part = MediaPart("video" if ex.media.ndim == 4 else "image", ex.media)
            return Query(
                self.name,
                ex.id,
                (part, ex.prompt),
                self.modality,
                MC_MAX_NEW_TOKENS,
                (STOP,),
                " " + ex.target,
                ex,
            )
        if isinstance(task, MathWordTask):
            hint = " " + ex.target
            if self.name == "gsm8k":
                item = self._train_pool()[self._pool_index[ex.id]]
                hint = f" {strip_calculator_annotations(item.solution)}\n#### {item.answer}"
            return Query(
                self.name, ex.id, ex.prompt, self.modality, task.options.max_new_tokens, MATH_STOP, hint, ex
            )
        (req,) = task.requests(ex)
        assert isinstance(req, GenerationRequest)
        return Query(
            self.name, ex.id, req.context, self.modality, req.max_new_tokens, req.stop, " " + ex.target, ex
        )

    # ------------------------------------------------------------------ reward
    def reward(self, query: Query, text) -> float:
        """The task's per-example metric of ``text`` (cut at the query's stop strings), as a reward; for an
        image query, ``text`` is the decoded image (uint8 ``(1, H, W, 3)``) and the reward the mean of the
        task's judged metrics; for an audio query, the decoded waveform (float32) and the reward
        ``1 - min(1, WER)`` of what the task's judge hears (see the module docstring)."""
        ex = query.example
        if query.output == "image":
            scores = self.task.score(ex, [MediaResult(np.asarray(text))])
            return sum(float(v) for v in scores.values()) / len(scores)
        if ex.choices:
            return float(match_choice(text, ex.choices) == ex.gold)
        if query.output == "audio":
            scores = self.task.score(ex, [MediaResult(np.asarray(text, dtype=np.float32))])
            self.task.__dict__.get("_heard", {}).pop(ex.id, None)  # kept by score for describe_sample
        else:
            scores = self.task.score(ex, [GenerationResult(text, 0)])
        primary = next(iter(self.task.metrics))
        value = scores[primary]
        if isinstance(value, tuple):
            errors, total = value[0], value[1]
            return 1.0 - min(1.0, errors / max(total, 1e-9))
        return float(value) if self.task.metrics[primary] else 1.0 - min(1.0, float(value))
