"""Every task module, imported so that its tasks register in :data:`evals.task.TASKS`.

One module per task family: ``shakespeare`` (held-out bits per byte), ``arc`` and ``openbookqa``
(multiple choice, sharing ``multiple_choice``), ``math_word`` (GSM8K, SVAMP), ``babi`` (bAbI task 1),
``bbh`` (one task per BIG-Bench Hard subtask) and ``procedural`` (generated arithmetic, copy/reverse,
sorting), ``vision`` (image and video understanding, generation judged by analytic and learned judges,
tokenizer reconstruction, refiner gain), ``digit_transfer`` (``digit_vqa`` on digit sources never
trained on), ``audio`` (ASR, spoken-digit and speaker understanding, TTS
judged by a reference recogniser or the Goertzel decoder, codec reconstruction). ``hub`` is not a task
family: it is the ``dataset`` option with which ``arc`` and ``math_word`` (GSM8K) read a local mirror or
a cached hub dataset instead of the data root.
"""

from evals.tasks import (
    arc,
    audio,
    babi,
    bbh,
    digit_transfer,
    math_word,
    openbookqa,
    procedural,
    shakespeare,
    vision,
)

__all__ = [
    "arc",
    "audio",
    "babi",
    "bbh",
    "digit_transfer",
    "math_word",
    "openbookqa",
    "procedural",
    "shakespeare",
    "vision",
]
