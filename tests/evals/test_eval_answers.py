"""Table-driven tests of the shared final-number parser."""

from __future__ import annotations

import pytest

from evals.answers import extract_final_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 72", "72"),
        ("She makes 9 * 2 = 18 dollars.\n#### 18", "18"),
        ("#### 1,000\nQuestion: 3 apples", "1000"),
        ("The answer is 1,234.", "1234"),
        ("It costs $5.50", "5.5"),
        ("It costs -$5", "-5"),
        ("72.0", "72"),
        ("100", "100"),
        ("0.0", "0"),
        ("-0", "0"),
        ("between -3 and -5.", "-5"),
        ("10-3=7", "7"),
        ("x .5", "0.5"),
        ("1,2345", "2345"),
        ("3,4", "4"),
        ("50%", "50"),
        ("first 12 then 7 apples", "7"),
        ("abc123 and 4", "4"),
        ("no number here", None),
        ("####", None),
        ("", None),
    ],
)
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected
