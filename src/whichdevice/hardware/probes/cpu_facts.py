"""What the CPU is, read without torch: its model name, flags, memory, and the oneDNN ISA cap's names.

Kept apart from the CPU probe (cpu.py) so that the calibration, which keys its cache by the CPU,
reads these without the probe machinery.
"""

from __future__ import annotations

import platform
import subprocess
from functools import lru_cache

__all__ = ["BF16_CPU_FLAGS", "ONEDNN_ISAS", "ONEDNN_ISA_VARIABLE", "available_memory", "cpu_facts"]


# CPU flags that mean bf16 runs natively (x86 AVX512-BF16 / AMX, Arm BF16): fast bf16 matmuls.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


# oneDNN runs torch's CPU matmuls; capped below AVX512_CORE_BF16 it emulates bf16 even on a CPU that
# has the instructions (bf16 matmuls measured 3.4x slower than fp32 here under AVX512_CORE).
ONEDNN_ISA_VARIABLE = "ONEDNN_MAX_CPU_ISA"


ONEDNN_ISAS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)


# Every value oneDNN takes for ONEDNN_MAX_CPU_ISA (oneDNN's docs, "CPU ISA hints"); the rest keep bf16.
ONEDNN_ISAS = ONEDNN_ISAS_WITHOUT_BF16 | {
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


@lru_cache(maxsize=1)
def cpu_facts() -> tuple[str | None, frozenset[str], int | None]:
    """CPU model name, bf16-relevant flags and total memory, read once per process."""
    name: str | None = None
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name is None:
                    name = value.strip() or None
                elif key in ("flags", "Features"):
                    flags.update(value.split())
                    break
    except OSError:
        if platform.system() == "Darwin" and platform.machine() == "arm64":
            flags.update(_darwin_arm_flags())
    # Asked only where /proc/cpuinfo names no model (macOS, Windows, Arm Linux): on Linux it runs
    # `uname -p` in a subprocess, 10 ms of a fresh resolution on a 2-core VM, for "" or the machine.
    return name or platform.processor() or None, frozenset(flags & BF16_CPU_FLAGS), _total_memory()


def _total_memory() -> int | None:
    return _memory("MemTotal", "total")


def available_memory() -> int | None:
    """Memory the system can give a process now without swapping (psutil's ``available``); read on
    every probe, unlike the facts above, because it changes."""
    return _memory("MemAvailable", "available")


def _memory(meminfo_key: str, psutil_field: str) -> int | None:
    # On Linux /proc/meminfo is what psutil reads, in kB; psutil itself costs 20-60 ms to import (more
    # while probe threads run), which a fresh resolve_device() cannot afford. Read as UTF-8, whose codec
    # is loaded already ("ascii" imports encodings.ascii); a byte neither reads is a ValueError here.
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
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
