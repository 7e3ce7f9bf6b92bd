"""The CPU probe: model name, native-bf16 flags and memory, read once; oneDNN's ISA cap interpreted."""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache

from whichdevice.core.records import Backend, DeviceInfo, ProbeResult
from whichdevice.hardware.probes.common import finish, installed_versions, read_env

__all__ = [
    "BF16_CPU_FLAGS",
    "ENV_VARIABLES",
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

# CPU flags that mean bf16 runs natively (x86 AVX512-BF16 / AMX, Arm BF16): fast bf16 matmuls.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})

# oneDNN runs torch's CPU matmuls; capped below AVX512_CORE_BF16 it emulates bf16 even on a CPU that
# has the instructions (bf16 matmuls measured 3.4x slower than fp32 here under AVX512_CORE).
ONEDNN_ISA_VARIABLE = "ONEDNN_MAX_CPU_ISA"
_ONEDNN_ISAS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)
# Every value oneDNN takes for ONEDNN_MAX_CPU_ISA (oneDNN's docs, "CPU ISA hints"); the rest keep bf16.
ONEDNN_ISAS = _ONEDNN_ISAS_WITHOUT_BF16 | {
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX512_CORE_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
    "DEFAULT",
    "ALL",
}

ENV_VARIABLES = (ONEDNN_ISA_VARIABLE,)


@dataclass(frozen=True)
class CpuReadings:
    """The CPU's model name, its bf16-relevant flags, total and available memory and the variables read."""

    name: str | None = None
    flags: frozenset[str] = frozenset()
    memory: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    versions: Mapping[str, str] = field(default_factory=dict)
    free: int | None = None


@lru_cache(maxsize=1)
def cpu_facts() -> tuple[str | None, frozenset[str], int | None]:
    """CPU model name, bf16-relevant flags and total memory, read once per process."""
    name: str | None = platform.processor() or None
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name in (None, "", platform.machine()):
                    name = value.strip()
                elif key in ("flags", "Features"):
                    flags.update(value.split())
                    break
    except OSError:
        if platform.system() == "Darwin" and platform.machine() == "arm64":
            flags.update(_darwin_arm_flags())
    return name, frozenset(flags & BF16_CPU_FLAGS), _total_memory()


def _total_memory() -> int | None:
    return _memory("MemTotal", "total")


def available_memory() -> int | None:
    """Memory the system can give a process now without swapping (psutil's ``available``); read on
    every probe, unlike the facts above, because it changes."""
    return _memory("MemAvailable", "available")


def _memory(meminfo_key: str, psutil_field: str) -> int | None:
    # On Linux /proc/meminfo is what psutil reads, in microseconds; psutil itself costs 20-60 ms to
    # import (more while probe threads run), which a fresh resolve_device() cannot afford.
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                key, _, value = line.partition(":")
                if key == meminfo_key:
                    return int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:  # macOS, Windows; psutil comes with accelerate
        import psutil

        return int(getattr(psutil.virtual_memory(), psutil_field))
    except Exception:  # a broken psutil must not break the CPU probe
        return None


def _darwin_arm_flags() -> set[str]:
    try:
        out = subprocess.run(
            ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True, timeout=2
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return set()
    return {"bf16"} if out == "1" else set()


def read_cpu(backend: Backend) -> CpuReadings:
    name, flags, memory = cpu_facts()
    return CpuReadings(name, flags, memory, read_env(ENV_VARIABLES), installed_versions(backend), available_memory())


def bf16_cap(isa: str | None) -> str | None:
    """Why ``ONEDNN_MAX_CPU_ISA=isa`` turns native bf16 off, or None when it leaves it on."""
    if isa is None or isa.strip().upper() not in _ONEDNN_ISAS_WITHOUT_BF16:
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
