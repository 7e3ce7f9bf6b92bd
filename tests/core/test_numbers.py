"""Numbers read from the environment (whichdevice.core.numbers): ASCII digits only, few of them, never an
exception, the value said escaped and cut."""

from __future__ import annotations

import pytest

from whichdevice.core.numbers import parse_number, parse_tool_number


@pytest.mark.parametrize(("text", "value"), [("0", 0), (" 3 ", 3), ("007", 7), ("65535", 65535)])
def test_ascii_digits_are_a_number(text, value):
    assert parse_number("X", text).value == value


@pytest.mark.parametrize("text", ["²", "١", "1_0", "+3", "-1", "", " ", "3.0", "0x10", "1e3", "\x1b[2J"])
def test_anything_else_is_no_number_and_the_value_is_said_escaped(text):
    found = parse_number("LOCAL_RANK", text)
    assert found.value is None and found.problem is not None
    assert found.problem.startswith("LOCAL_RANK=") and "\x1b" not in found.problem


def test_a_number_of_thousands_of_digits_is_refused_without_int():
    found = parse_number("RANK", "9" * 5000)
    assert found.value is None and "5000 digits" in found.problem and len(found.problem) < 300


def test_a_number_out_of_its_range_is_refused():
    assert parse_number("MASTER_PORT", "0", minimum=1, maximum=65535).value is None
    assert parse_number("MASTER_PORT", "65536", minimum=1, maximum=65535).problem.endswith("(a number from 1 to 65535)")


@pytest.mark.parametrize("text", ["inf", "nan", "-1", "1e400", "[N/A]", "", "0x10", "１２"])
def test_a_tool_number_refuses_inf_nan_negatives_and_forms_no_tool_prints(text):
    found = parse_tool_number("memory.total", text)
    assert found.value is None and found.problem is not None and found.problem.startswith("memory.total ")


def test_a_tool_number_refuses_absurd_sizes_and_reads_plain_decimals():
    assert parse_tool_number("memory.total", "81559").value == 81559
    assert parse_tool_number("memory.total", " 81559.75 ").value == 81559
    assert parse_tool_number("memory.total", str(1 << 25)).value is None
    assert parse_tool_number("compute_cap", "100", maximum=99).value is None
