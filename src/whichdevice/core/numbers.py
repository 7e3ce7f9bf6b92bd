"""Numbers read from the environment (ranks, stages, ports, device indices) and printed by vendor tools,
each kind parsed one way.

``int()`` accepts more than any launcher writes ("²" passes ``str.isdigit()`` and fails ``int()``;
"٣", "1_0" and "+3" pass ``int()``) and raises past 4,300 digits. A variable's number is ASCII digits
only, and few of them: :func:`parse_number` returns the number, or the reason it is not one (the
value escaped and cut, ready for a trace line or an error), and never raises.
"""

from __future__ import annotations

__all__ = ["MAX_DIGITS", "TOOL_MAXIMUM", "NumberText", "parse_number", "parse_tool_number"]


def _quoted(value: str, limit: int = 80) -> str:
    """``repr(value)``, which escapes control characters, cut to about ``limit`` characters. (Not
    core.errors' ``shown``: importing it here would lengthen every import chain through this module.)"""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(value)} characters)"


# No rank, stage, port or device index has more digits than this (a port is 5, a rank of the largest
# runs 6); it also keeps int() far from its 4,300-digit limit.
MAX_DIGITS = 7


class NumberText:
    """What :func:`parse_number` found: ``value`` (None when the text is not a number) and ``problem``."""

    __slots__ = ("problem", "value")

    def __init__(self, value: int | None, problem: str | None) -> None:
        self.value, self.problem = value, problem


def parse_number(name: str, text: str, *, minimum: int = 0, maximum: int | None = None) -> NumberText:
    """``text`` (the value of variable ``name``, surrounding blanks allowed) as a whole number from
    ``minimum`` to ``maximum``; otherwise no value and the problem, naming ``name`` and the value."""
    digits = text.strip()
    said = f"{name}={_quoted(text)}"
    if not digits or not digits.isascii() or not digits.isdigit():
        return NumberText(None, f"{said} is not a whole number written in the digits 0-9")
    if len(digits.lstrip("0")) > MAX_DIGITS:
        return NumberText(None, f"{said} has {len(digits)} digits, more than any such number has ({MAX_DIGITS})")
    value = int(digits)
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" to {maximum}" if maximum is not None else " or more"
        return NumberText(None, f"{said} is out of range (a number from {minimum}{upper})")
    return NumberText(value, None)


# The largest figure a vendor tool prints that whichdevice reads: a device's memory in MiB (the largest
# GPUs hold under 300 GiB, so 2**24 MiB, 16 TiB, is absurd), a compute capability part, a process id.
TOOL_MAXIMUM = float(1 << 24)


def parse_tool_number(what: str, text: str, *, maximum: float = TOOL_MAXIMUM) -> NumberText:
    """A number a vendor tool printed (nvidia-smi's "81559", "9.0"), as a whole number: refused where
    it is no plain decimal (``inf``, ``nan``, ``1e400``, "[N/A]"), negative, or over ``maximum``.

    ``float()`` takes "inf", "nan" and "1e400", and ``int(float("inf"))`` raises OverflowError: a
    tool's output is read only through here, so no such error can leave a probe."""
    said = f"{what} {_quoted(text)}"
    digits = text.strip()
    whole, _, fraction = digits.partition(".")
    if not whole or not (whole + fraction).isascii() or not (whole + fraction or "0").isdigit():
        return NumberText(None, f"{said} is not a plain non-negative number")
    if len(whole.lstrip("0")) > 12 or int(whole) > maximum:
        return NumberText(None, f"{said} is over {maximum:.0f}, more than any device has")
    return NumberText(int(whole), None)
