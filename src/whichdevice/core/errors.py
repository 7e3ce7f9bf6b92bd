"""Errors raised by whichdevice: each says what was asked, what this machine has, and what to do."""

from __future__ import annotations

TYPE_CHECKING = False  # typing itself costs milliseconds at import; see whichdevice/__init__.py
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

__all__ = [
    "ArgumentsClassError",
    "ConfigConflictError",
    "DamagedModelError",
    "DeviceError",
    "DeviceUnavailableError",
    "DoesNotFitError",
    "PackageVersionError",
    "UnknownDeviceError",
    "closest_match",
    "exit_code_for",
    "printable",
    "shown",
]


# The longest error message said in full: past it, the middle goes (a value quoted without
# ``shown`` must not turn a 1 MB variable into a 2 MB message; the fix is said at the end).
MESSAGE_LIMIT = 2000


class DeviceError(ValueError):
    """A device request that cannot be honoured; the message names the fix."""

    def __str__(self) -> str:
        text = super().__str__()
        if len(text) <= MESSAGE_LIMIT:
            return text
        head, tail = MESSAGE_LIMIT * 2 // 3, MESSAGE_LIMIT // 4
        return f"{text[:head]}... ({len(text) - head - tail} characters left out) ...{text[-tail:]}"


class UnknownDeviceError(DeviceError):
    """A device string (or backend name) that no registered backend answers to."""


class DeviceUnavailableError(DeviceError):
    """A known backend that is not installed, not usable, or lacks the requested index."""


class PackageVersionError(DeviceUnavailableError, ImportError):
    """A package whichdevice hands over to (transformers, ...) that is missing or too old to work with.

    Also an ``ImportError``, so code that already guards the import of an optional package catches it.
    """


class ConfigConflictError(DeviceError):
    """An explicit setting that contradicts the hardware (bf16 on a GPU without bf16, ...)."""


class ArgumentsClassError(ConfigConflictError, TypeError):
    """An ``arguments_class`` that is not a TrainingArguments subclass, or a keyword it does not take.

    Also a ``TypeError``, as Python raises for a wrong type or an unexpected keyword.
    """


class DoesNotFitError(DeviceError):
    """A model larger than the memory of the devices it may use."""


class DamagedModelError(DeviceError):
    """A model file that cannot be read as what it claims to be; the message names the file and the fix."""


# Characters that change what a terminal shows rather than showing themselves: C0/C1 controls
# (escape sequences, carriage return, newline), the line/paragraph separators, and the
# bidirectional overrides that reorder text ("Trojan Source", CVE-2021-42574).
_UNPRINTABLE = "[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]"
_unprintable_re: list[Any] = []

# The most characters of one outside value an error quotes (a 1 MB variable is not a message).
SHOWN_LIMIT = 120


def printable(text: str) -> str:
    """``text`` with every control character written as its escape (``\\x1b``, ``\\n``), so that
    text from a file, the environment or a device prints as text: no escape sequence reaches the
    terminal and no newline forges a line of output."""
    if text.isprintable():  # the common case, without compiling anything
        return text
    if not _unprintable_re:
        import re

        _unprintable_re.append(re.compile(_UNPRINTABLE))
    return str(_unprintable_re[0].sub(_escape, text))


def _escape(match: Any) -> str:
    return str(match.group().encode("unicode_escape").decode("ascii"))


def shown(value: object, limit: int = SHOWN_LIMIT) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters with the full length said."""
    text = repr(value)
    if len(text) <= limit:
        return text
    length = f" ({len(value)} characters)" if isinstance(value, (str, bytes)) else ""
    return f"{text[:limit]}...{length}"


# Words people type for a device that are not device strings. Checked before fuzzy matching
# because "gpu" is closer to "mps" than to "cuda" by edit distance.
_ALIASES = {
    "gpu": "cuda",
    "nvidia": "cuda",
    "rocm": "cuda",
    "hip": "cuda",
    "amd": "cuda",
    "gaudi": "hpu",
    "habana": "hpu",
    "ascend": "npu",
    "trainium": "neuron",
    "inferentia": "neuron",
    "xla": "tpu",
    "apple": "mps",
    "metal": "mps",
    "intel": "xpu",
    "arc": "xpu",
    "cambricon": "mlu",
    "moorethreads": "musa",
    "mthreads": "musa",
}


def closest_match(word: str, choices: Iterable[str]) -> str | None:
    """The valid name a user most likely meant by ``word``, or None."""
    choices = list(choices)
    key = word.strip().lower().split(":", 1)[0].replace(" ", "").replace("-", "").replace("_", "")
    if key in choices:
        return key
    alias = _ALIASES.get(key)
    if alias in choices:
        return alias
    import difflib  # only on the error path: it costs a few ms at import

    matches = difflib.get_close_matches(key, choices, n=1, cutoff=0.5)
    return matches[0] if matches else None


def exit_code_for(exc: BaseException) -> int:
    """1 when the hardware cannot do what was asked, 2 when the request itself is wrong."""
    if isinstance(exc, (DeviceUnavailableError, DoesNotFitError)):
        return 1
    if isinstance(exc, DeviceError):
        return 2
    return 1
