"""The CPU probe: model name, native-bf16 flags and memory, read once; oneDNN's ISA cap interpreted."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field, replace

from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import Backend, DeviceInfo, ProbeResult
from whichdevice.hardware.probes.common import finish, installed_versions, read_env
from whichdevice.hardware.probes.cpu_facts import (
    BF16_CPU_FLAGS,
    ONEDNN_ISA_VARIABLE,
    ONEDNN_ISAS,
    ONEDNN_ISAS_WITHOUT_BF16,
    available_memory,
    cpu_facts,
)

# BF16_CPU_FLAGS ... cpu_facts are read in cpu_facts.py (below the probes, for the calibration).
__all__ = [
    "BF16_CPU_FLAGS",
    "ENV_VARIABLES",
    "ONEDNN_ISAS",
    "ONEDNN_ISA_VARIABLE",
    "CpuReadings",
    "available_memory",
    "bf16_cap",
    "cpu_facts",
    "cpu_result",
    "interpret_cpu",
    "probe_cpu",
    "read_cpu",
]


ENV_VARIABLES = (ONEDNN_ISA_VARIABLE,)


@frozen_record
class CpuReadings:
    """The CPU's model name, its bf16-relevant flags, total and available memory and the variables read."""

    name: str | None = None
    flags: frozenset[str] = frozenset()
    memory: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    versions: Mapping[str, str] = field(default_factory=dict)
    free: int | None = None


def read_cpu(backend: Backend) -> CpuReadings:
    name, flags, memory = cpu_facts()
    return CpuReadings(name, flags, memory, read_env(ENV_VARIABLES), installed_versions(backend), available_memory())


def bf16_cap(isa: str | None) -> str | None:
    """Why ``ONEDNN_MAX_CPU_ISA=isa`` turns native bf16 off, or None when it leaves it on."""
    if isa is None or isa.strip().upper() not in ONEDNN_ISAS_WITHOUT_BF16:
        return None
    return (
        f"{ONEDNN_ISA_VARIABLE}={isa} caps oneDNN below AVX512_CORE_BF16, so torch emulates bf16 "
        f"on this CPU; unset {ONEDNN_ISA_VARIABLE} to use its native bf16"
    )


def interpret_cpu(backend: Backend, readings: CpuReadings) -> ProbeResult:
    """Native bf16 needs one of :data:`BF16_CPU_FLAGS` and no oneDNN cap below AVX512_CORE_BF16."""
    flags = frozenset(readings.flags & BF16_CPU_FLAGS)
    cap = bf16_cap(readings.env.get(ONEDNN_ISA_VARIABLE)) if flags else None
    device = DeviceInfo(
        0, name=readings.name, total_memory=readings.memory, bf16=bool(flags) and cap is None, free_memory=readings.free
    )
    return finish(backend, [device], features=flags, warnings=[cap] if cap else [], versions=readings.versions)


def cpu_result(
    backend: Backend,
    name: str | None,
    flags: frozenset[str],
    memory: int | None,
    isa: str | None,
    *,
    simulated: bool = False,
) -> ProbeResult:
    """The CPU's result from its readings given one by one (kept for callers of the older form)."""
    env = {ONEDNN_ISA_VARIABLE: isa} if isa is not None else {}
    result = interpret_cpu(backend, CpuReadings(name, flags, memory, env, installed_versions(backend)))
    return replace(result, simulated=True) if simulated else result


def probe_cpu(backend: Backend) -> ProbeResult:
    return interpret_cpu(backend, read_cpu(backend))
