"""Sizes: bytes parsed from accelerate's forms ("80GiB", "16GB", 1234) and printed back."""

from __future__ import annotations

import math
import re
from typing import Any

from whichdevice.core.errors import DeviceError

__all__ = ["MAX_SIZE", "GiB", "format_bytes", "parse_size"]


GiB = 1024**3


# No machine has an exbibyte of memory: a larger size is a typo (1e30, a value in bits, ...).
MAX_SIZE = 2**60


def parse_size(value: Any, what: str = "size") -> int:
    """Bytes from 1234, "80GiB", "16GB", "512MiB" (accelerate's max_memory forms), below 1 EiB."""
    if isinstance(value, bool) or value is None:
        raise DeviceError(f"{what}={value!r} is not a size; write e.g. '20GiB' or a number of bytes")
    if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
        if value < 0:
            raise DeviceError(f"{what}={value!r} is negative; write a size such as '20GiB'")
        if value >= MAX_SIZE:
            raise DeviceError(f"{what}={value!r} is larger than any machine's memory (1 EiB); write e.g. '20GiB'")
        return int(value)
    if not isinstance(value, str):
        raise DeviceError(f"{what}={value!r} is not a size; write e.g. '20GiB', '16GB' or a number of bytes")
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(TiB|GiB|MiB|KiB|TB|GB|MB|KB|T|G|M|K|B)?\s*", str(value), re.IGNORECASE)
    if not match:
        raise DeviceError(f"{what}={value!r} is not a size; write e.g. '20GiB', '16GB' or a number of bytes")
    number = float(match.group(1))
    unit = (match.group(2) or "B").lower()
    scale = {
        "tib": 1024**4,
        "t": 1024**4,
        "tb": 1000**4,
        "gib": GiB,
        "g": GiB,
        "gb": 1000**3,
        "mib": 1024**2,
        "m": 1024**2,
        "mb": 1000**2,
        "kib": 1024,
        "k": 1024,
        "kb": 1000,
        "b": 1,
    }[unit]
    # A 400-digit number parses as float("inf"); no machine has that much memory.
    if not math.isfinite(number * scale) or number * scale >= MAX_SIZE:
        raise DeviceError(f"{what}={value!r} is larger than any machine's memory; write e.g. '20GiB'")
    return int(number * scale)


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
