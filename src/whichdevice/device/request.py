"""The request: what the caller asked for, from the arguments or ``WHICHDEVICE_DEVICE``, parsed and checked.

Everything here is about the words the user wrote: a device string that does not parse, a name no
backend answers to, a task or quantize value that does not exist. Each error names what to write
instead. Nothing here probes hardware.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

from whichdevice.core import envview
from whichdevice.core.errors import DeviceError, UnknownDeviceError, closest_match, shown
from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import TraceStep
from whichdevice.hardware.registry import backend_names

__all__ = [
    "ENV_DEVICE",
    "ENV_VARIABLES",
    "TASKS",
    "DeviceRequest",
    "Task",
    "as_task",
    "device_names",
    "parse_device",
    "read_request",
]

ENV_DEVICE = "WHICHDEVICE_DEVICE"
# The variables this module reads (the memo key holds them; see whichdevice.resolve.memo).
ENV_VARIABLES = (ENV_DEVICE,)
Task = Literal["inference", "training"]
TASKS: tuple[Task, ...] = ("inference", "training")


def as_task(value: str) -> Task:
    """A task name read from a command line or a file, as resolve_device() types it; DeviceError otherwise."""
    for task in TASKS:
        if value == task:
            return task
    raise DeviceError(f"task={value!r}: use 'inference' or 'training'")


@frozen_record
class DeviceRequest:
    """The device asked for and where the request came from ("device", ``ENV_DEVICE`` or "detection")."""

    source: str = "detection"
    asked: str | None = None
    name: str = ""
    index: int | None = None

    @property
    def detect(self) -> bool:
        return self.source == "detection"


def read_request(device: Any) -> tuple[DeviceRequest, list[TraceStep]]:
    """The device argument beats ``WHICHDEVICE_DEVICE``, which beats detection."""
    env_value = envview.environ().get(ENV_DEVICE)
    if device is not None:
        name, index = parse_device(device, "device")
        steps = [
            TraceStep("request", f"device={shown(str(device))} given as an argument (beats {ENV_DEVICE} and detection)")
        ]
        if env_value:
            steps.append(TraceStep("request", f"{ENV_DEVICE}={shown(env_value)} ignored: the argument wins"))
        return DeviceRequest("device", str(device), name, index), steps
    if env_value is not None and env_value.strip():
        name, index = parse_device(env_value, ENV_DEVICE)
        steps = [TraceStep("request", f"{ENV_DEVICE}={shown(env_value)} set in the environment (beats detection)")]
        return DeviceRequest(ENV_DEVICE, env_value, name, index), steps
    return DeviceRequest(), []


def device_names(values: Any, what: str) -> list[str]:
    """The backend names in ``prefer``/``exclude`` (one device or an iterable of them)."""
    if values is None:
        return []
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        # One device ("cuda", a torch.device), or a wrong type that parse_device then names.
        values = [values]
    return [parse_device(v, what)[0] for v in values]


# ----------------------------------------------------------------------------- device strings

_DEVICE_RE = re.compile(r"([a-z_][a-z0-9_]*)(?::(.*))?", re.DOTALL)


def parse_device(value: Any, source: str = "device") -> tuple[str, int | None]:
    """Split a device request ("cuda:1", "hpu", torch.device) into (backend name, index or None).

    ``source`` names where the value came from ("device", "WHICHDEVICE_DEVICE") so the error
    points at the thing to fix.
    """
    names = backend_names()
    text = _device_text(value, source, names)
    match = _DEVICE_RE.fullmatch(text)
    name = match.group(1) if match else text.split(":", 1)[0]
    if name not in names:
        raise _unknown_name(text, name, source, names)
    if match is None or match.group(2) is None:
        if ":" in text:
            raise UnknownDeviceError(f"{source}={shown(value)}: unexpected text; write {shown(name)} or '{name}:0'")
        return name, None
    return name, _device_index(match.group(2), name, text, source)


def _device_text(value: Any, source: str, names: tuple[str, ...]) -> str:
    """``value`` as a device string, or the error for a value that cannot be one."""
    valid = ", ".join(names)
    if type(value).__name__ == "device" and hasattr(value, "type") and hasattr(value, "index"):
        value = str(value)
    if isinstance(value, bool) or not isinstance(value, str):
        hint = ""
        if isinstance(value, int) and not isinstance(value, bool):
            hint = f" A bare index is ambiguous: write 'cuda:{value}' (or 'npu:{value}', 'xpu:{value}', ...)."
        raise UnknownDeviceError(
            f"{source}={shown(value)}: a device is a string such as 'cuda', 'cuda:1', 'hpu' or 'cpu', or a "
            f"torch.device, not {type(value).__name__}.{hint} Valid device names: {valid}."
        )
    if not value.strip():
        raise UnknownDeviceError(
            f"{source}={shown(value)} is empty; pass a device such as 'cuda:0' or 'cpu', or leave it out "
            f"to detect one. Valid device names: {valid}."
        )
    if value != value.strip():
        # What is inside must be right too, so that the suggested fix parses.
        parse_device(value.strip(), source)
        raise UnknownDeviceError(f"{source}={shown(value)} has surrounding spaces; write {shown(value.strip())}")
    return value


def _unknown_name(text: str, name: str, source: str, names: tuple[str, ...]) -> UnknownDeviceError:
    lowered = text.lower()
    if lowered != text and lowered.split(":", 1)[0] in names:
        try:
            parse_device(lowered, source)
            fixed = lowered
        except DeviceError:
            fixed = lowered.split(":", 1)[0]
        return UnknownDeviceError(f"{source}={shown(text)}: device strings are lower case; write {shown(fixed)}")
    guess = closest_match(name, names)
    suggestion = f" Did you mean {guess!r}?" if guess else ""
    return UnknownDeviceError(
        f"{source}={shown(text)}: unknown device {shown(name)}.{suggestion} Valid device names: {', '.join(names)}."
    )


def _device_index(index_text: str, name: str, value: str, source: str) -> int:
    if index_text == "":
        raise UnknownDeviceError(
            f"{source}={shown(value)}: the index after ':' is missing; write '{name}:0' or just {shown(name)}"
        )
    if not _is_index(index_text):
        if ":" in index_text:
            first = index_text.split(":")[0]
            raise UnknownDeviceError(
                f"{source}={shown(value)}: a device has one index; write '{name}:{first if _is_index(first) else 0}'"
            )
        if index_text.startswith("-") and _is_index(index_text[1:]):
            raise UnknownDeviceError(
                f"{source}={shown(value)}: device indices start at 0; write '{name}:0' or just {shown(name)}"
            )
        raise UnknownDeviceError(
            f"{source}={shown(value)}: {shown(index_text)} is not a device index; write e.g. '{name}:0'"
        )
    if len(index_text.lstrip("0")) > 7:
        # No machine numbers this many devices; also keeps int() away from its 4300-digit limit.
        raise UnknownDeviceError(
            f"{source}={shown(value)}: index {index_text[:20]}... is too large to be a device; write e.g. '{name}:0'"
        )
    return int(index_text)


def _is_index(text: str) -> bool:
    # ASCII digits only: str.isdigit() also accepts "١" or "²", which int() or torch reject.
    return text.isascii() and text.isdigit()
