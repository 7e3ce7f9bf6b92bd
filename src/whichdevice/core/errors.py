"""Errors raised by whichdevice: each says what was asked, what this machine has, and what to do."""

from __future__ import annotations

TYPE_CHECKING = False  # typing itself costs milliseconds at import; see whichdevice/__init__.py
if TYPE_CHECKING:
    from collections.abc import Iterable

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
]


class DeviceError(ValueError):
    """A device request that cannot be honoured; the message names the fix."""


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
