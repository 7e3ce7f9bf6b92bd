"""The two helpers every message uses for outside text: ``printable`` (escape) and ``shown`` (quote, short)."""

from __future__ import annotations

import pytest

import whichdevice as wd
from steering import STEERING
from whichdevice.core.errors import MESSAGE_LIMIT, SHOWN_LIMIT, DeviceError, printable, shown
from whichdevice.testing import simulate


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in STEERING:
        monkeypatch.delenv(name, raising=False)


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


def test_a_message_is_cut_in_the_middle_past_the_limit_keeping_the_fix() -> None:
    error = DeviceError("X=" + "y" * 1_000_000 + "; unset X to fix it")
    assert len(str(error)) < MESSAGE_LIMIT + 100
    assert str(error).startswith("X=yyy") and str(error).endswith("; unset X to fix it")
    assert "characters left out" in str(error)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("WHICHDEVICE_DEVICE", "x" * 1_000_000),
        ("WHICHDEVICE_DEVICE", "cuda:" + "9" * 1_000_000),
        ("WHICHDEVICE_DEVICE", "\x1b" * 1_000_000),
        ("LOCAL_RANK", "x" * 1_000_000),
        ("WHICHDEVICE_PROBE_TIMEOUT", "x" * 1_000_000),
    ],
    ids=["device-word", "device-index", "device-escapes", "local-rank", "probe-timeout"],
)
def test_a_megabyte_variable_gives_a_short_message(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    with simulate("cuda:2"), pytest.raises(DeviceError) as info:
        wd.resolve_device(task="training")
    message = str(info.value)
    assert len(message) < 1000 and variable in message and "characters)" in message
