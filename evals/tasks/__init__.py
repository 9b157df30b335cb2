"""Every task module, imported so that its tasks register in :data:`evals.task.TASKS`.

One module per task family: ``shakespeare`` (held-out bits per byte), ``arc`` and ``openbookqa``
(multiple choice, sharing ``multiple_choice``), ``math_word`` (GSM8K, SVAMP), ``babi`` (bAbI task 1),
``bbh`` (one task per BIG-Bench Hard subtask) and ``procedural`` (generated arithmetic, copy/reverse,
sorting), ``vision`` (image and video understanding, generation judged by analytic and learned judges,
tokenizer reconstruction, refiner gain).
"""

from evals.tasks import arc, babi, bbh, math_word, openbookqa, procedural, shakespeare, vision

__all__ = ["arc", "babi", "bbh", "math_word", "openbookqa", "procedural", "shakespeare", "vision"]
