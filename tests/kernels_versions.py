"""kernels versions for tests, taken from the installed transformers' accepted range (it moves with
every transformers release: 5.24 takes 0.18.2-0.19, 5.25 takes 0.19.1-0.20)."""

from __future__ import annotations

from packaging.version import Version

from whichdevice.attention.kernels import transformers_kernels_range

LOW, HIGH = transformers_kernels_range()
GOOD_KERNELS = LOW or "0.18.2"


def _parts(text: str) -> tuple[int, int, int]:
    v = Version(text)
    return v.major, v.minor, v.micro


def below_range() -> str:
    """The release just under the lowest accepted one."""
    major, minor, micro = _parts(GOOD_KERNELS)
    return f"{major}.{minor}.{micro - 1}" if micro else f"{major}.{minor - 1}.99"


def inside_range() -> str:
    """A later patch release of the lowest accepted one (still under the maximum)."""
    major, minor, micro = _parts(GOOD_KERNELS)
    return f"{major}.{minor}.{micro + 7}"


def at_maximum() -> str:
    """The first release transformers no longer accepts."""
    if HIGH:
        return HIGH
    major, minor, _ = _parts(GOOD_KERNELS)
    return f"{major}.{minor + 1}"
