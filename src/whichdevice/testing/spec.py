"""Spec strings for simulated hardware ("cuda:8,cc=9.0,mem=141GiB"), parsed and checked.

A spec names a backend, its number of physical devices, the details its runtime would report and,
optionally, a mode. Each detail is something one backend's runtime reports (``cc`` the CUDA
compute capability, ``macos`` the macOS version, ...); a key no reading of that backend takes is
an error, not a silent no-op. Every value is checked against what that runtime can report (the
probes' own tables: Gaudi generations, macOS releases, torch builds, oneDNN ISAs), and the error
names the values it accepts. A GPU's name, compute capability and memory describe one model: a
known model's name fills in what the spec leaves out, and a spec that contradicts it is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import field
from typing import Any

from whichdevice.core.errors import DeviceError
from whichdevice.core.frozen import frozen_record
from whichdevice.core.sizes import format_bytes
from whichdevice.hardware.probes.cuda import VARIANTS
from whichdevice.hardware.probes.hpu import GAUDI_GENERATIONS, gaudi_generation
from whichdevice.hardware.probes.mps import MACOS_RELEASES, MPS_MIN_MACOS
from whichdevice.hardware.probes.nvidia_platforms import HOSTS
from whichdevice.hardware.registry import backend_names, unknown_name_message
from whichdevice.testing.gpus import capabilities, gpu_details, host_conflict, name_conflict
from whichdevice.testing.spec_values import (
    MAX_COUNT,
    _bad,
    _choice,
    _parse_arch,
    _parse_bool,
    _parse_cc,
    _parse_compute,
    _parse_cuda_version,
    _parse_driver,
    _parse_flags,
    _parse_free,
    _parse_held,
    _parse_isa,
    _parse_memory,
    _parse_name,
    _quote,
)

__all__ = ["MAX_COUNT", "MODES", "SimulatedDevice", "family", "gpu_details", "parse_spec"]

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
    # the NVIDIA driver ("550.54.15", or "none": no driver), the torch build's CUDA version and its
    # kernel architectures ("sm_80+sm_90+compute_90"), for the compatibility checks
    "driver": ("driver", {"cuda"}),
    "cuda": ("cuda", {"cuda"}),
    "arch": ("arch", {"cuda"}),
    # the host's architecture as platform.machine() names it (aarch64: Grace, DGX Spark, Jetson);
    # default: the GPU's own host where the model has one, else x86_64
    "host": ("host", {"cuda"}),
    "calib": ("calibration", {"cpu"}),
    # the weight dtypes oneDNN packs there ("float32+bfloat16", or nothing); default: from the flags
    "packs": ("packs", {"cpu"}),
    # per GPU, "/"-separated: its compute mode ("default/exclusive_process"), and the memory other
    # processes hold there ("held=79GiB/1GiB"), which NVML reports with their processes
    "compute": ("compute_modes", {"cuda"}),
    "held": ("held", {"cuda"}),
}
# Keys every backend takes: spec key -> field of SimulatedDevice
_COMMON_KEYS = {"name": "name", "mem": "memory", "free": "free"}
_ALIASES = {"memory": "mem", "generation": "gen"}


def family(backend: str) -> str:
    """The readings family of ``backend``: "cpu", "cuda", "hpu", "mps", "tpu", "xpu" or "module"."""
    return _FAMILIES.get(backend, "module")


@frozen_record
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
    driver: str | None = None
    cuda: str | None = None
    arch: tuple[str, ...] | None = None
    host: str | None = None
    # the CPU's calibration figures ("bf16.b1:1.15/bf16.prompt:0.3", see whichdevice.measure.calibration)
    calibration: str | None = None
    # the weight dtypes oneDNN packs on the simulated CPU (None: as its flags imply)
    packs: frozenset[str] | None = None
    mode: str | None = None
    # Free memory per physical device ("free=2GiB/80GiB": device 0 busy, device 1 idle); one value
    # applies to every device, and devices past the list are idle (free = total).
    free: tuple[int, ...] | None = None
    # Per physical device, like free=: the compute mode (devices past the list: "default"), and the
    # memory another process holds (past the list: none). Without free=, free is the memory less it.
    compute_modes: tuple[str, ...] | None = None
    held: tuple[int, ...] | None = None
    extra: dict[str, str] = field(default_factory=dict)


def _parse_macos(key: str, text: str) -> str:
    value = text.strip()
    match = re.fullmatch(r"([0-9]{1,3})(\.[0-9]{1,2}){0,2}", value)
    if not match or int(match.group(1)) not in MACOS_RELEASES:
        releases = ", ".join(str(r) for r in MACOS_RELEASES)
        raise _bad(
            key, text, "a macOS release of Apple Silicon Macs", f"a version with major {releases}, e.g. {key}=14.5"
        )
    return value


def _parse_calibration(key: str, text: str) -> str:
    from whichdevice.measure.calibration import parse_figures

    try:
        parse_figures(text)
    except ValueError as error:
        raise DeviceError(f"simulate: {key}={_quote(text)}: {error}") from None
    return text.strip()


def _parse_packs(key: str, text: str) -> frozenset[str]:
    from whichdevice.measure.cpu_memory import PACKED_DTYPES

    names = frozenset(n for n in re.split(r"[+ ]", text.strip().lower()) if n)
    if not names <= set(PACKED_DTYPES):
        accepted = "+".join(PACKED_DTYPES)
        raise _bad(key, text, "the weight dtypes oneDNN packs", f"{accepted}, one of them, or nothing")
    return names


# spec key -> its parser: (key, text) -> value, raising DeviceError that names what is accepted
_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "name": _parse_name,
    "mem": _parse_memory,
    "free": _parse_free,
    "cc": _parse_cc,
    "variant": _choice("a build of torch", VARIANTS),
    "gen": _choice("a Gaudi generation", GAUDI_GENERATIONS),
    "bf16": _parse_bool,
    "macos": _parse_macos,
    "flags": _parse_flags,
    "isa": _parse_isa,
    "driver": _parse_driver,
    "cuda": _parse_cuda_version,
    "arch": _parse_arch,
    "host": _choice("a host architecture as platform.machine() names it", HOSTS),
    "calib": _parse_calibration,
    "packs": _parse_packs,
    "compute": _parse_compute,
    "held": _parse_held,
}


def _parse_value(key: str, value: str) -> Any:
    parser = _PARSERS.get(key)
    return parser(key, value) if parser is not None else value.strip()


def _head(spec: str, head: str) -> dict[str, Any]:
    name, colon, count_text = head.partition(":")
    name = name.strip().lower()
    if name not in backend_names():
        raise DeviceError("simulate: " + unknown_name_message(name))
    count = 1
    if colon:
        text = count_text.strip()
        if not (text.isascii() and text.isdigit()):
            raise DeviceError(
                f"simulate: {head[:40]!r}: the count after ':' must be a number from 0 to {MAX_COUNT}, e.g. {name}:4"
            )
        if len(text.lstrip("0")) > len(str(MAX_COUNT)) or int(text) > MAX_COUNT:
            raise DeviceError(
                f"simulate: {head[:40]!r}: no machine has that many {name} devices; give a count from 0 to {MAX_COUNT}"
            )
        count = int(text)
    return {"backend": name, "count": count}


def _keys() -> list[str]:
    return [*_COMMON_KEYS, *_DETAIL_KEYS]


def parse_spec(spec: str) -> SimulatedDevice:
    """Parse one spec string ("cuda:8,cc=9.0,mem=141GiB") into a :class:`SimulatedDevice`."""
    if not isinstance(spec, str) or not spec.strip():
        raise DeviceError(f"simulate: a spec is a string like 'cuda:4' or 'hpu:8,gen=gaudi3', not {_quote(spec, 80)}")
    head, *rest = [p.strip() for p in spec.split(",")]
    fields = _head(spec, head)
    extra: list[str] = []
    given: set[str] = set()
    for item in rest:
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        key = _ALIASES.get(key, key)
        if key in given:
            raise DeviceError(f"simulate: {key[:40]} is given twice in {_quote(spec, 80)}; give each key and flag once")
        given.add(key)
        if not eq:
            if key not in MODES:
                raise DeviceError(
                    f"simulate: unknown flag {_quote(key)} in {_quote(spec, 80)}; flags are {', '.join(sorted(MODES))}"
                )
            if "mode" in fields:
                raise DeviceError(
                    f"simulate: {_quote(spec, 80)} gives two modes, {fields['mode']!r} and {key!r}; a device is in "
                    f"at most one of {', '.join(sorted(MODES))}"
                )
            fields["mode"] = key
        elif key in _COMMON_KEYS or key in _DETAIL_KEYS:
            attr = _COMMON_KEYS.get(key) or _DETAIL_KEYS[key][0]
            fields[attr] = _parse_value(key, value)
        else:
            extra.append(_quote(key))
    if extra:
        raise DeviceError(
            f"simulate: unknown key(s) {', '.join(sorted(extra))} in {_quote(spec, 80)}; keys are {', '.join(_keys())}"
        )
    device = SimulatedDevice(**fields)
    _check(spec, device)
    if device.macos is not None and device.mode is None and _before(device.macos, MPS_MIN_MACOS):
        # What torch does on such a Mac: MPS is built in but not available.
        device = SimulatedDevice(**{**fields, "mode": "unavailable"})
    return device


def _before(version: str, minimum: str) -> bool:
    def parts(text: str) -> tuple[int, ...]:
        return tuple(int(p) for p in text.split("."))

    return parts(version) < parts(minimum)


def _check(spec: str, device: SimulatedDevice) -> None:
    kind = family(device.backend)
    for key, (attr, families) in _DETAIL_KEYS.items():
        if getattr(device, attr) is not None and kind not in families:
            takers = sorted(n for n in backend_names() if family(n) in families)
            raise DeviceError(
                f"simulate: {key}= in {_quote(spec, 80)} is not something the {device.backend} runtime reports; "
                f"{key}= applies to {', '.join(takers)}"
            )
    _check_build(spec, device)
    if kind == "mps" and device.count > 1:
        raise DeviceError(f"simulate: {_quote(spec, 80)}: a Mac has one MPS device; write 'mps' (or 'mps:0' for none)")
    if kind == "cpu" and device.mode not in (None, "hangs"):
        raise DeviceError(f"simulate: the CPU is always there; {device.mode!r} applies to the other backends")
    if kind == "cpu" and device.count != 1:
        raise DeviceError(
            f"simulate: {_quote(spec, 80)}: torch has one CPU device; write 'cpu' (flags=, mem=, name= describe it)"
        )
    if kind == "cuda":
        _check_gpu(spec, device)
    _check_free(spec, device)
    if device.generation is not None:
        # The probe reads the generation from the device name ("GAUDI3"): the two must agree.
        named = gaudi_generation(device.name) if device.name is not None else device.generation
        if named != device.generation:
            raise DeviceError(
                f"simulate: name={device.name!r} reads as {named or 'no Gaudi generation'}, but "
                f"gen={device.generation!r}; the generation comes from the name, so give one of them"
            )
    elif kind == "hpu" and gaudi_generation(device.name) not in (None, *GAUDI_GENERATIONS):
        raise DeviceError(
            f"simulate: name={device.name!r} names no Gaudi generation the probe knows "
            f"({', '.join(GAUDI_GENERATIONS)}); name it like 'Intel Gaudi 3' or give gen= instead"
        )


def _check_free(spec: str, device: SimulatedDevice) -> None:
    for key, values in (("free", device.free), ("compute", device.compute_modes), ("held", device.held)):
        if values and len(values) > max(device.count, 1):
            raise DeviceError(
                f"simulate: {key}= in {_quote(spec, 80)} gives {len(values)} values for {device.count} device(s); "
                "give one value per device, or one for all"
            )
    for key, sizes in (("free", device.free), ("held", device.held)):
        if sizes and device.memory is not None and max(sizes) > device.memory:
            raise DeviceError(
                f"simulate: {key}= in {_quote(spec, 80)} is more than the device's memory "
                f"({format_bytes(device.memory)}); {key} memory is at most mem="
            )
    if device.free and device.held:
        total = device.memory or gpu_details(device.name, device.variant or VARIANTS[0], device.capability, None)[1]
        for index in range(max(len(device.free), len(device.held))):
            free, held = _at(device.free, index), _at(device.held, index)
            if free is not None and held is not None and free + held > total:
                raise DeviceError(
                    f"simulate: {_quote(spec, 80)}: device {index} has {format_bytes(free)} free and "
                    f"{format_bytes(held)} held by other processes, more than its {format_bytes(total)}; "
                    "give one of free= and held=, or values that add up to at most mem="
                )


def _at(values: tuple[int, ...], index: int) -> int | None:
    """A per-device value as simulate reads it: one value for all, else the list's (None past it)."""
    if len(values) == 1:
        return values[0]
    return values[index] if index < len(values) else None


