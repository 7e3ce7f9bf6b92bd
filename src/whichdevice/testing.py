"""Simulated hardware: ``simulate("hpu:8")`` replaces probe results, and nothing else.

A simulation swaps the probe *functions* and gives them a cache of their own; the probe machinery
(time limit, exception capture, one run per backend), the visible-devices parsing, the env hooks
and the whole resolver run for real. Spec strings::

    "cuda:4"                                  four GPUs with default details (Ampere-class)
    "cuda:8,cc=9.0,mem=141GiB,name=NVIDIA H200"
    "cuda:2,variant=rocm"                     AMD GPUs through the ROCm build
    "hpu:8,gen=gaudi3"   "npu:8,bf16=no"   "neuron:2"   "tpu:4"   "mps,macos=13.6"
    "cpu,flags=avx512_bf16"   "cpu,flags="    the CPU with (or without) native bf16
    "cpu,flags=amx_bf16,isa=AVX512_CORE"      ... with oneDNN capped below bf16 (ONEDNN_MAX_CPU_ISA)
    "npu,broken"   "npu,hangs"   "npu,missing"   "cuda:0"  installed-but-broken, a hanging probe,
                                              not installed, installed with no device

The count is the number of *physical* devices; visible-devices variables in the environment then
select among them, as the runtime would. Backends no spec names are simulated absent (``cpu`` is
probed for real) unless ``others="real"``. Nothing turns a simulation on from the environment.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from whichdevice import probing as _probe
from whichdevice.envhooks import _forget, apply_env_defaults
from whichdevice.errors import DeviceError
from whichdevice.records import Backend, DeviceInfo, ProbeResult
from whichdevice.registry import backend_names, get_backend, unknown_name_message
from whichdevice.sizing import parse_size

__all__ = ["SimulatedDevice", "parse_spec", "simulate"]

_GiB = 1024**3

# Plausible details per backend, so a bare "hpu:8" resolves like a real Gaudi 2 server.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {"name": "NVIDIA A100-SXM4-80GB", "mem": 80 * _GiB, "cc": (8, 0)},
    "rocm": {"name": "AMD Instinct MI300X", "mem": 192 * _GiB, "cc": (9, 4)},
    "hpu": {"name": "GAUDI2", "mem": 96 * _GiB, "gen": "gaudi2"},
    "npu": {"name": "Ascend910B2", "mem": 64 * _GiB, "bf16": True},
    "neuron": {"name": "Trainium2", "mem": 96 * _GiB},
    "tpu": {"name": "TPU v5e", "mem": 16 * _GiB},
    "xpu": {"name": "Intel(R) Data Center GPU Max 1550", "mem": 128 * _GiB, "bf16": True},
    "mps": {"name": "Apple M2", "mem": 16 * _GiB, "macos": "14.5"},
    "mlu": {"name": "MLU370-X8", "mem": 48 * _GiB, "bf16": True},
    "musa": {"name": "MTT S4000", "mem": 48 * _GiB, "bf16": True},
}

_MODES = {"broken", "hangs", "missing", "unavailable"}


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
    # the CPU's oneDNN cap (ONEDNN_MAX_CPU_ISA); part of the simulated CPU, so the shell's value does
    # not leak into a spec that pins the CPU
    isa: str | None = None
    mode: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


def _parse_memory(text: str) -> int:
    return parse_size(text, "simulate: mem")


def _parse_bool(key: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "yes", "true", "on"):
        return True
    if low in ("0", "no", "false", "off"):
        return False
    raise DeviceError(f"simulate: {key}={text!r} is not yes/no")


def parse_spec(spec: str) -> SimulatedDevice:
    """Parse one spec string ("cuda:8,cc=9.0,mem=141GiB") into a :class:`SimulatedDevice`."""
    if not isinstance(spec, str) or not spec.strip():
        raise DeviceError(f"simulate: a spec is a string like 'cuda:4' or 'hpu:8,gen=gaudi3', not {spec!r}")
    head, *rest = [p.strip() for p in spec.split(",")]
    name, _, count_text = head.partition(":")
    name = name.strip().lower()
    if name not in backend_names():
        raise DeviceError("simulate: " + unknown_name_message(name))
    count = 1
    if count_text:
        if not (count_text.isascii() and count_text.isdigit()):
            raise DeviceError(f"simulate: {head!r}: the count after ':' must be a number, e.g. {name}:4")
        count = int(count_text)
    fields: dict[str, Any] = {"backend": name, "count": count}
    extra: dict[str, str] = {}
    for item in rest:
        if not item:
            continue
        key, eq, value = item.partition("=")
        key = key.strip().lower()
        if not eq:
            if key not in _MODES:
                raise DeviceError(f"simulate: unknown flag {key!r} in {spec!r}; flags are {', '.join(sorted(_MODES))}")
            fields["mode"] = key
        elif key == "cc":
            match = re.fullmatch(r"(\d+)\.(\d+)", value.strip())
            if not match:
                raise DeviceError(f"simulate: cc={value!r} is not a compute capability like 8.0")
            fields["capability"] = (int(match.group(1)), int(match.group(2)))
        elif key in ("mem", "memory"):
            fields["memory"] = _parse_memory(value)
        elif key == "name":
            fields["name"] = value.strip()
        elif key == "variant":
            fields["variant"] = value.strip().lower()
        elif key in ("gen", "generation"):
            fields["generation"] = value.strip().lower()
        elif key == "bf16":
            fields["bf16"] = _parse_bool(key, value)
        elif key == "macos":
            fields["macos"] = value.strip()
        elif key == "flags":
            fields["flags"] = frozenset(f for f in re.split(r"[+ ]", value.strip()) if f)
        elif key == "isa":
            fields["isa"] = value.strip().upper()
        else:
            extra[key] = value.strip()
    if extra:
        raise DeviceError(
            f"simulate: unknown key(s) {', '.join(sorted(extra))} in {spec!r}; keys are "
            "cc, mem, name, variant, gen, bf16, macos, flags, isa"
        )
    return SimulatedDevice(**fields)


class _SimulatedStore(_probe._Store):
    def __init__(self, specs: dict[str, SimulatedDevice], others: str, release: threading.Event):
        super().__init__()
        self.specs = specs
        self.others = others
        self.release = release

    def function(self, backend: Backend) -> Callable[[Backend], ProbeResult]:
        spec = self.specs.get(backend.name)
        if spec is None:
            if self.others == "real" or backend.name == "cpu":
                return backend.probe
            return _absent
        return lambda b: _simulated_result(b, spec, self.release)


def _absent(backend: Backend) -> ProbeResult:
    from whichdevice.probes import not_installed

    return not_installed(backend, f"not present on the simulated machine ({backend.install_command})", simulated=True)


def _simulated_result(backend: Backend, spec: SimulatedDevice, release: threading.Event) -> ProbeResult:
    from whichdevice.packages import version_at_least
    from whichdevice.probes import (
        BF16_CPU_FLAGS,
        cpu_facts,
        cpu_result,
        cuda_order_warnings,
        finish,
        hpu_group_warnings,
        not_installed,
    )
    from whichdevice.visible import Visibility, visible_devices

    if spec.mode == "missing":
        return not_installed(backend, simulated=True)
    if spec.mode == "hangs":
        release.wait()  # until the simulation ends; the probe's time limit fires first
        raise TimeoutError("simulated hang released")
    if spec.mode == "broken":
        raise ImportError(
            f"simulated: importing {backend.module} failed (libascend_hal.so: cannot open shared object file)"
        )
    env_set = apply_env_defaults(backend, "import")
    variant = spec.variant or ("cuda" if backend.name == "cuda" else None)
    defaults = _DEFAULTS.get("rocm" if variant == "rocm" else backend.name, {})
    if backend.name == "cpu":
        name, real_flags, memory = cpu_facts()
        flags = spec.flags if spec.flags is not None else real_flags
        return cpu_result(
            backend,
            spec.name or name,
            frozenset(flags & BF16_CPU_FLAGS),
            spec.memory or memory,
            spec.isa,
            simulated=True,
        )
    vis = visible_devices(backend.name, variant=variant)
    physical = [str(i) for i in range(spec.count)]
    if vis.ids is None:
        chosen = physical
        warnings: list[str] = []
    else:
        # "0.1" (ZE_AFFINITY_MASK: tile 1 of device 0) is on physical device 0.
        chosen = [i for i in vis.ids if i.split(".")[0] in physical]
        missing = [i for i in vis.ids if i.split(".")[0] not in physical]
        warnings = (
            [f"{vis.variable}={vis.raw!r} names device(s) {', '.join(missing)} that this machine lacks"]
            if missing
            else []
        )
    capability = spec.capability
    if capability is None and backend.name == "cuda":
        capability = defaults.get("cc")
    generation = spec.generation or defaults.get("gen")
    name = spec.name or defaults.get("name")
    if backend.name == "hpu" and spec.generation and not spec.name:
        name = spec.generation.upper()  # the runtime reports "GAUDI3" for a Gaudi 3
    bf16 = spec.bf16 if spec.bf16 is not None else defaults.get("bf16")
    if backend.name == "hpu":
        bf16 = True
    macos = (spec.macos or defaults.get("macos")) if backend.name == "mps" else None
    if macos is not None and spec.bf16 is None:
        # The same rule as the real MPS probe: bf16 from macOS 14.
        bf16 = version_at_least(macos, "14")
    devices = [
        DeviceInfo(
            index,
            name,
            spec.memory or defaults.get("mem"),
            capability,
            generation,
            physical_id=pid,
            bf16=bf16,
        )
        for index, pid in enumerate(chosen)
    ]
    if backend.name == "hpu":
        warnings += hpu_group_warnings(vis)
        warnings += [a.message for a in env_set if a.action == "kept"]
    if backend.name == "cuda":
        warnings += cuda_order_warnings(vis, devices)
    reason = None
    if spec.mode == "unavailable":
        reason = f"{backend.package} is installed but its driver reports no usable device (simulated)"
    versions = {"torch": "simulated", backend.package: "simulated"}
    return finish(
        backend,
        devices,
        visibility=vis if isinstance(vis, Visibility) else None,
        variant=variant,
        warnings=warnings,
        env_set=env_set,
        os_version=macos,
        versions=versions,
        unavailable_reason=reason,
        simulated=True,
    )


class simulate(contextlib.ContextDecorator):  # noqa: N801 - reads as a verb at the call site
    """Pretend this machine has the hardware in ``specs``; usable as ``with``, decorator or fixture.

    ``others="absent"`` (default) reports every backend no spec names as not present (the CPU is
    probed for real); ``others="real"`` probes them for real. Nests; restores everything on exit,
    including variables the env-setup hooks set while it was on.
    """

    def __init__(self, *specs: str, others: str = "absent") -> None:
        if others not in ("absent", "real"):
            raise DeviceError(f"simulate(others={others!r}): use 'absent' or 'real'")
        parsed: dict[str, SimulatedDevice] = {}
        for spec in specs:
            for piece in _split_specs(spec):
                sim = parse_spec(piece)
                if sim.backend in parsed:
                    raise DeviceError(f"simulate: {sim.backend!r} is given twice; give each backend once")
                parsed[sim.backend] = sim
        self.specs = parsed
        self.others = others
        self._frames: list[tuple[_SimulatedStore, dict[str, str | None]]] = []

    def __enter__(self) -> simulate:
        release = threading.Event()
        store = _SimulatedStore(self.specs, self.others, release)
        env_before = {
            d.name: os.environ.get(d.name) for name in backend_names() for d in get_backend(name).env_defaults
        }
        self._frames.append((store, env_before))
        _probe._simulations.append(store)
        return self

    def __exit__(self, *exc: object) -> None:
        store, env_before = self._frames.pop()
        store.release.set()
        if store in _probe._simulations:
            _probe._simulations.remove(store)
        for name, old in env_before.items():
            if os.environ.get(name) != old:
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old
                _forget(name)

    @property
    def description(self) -> str:
        return ", ".join(f"{s.backend}:{s.count}" + (f" ({s.mode})" if s.mode else "") for s in self.specs.values())


def _split_specs(spec: str) -> list[str]:
    # "npu:8;cuda:2" or a list of separate strings both work; ';' separates machines' parts.
    if not isinstance(spec, str):
        raise DeviceError(f"simulate: a spec is a string like 'cuda:4', not {type(spec).__name__}")
    return [p for p in spec.split(";") if p.strip()] or [spec]


def active() -> bool:
    """True while a simulation is on (the command prints SIMULATED then)."""
    return bool(_probe._simulations)
