"""The BACKENDS section: one row per registry record, with what its probe found in a few words."""

from __future__ import annotations

from typing import Any

from whichdevice.core.records import Backend, ProbeResult
from whichdevice.hardware.probes.cuda import BUILDS

__all__ = ["BUILDS", "backend_row", "device_summary"]


def backend_row(backend: Backend, result: ProbeResult) -> dict[str, Any]:
    """The registry record and its probe result, flattened into one ``backends`` entry."""
    row: dict[str, Any] = {
        "name": backend.name,
        "hardware": backend.hardware,
        "package": backend.package,
        "install_command": backend.install_command,
        "visible_devices_env": list(backend.visible_devices_env),
        "distributed_backend": backend.distributed_backend,
        "status": "available" if result.available else ("unavailable" if result.installed else "not installed"),
        "version": result.versions.get(backend.package),
        "summary": device_summary(backend, result),
    }
    probe = result.to_dict()
    probe.pop("backend")
    row.update(probe)
    return row


def device_summary(backend: Backend, result: ProbeResult) -> str:
    """ "8 x GAUDI2 (96 GiB)"-style text for the devices a probe found ("" when none)."""
    if not result.available:
        return ""
    host = _is_host(backend)
    groups: dict[tuple[Any, ...], int] = {}
    for d in result.devices:
        key = (d.name, d.total_memory, d.capability)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for (name, memory, capability), n in groups.items():
        if host and memory:
            details = [f"{_memory(memory)} RAM"]
        else:
            cc = f"cc {capability[0]}.{capability[1]}" if capability else None
            details = [x for x in (_memory(memory), cc) if x]
        what = name or "model unknown"
        text = f"{n} x {what}" if n > 1 else what
        parts.append(text + (f" ({', '.join(details)})" if details else ""))
    count = result.device_count
    head = f"{count} device{'s' if count != 1 else ''}"
    summary = f"{head}: {'; '.join(parts)}" if parts else head
    if len(groups) == 1 and count > 1:
        summary = parts[0]  # "8 x GAUDI2 (96 GiB)" already says how many
    if host:
        summary += _cpu_bf16(result)
    if result.variant:
        summary += f", {BUILDS.get(result.variant, result.variant)} build"
    return summary


def _is_host(backend: Backend) -> bool:
    # The CPU row describes the machine itself: its memory is the RAM, and whether bf16 is native
    # depends on the instruction-set flags its probe reports as features.
    return backend.name == "cpu"


def _cpu_bf16(result: ProbeResult) -> str:
    flags = sorted(result.features)
    if not flags:
        return ", no native bf16"
    native = bool(result.devices and result.devices[0].bf16)
    return f", {'native' if native else 'emulated'} bf16 ({', '.join(flags)}{'' if native else ' turned off'})"


def _memory(nbytes: int | None) -> str | None:
    if not nbytes:
        return None
    gib = nbytes / 1024**3
    if gib >= 1024:
        return f"{gib / 1024:.1f} TiB"
    return f"{gib:.0f} GiB" if gib >= 10 else f"{gib:.1f} GiB"
