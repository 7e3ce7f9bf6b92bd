"""Spec strings for simulated hardware ("cuda:8,cc=9.0,mem=141GiB"), parsed and checked.

A spec names a backend, its number of physical devices, the details its runtime would report and,
optionally, a mode. Each detail is something one backend's runtime reports (``cc`` the CUDA
compute capability, ``macos`` the macOS version, ...); a key no reading of that backend takes is
an error, not a silent no-op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from whichdevice.errors import DeviceError
from whichdevice.probes.hpu import gaudi_generation
from whichdevice.registry import backend_names, unknown_name_message
from whichdevice.sizing import parse_size

__all__ = ["MODES", "SimulatedDevice", "family", "parse_spec"]

MODES = frozenset({"broken", "hangs", "missing", "unavailable"})

# Which readings a backend's probe takes; out-of-tree device modules (npu, mlu, musa, neuron and
# third-party backends) share the "module" readings.
_FAMILIES = {"cpu": "cpu", "cuda": "cuda", "hpu": "hpu", "mps": "mps", "tpu": "tpu", "xpu": "xpu"}

# spec key -> (field of SimulatedDevice, the families whose readings take it)
_DETAIL_KEYS = {
    "cc": ("capability", {"cuda"}),
    "variant": ("variant", {"cuda"}),
    "gen": ("generation", {"hpu"}),
    "bf16": ("bf16", {"xpu", "module"}),
    "macos": ("macos", {"mps"}),
    "flags": ("flags", {"cpu"}),
    "isa": ("isa", {"cpu"}),
    "calib": ("calibration", {"cpu"}),
}
_ALIASES = {"memory": "mem", "generation": "gen"}


def family(backend: str) -> str:
    """The readings family of ``backend``: "cpu", "cuda", "hpu", "mps", "tpu", "xpu" or "module"."""
    return _FAMILIES.get(backend, "module")


@dataclass(frozen=True)
class SimulatedDevice:
    """One parsed spec: a backend, a physical device count, details and a mode."""

    backend: str
    count: int = 1
    name: str | None = None
    memory: int | None = None
    capability: tuple[int, int] | None = None
    variant: str | None = None
    generation: str | None = None
    bf16: bool | None = None
    macos: str | None = None
    flags: frozenset[str] | None = None
    # oneDNN's cap (ONEDNN_MAX_CPU_ISA) belongs to the simulated CPU: a spec that pins the flags is
    # not turned to emulated bf16 by the shell's value
    isa: str | None = None
    # the CPU's calibration figures ("bf16.b1:1.15/bf16.prompt:0.3", see whichdevice.calibration)
    calibration: str | None = None
    mode: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


def _parse_bool(key: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "yes", "true", "on"):
        return True
    if low in ("0", "no", "false", "off"):
        return False
    raise DeviceError(f"simulate: {key}={text!r} is not yes/no")


def _parse_value(key: str, value: str) -> Any:
    if key == "cc":
        match = re.fullmatch(r"(\d+)\.(\d+)", value.strip())
        if not match:
            raise DeviceError(f"simulate: cc={value!r} is not a compute capability like 8.0")
        return (int(match.group(1)), int(match.group(2)))
    if key == "mem":
        return parse_size(value, "simulate: mem")
    if key in ("variant", "gen"):
        return value.strip().lower()
    if key == "bf16":
        return _parse_bool(key, value)
    if key == "flags":
        return frozenset(f for f in re.split(r"[+ ]", value.strip()) if f)
    if key == "isa":
        return value.strip().upper()
    if key == "calib":
        from whichdevice.calibration import parse_figures

        try:
            parse_figures(value)
        except ValueError as error:
            raise DeviceError(f"simulate: calib={value!r}: {error}") from None
    return value.strip()


def _head(spec: str, head: str) -> dict[str, Any]:
    name, _, count_text = head.partition(":")
    name = name.strip().lower()
    if name not in backend_names():
        raise DeviceError("simulate: " + unknown_name_message(name))
    count = 1
    if count_text:
        if not (count_text.isascii() and count_text.isdigit()):
            raise DeviceError(f"simulate: {head!r}: the count after ':' must be a number, e.g. {name}:4")
        count = int(count_text)
    return {"backend": name, "count": count}


def parse_spec(spec: str) -> SimulatedDevice:
    """Parse one spec string ("cuda:8,cc=9.0,mem=141GiB") into a :class:`SimulatedDevice`."""
    if not isinstance(spec, str) or not spec.strip():
        raise DeviceError(f"simulate: a spec is a string like 'cuda:4' or 'hpu:8,gen=gaudi3', not {spec!r}")
    head, *rest = [p.strip() for p in spec.split(",")]
    fields = _head(spec, head)
    extra: list[str] = []
    for item in rest:
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        key = _ALIASES.get(key, key)
        if not eq:
            if key not in MODES:
                raise DeviceError(f"simulate: unknown flag {key!r} in {spec!r}; flags are {', '.join(sorted(MODES))}")
            fields["mode"] = key
        elif key in ("name", "mem") or key in _DETAIL_KEYS:
            fields["memory" if key == "mem" else _DETAIL_KEYS.get(key, (key,))[0]] = _parse_value(key, value)
        else:
            extra.append(key)
    if extra:
        raise DeviceError(
            f"simulate: unknown key(s) {', '.join(sorted(extra))} in {spec!r}; keys are "
            "cc, mem, name, variant, gen, bf16, macos, flags, isa, calib"
        )
    device = SimulatedDevice(**fields)
    _check(spec, device)
    return device


def _check(spec: str, device: SimulatedDevice) -> None:
    kind = family(device.backend)
    for key, (attr, families) in _DETAIL_KEYS.items():
        if getattr(device, attr) is not None and kind not in families:
            takers = sorted(n for n in backend_names() if family(n) in families)
            raise DeviceError(
                f"simulate: {key}= in {spec!r} is not something the {device.backend} runtime reports; "
                f"{key}= applies to {', '.join(takers)}"
            )
    if device.variant not in (None, "cuda", "rocm"):
        raise DeviceError(f"simulate: variant={device.variant!r} in {spec!r}: use variant=cuda or variant=rocm")
    if kind == "mps" and device.count > 1:
        raise DeviceError(f"simulate: {spec!r}: a Mac has one MPS device; write 'mps' (or 'mps:0' for none)")
    if kind == "cpu" and device.mode not in (None, "hangs"):
        raise DeviceError(f"simulate: the CPU is always there; {device.mode!r} applies to the other backends")
    if device.generation is not None:
        # The probe reads the generation from the device name ("GAUDI3"): the two must agree.
        if gaudi_generation(device.generation.upper()) != device.generation:
            raise DeviceError(f"simulate: gen={device.generation!r} is not a Gaudi generation (gaudi1, gaudi2, gaudi3)")
        named = gaudi_generation(device.name) if device.name is not None else device.generation
        if named != device.generation:
            raise DeviceError(
                f"simulate: name={device.name!r} reads as {named or 'no Gaudi generation'}, but "
                f"gen={device.generation!r}; the generation comes from the name, so give one of them"
            )
