"""Answer parsing shared by eval scoring and RL rewards, so the two cannot drift apart.

:func:`extract_final_number` is the one final-number parser: GSM8K and SVAMP scoring use it on both the
model output and the reference, and the RL math reward must call it too.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from evals.metrics import normalize_answer

# A number not glued to a preceding word character or dot: optional sign and dollar sign, digits with
# correct thousands separators or plain digits, optional decimals; or a bare ".5".
_NUMBER = re.compile(r"(?<![\w.])[-\u2212]?\$?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
_FINAL_MARK = "####"


def _canonical(raw: str) -> str | None:
    text = raw.replace("\u2212", "-").replace("$", "").replace(",", "")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def extract_final_number(text: str) -> str | None:
    """The final numeric answer in ``text`` in canonical form, or None if there is no number.

    The number right after the last ``####`` (GSM8K's answer marker) wins if there is one; otherwise the
    last number in the text. Canonical form drops ``$`` and thousands commas, trailing decimal zeros and
    a trailing period: ``"#### 72"`` -> ``"72"``, ``"The answer is 1,234."`` -> ``"1234"``,
    ``"$5.50"`` -> ``"5.5"``, ``"72.0"`` -> ``"72"``, ``"-3"`` -> ``"-3"``.
    """
    _, mark, tail = text.rpartition(_FINAL_MARK)
    if mark:
        after = _NUMBER.search(tail)
        if after is not None:
            return _canonical(after.group())
    numbers = _NUMBER.findall(text)
    return _canonical(numbers[-1]) if numbers else None


def match_choice(text: str, choices: tuple[str, ...] | list[str]) -> int:
    """Index of the choice a generated answer names, or -1: the first choice equal to the text after
    :func:`evals.metrics.normalize_answer` (the text is cut at its first newline first). Used by the RL
    reward of the multiple-choice tasks, whose harness metric picks the most likely of the same choices."""
    said = normalize_answer(text.split("\n", 1)[0])
    for i, c in enumerate(choices):
        if normalize_answer(c) == said:
            return i
    return -1