def _check_gpu(spec: str, device: SimulatedDevice) -> None:
    variant = device.variant or VARIANTS[0]
    if device.capability is not None and device.capability not in capabilities(variant):
        accepted = ", ".join(f"{a}.{b}" for a, b in capabilities(variant))
        raise DeviceError(
            f"simulate: cc={device.capability[0]}.{device.capability[1]} in {_quote(spec, 80)} is not a compute "
            f"capability of a {variant} GPU; cc= takes {accepted}"
        )
    conflict = name_conflict(device.name, variant, device.capability, device.memory) or host_conflict(
        device.name, variant, device.host
    )
    if conflict is not None:
        raise DeviceError(f"simulate: {_quote(spec, 80)}: {conflict}")


def _check_build(spec: str, device: SimulatedDevice) -> None:
    """driver=, cuda= and arch= describe an NVIDIA driver and a CUDA build of torch."""
    given = [k for k in ("driver", "cuda", "arch") if getattr(device, k) is not None]
    if given and device.variant == "rocm":
        raise DeviceError(
            f"simulate: {'=, '.join(given)}= in {_quote(spec, 80)} describe a CUDA build; variant=rocm has none"
        )
    nvml = [k for k, attr in (("compute", "compute_modes"), ("held", "held")) if getattr(device, attr) is not None]
    if nvml and device.variant == "rocm":
        raise DeviceError(
            f"simulate: {'=, '.join(nvml)}= in {_quote(spec, 80)} describe what NVIDIA's driver (NVML) reports; "
            "whichdevice reads neither for AMD GPUs, so variant=rocm takes neither"
        )
    if device.driver not in (None, "none") and device.cuda is None:
        raise DeviceError(
            f"simulate: driver={device.driver} in {_quote(spec, 80)} is checked against the torch build's CUDA "
            "version: give it too, e.g. cuda=13.0"
        )
    bad = [a for a in device.arch or () if not re.fullmatch(r"(sm|compute)_\d{2,3}[af]?", a)]
    if bad:
        raise DeviceError(
            f"simulate: arch= in {_quote(spec, 80)}: {', '.join(bad)} is not like sm_90, sm_90a or compute_90"
        )
