"""``generate_text``: impossible requests are one-line ``GenerationError``s before any checkpoint is read
(the CLI turns them into exit 2; ``tests/jobs/test_cli.py``)."""

from __future__ import annotations

import math

import pytest

from ernie5.generation.text import GenerationError, generate_text


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_new_tokens": -5}, "max_new_tokens=-5: expected an integer >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens=0: expected an integer >= 1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens=2.5: expected an integer >= 1"),
        ({"max_new_tokens": True}, "max_new_tokens=True: expected an integer >= 1"),
        ({"temperature": -1.0}, "temperature=-1.0: expected a number >= 0"),
        ({"temperature": math.nan}, "temperature=nan: expected a number >= 0"),
    ],
)
def test_impossible_requests_are_refused_before_loading(kwargs, fragment, tmp_path):
    # The checkpoint does not exist: the request is checked first, so the error is about the request.
    with pytest.raises(GenerationError, match=fragment) as e:
        generate_text(tmp_path / "no-such-checkpoint", "hi", **kwargs)
    assert len(str(e.value).splitlines()) == 1
