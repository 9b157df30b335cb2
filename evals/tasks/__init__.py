"""Every task module, imported so that its tasks register in :data:`evals.task.TASKS`.

One module per task family: ``shakespeare`` (held-out bits per byte), ``arc`` and ``openbookqa``
(multiple choice, sharing ``multiple_choice``), ``math_word`` (GSM8K, SVAMP), ``babi`` (bAbI task 1),
``bbh`` (one task per BIG-Bench Hard subtask) and ``procedural`` (generated arithmetic, copy/reverse,
sorting); images and clips: ``media`` (what they share), ``vision_understanding`` (multiple choice over an
image or clip), ``digit_transfer`` (``digit_vqa`` on digit sources never trained on),
``vision_generation`` (judged by analytic and learned judges) and ``vision_quality`` (tokenizer
reconstruction, refiner gain); audio: ``audio_items`` (what they share: items, seen/unseen groups),
``audio_understanding`` (ASR, spoken digits, speakers), ``audio_generation`` (TTS judged by a reference
recogniser or the Goertzel decoder) and ``audio_quality`` (codec reconstruction). ``hub`` is not a task
family: it is the ``dataset`` option with which ``arc`` and ``math_word`` (GSM8K) read a local mirror or
a cached hub dataset instead of the data root.
"""

from evals.tasks import (
    arc,
    audio_generation,
    audio_items,
    audio_quality,
    audio_understanding,
    babi,
    bbh,
    digit_transfer,
    math_word,
    media,
    openbookqa,
    procedural,
    shakespeare,
    vision_generation,
    vision_quality,
    vision_understanding,
)

__all__ = [
    "arc",
    "audio_generation",
    "audio_items",
    "audio_quality",
    "audio_understanding",
    "babi",
    "bbh",
    "digit_transfer",
    "math_word",
    "openbookqa",
    "procedural",
    "shakespeare",
    "media",
    "vision_generation",
    "vision_quality",
    "vision_understanding",
]
