"""The two helpers every message uses for outside text: ``printable`` (escape) and ``shown`` (quote, short)."""

from __future__ import annotations

import pytest

from whichdevice.core.errors import SHOWN_LIMIT, printable, shown


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("H100 80GB", "H100 80GB"),
        ("\x1b[2J\x1b]0;title\x07", "\\x1b[2J\\x1b]0;title\\x07"),
        ("a\nok: forged\r", "a\\nok: forged\\r"),
        ("left\u202eright\u2066", "left\\u202eright\\u2066"),
        ("\x9b31m\x00", "\\x9b31m\\x00"),
        ("Grüße ✓ 日本", "Grüße ✓ 日本"),
    ],
    ids=["plain", "escape-codes", "newline", "bidi", "c1-and-nul", "unicode-kept"],
)
def test_printable_escapes_every_control_character(text: str, expected: str) -> None:
    assert printable(text) == expected
    assert printable(text).isprintable()


def test_shown_quotes_a_short_value_as_repr() -> None:
    assert shown("cuda:9") == "'cuda:9'"
    assert shown(None) == "None"


def test_shown_cuts_a_huge_value_and_says_how_long_it_was() -> None:
    text = shown("x" * 1_000_000)
    assert len(text) < SHOWN_LIMIT + 40
    assert text.endswith("... (1000000 characters)")
