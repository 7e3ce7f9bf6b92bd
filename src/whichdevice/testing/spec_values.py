"""The values of a simulate() spec's keys, each parsed and checked by one function ("cc=8.0", "mem=80GiB", ...)."""

from __future__ import annotations

import re
from collections.abc import Callable

from whichdevice.core.errors import DeviceError
from whichdevice.core.sizes import format_bytes, parse_size
from whichdevice.hardware.probes.cpu_facts import ONEDNN_ISAS
from whichdevice.hardware.probes.nvidia import COMPUTE_MODES

# More devices than one machine has (a trn2 shows 128 NeuronCores); also keeps int() from long digits.
MAX_COUNT = 1024
_MIN_MEMORY = 1024  # a bare "mem=16" is 16 bytes: below this the unit was forgotten
_MAX_MEMORY = 64 * 1024**4
_MAX_NAME = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE: no runtime reports a longer name


def _quote(text: str, limit: int = 40) -> str:
    """``text`` for an error message: a 5000-digit value is not echoed back whole."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def _bad(key: str, text: str, what: str, accepted: str) -> DeviceError:
    return DeviceError(f"simulate: {key}={_quote(text)} is not {what}; {key}= takes {accepted}")


def _parse_bool(key: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "yes", "true", "on"):
        return True
    if low in ("0", "no", "false", "off"):
        return False
    raise DeviceError(f"simulate: {key}={_quote(text)} is not yes/no; {key}= takes yes, no, true, false, 1 or 0")


def _parse_cc(key: str, text: str) -> tuple[int, int]:
    match = re.fullmatch(r"([0-9]{1,2})\.([0-9]{1,2})", text.strip())
    if not match:
        raise DeviceError(f"simulate: {key}={_quote(text)} is not a compute capability like 8.0 (major.minor)")
    return (int(match.group(1)), int(match.group(2)))


def _parse_memory(key: str, text: str) -> int:
    digits = re.match(r"\s*0*([0-9]*)", text)
    if digits is not None and len(digits.group(1)) > 20:  # past float's range for a size: no device has it
        raise DeviceError(f"simulate: {key}={_quote(text)} is more than any device has; give e.g. {key}=80GiB")
    size = parse_size(text, f"simulate: {key}")
    if size == 0:
        raise DeviceError(
            f"simulate: {key}={_quote(text)} is no memory at all; give the device's memory, e.g. {key}=16GiB"
        )
    if size < _MIN_MEMORY:
        raise DeviceError(
            f"simulate: {key}={_quote(text)} is {size} bytes; write the unit, e.g. {key}={text.strip()}GiB"
        )
    if size > _MAX_MEMORY:
        raise DeviceError(
            f"simulate: {key}={_quote(text)} is more than any device has; give at most {format_bytes(_MAX_MEMORY)}"
        )
    return size


def _parse_name(key: str, text: str) -> str:
    name = text.strip()
    if not name or not name.isprintable() or len(name) > _MAX_NAME:
        raise _bad(key, text, "a device name", f"the name its runtime reports: printable, 1 to {_MAX_NAME} characters")
    return name


def _choice(what: str, accepted: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(key: str, text: str) -> str:
        value = text.strip().lower()
        if value not in accepted:
            raise DeviceError(
                f"simulate: {key}={_quote(text)} is not {what}: use {' or '.join(f'{key}={a}' for a in accepted)}"
            )
        return value

    return parse


def _parse_flags(key: str, text: str) -> frozenset[str]:
    flags = [f for f in re.split(r"[+ ]", text.strip().lower()) if f]
    wrong = [f for f in flags if not re.fullmatch(r"[a-z0-9_]+", f)]
    if wrong:
        raise _bad(
            key, text, "a list of CPU flags", "/proc/cpuinfo flags joined by '+' (avx512_bf16+amx_bf16), or nothing"
        )
    return frozenset(flags)


def _parse_isa(key: str, text: str) -> str:
    value = text.strip().upper()
    if value not in ONEDNN_ISAS:
        raise _bad(key, text, "a oneDNN ISA", "a value of ONEDNN_MAX_CPU_ISA: " + ", ".join(sorted(ONEDNN_ISAS)))
    return value


def _parse_free(key: str, text: str) -> tuple[int, ...]:
    # Free memory may be zero (a GPU another process filled), so only the upper bound of _parse_memory.
    parts = text.split("/")
    if len(parts) > MAX_COUNT:
        raise DeviceError(f"simulate: {key}= lists {len(parts)} devices; give at most one value per device")
    return tuple(0 if _is_zero(part) else _parse_memory(key, part) for part in parts)


def _parse_held(key: str, text: str) -> tuple[int, ...]:
    """Memory other processes hold per device ("held=79GiB/1GiB"): 0 where none does."""
    return _parse_free(key, text)


# nvidia-smi's short word for the mode most clusters use, beside NVML's names.
_MODE_ALIASES = {"exclusive": "exclusive_process"}


def _parse_compute(key: str, text: str) -> tuple[str, ...]:
    parts = [p.strip().lower() for p in text.split("/")]
    if len(parts) > MAX_COUNT:
        raise DeviceError(f"simulate: {key}= lists {len(parts)} devices; give at most one value per device")
    modes = [_MODE_ALIASES.get(p, p) for p in parts]
    wrong = [p for p, m in zip(parts, modes, strict=True) if m not in COMPUTE_MODES.values()]
    if wrong:
        accepted = ", ".join([*COMPUTE_MODES.values(), *_MODE_ALIASES])
        raise _bad(key, text, "a list of NVIDIA compute modes", f"one per device, joined with '/': {accepted}")
    return tuple(modes)


def _is_zero(text: str) -> bool:
    return re.fullmatch(r"\s*0+(\.0*)?\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE) is not None


def _parse_driver(key: str, text: str) -> str:
    value = text.strip()
    if value.lower() == "none":
        return "none"
    if not re.fullmatch(r"[0-9]{2,4}(\.[0-9]{1,3}){1,2}", value):
        raise _bad(
            key, text, "an NVIDIA driver version", f"a version such as {key}=580.65.06, or {key}=none for no driver"
        )
    return value


def _parse_cuda_version(key: str, text: str) -> str:
    value = text.strip()
    if not re.fullmatch(r"[0-9]{1,2}\.[0-9]{1,2}", value):
        raise _bad(key, text, "a CUDA version", f"the torch build's CUDA major.minor, e.g. {key}=13.0")
    return value


def _parse_arch(key: str, text: str) -> tuple[str, ...]:
    return tuple(a.lower() for a in re.split(r"[+ ]", text.strip()) if a)
