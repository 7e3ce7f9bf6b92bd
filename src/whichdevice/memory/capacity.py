"""How much memory each device offers the model: the free memory the runtime reports, less a margin,
or the user's max_memory; the devices a process may use; whether a model may be split over them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DeviceError
from whichdevice.core.records import TraceStep
from whichdevice.core.sizes import format_bytes, parse_size

if TYPE_CHECKING:
    from whichdevice.core.records import DeviceInfo, ProbeResult
    from whichdevice.device.target import Target

__all__ = ["can_split", "capacities", "cpu_memory", "memory_step", "usable_memory"]


def capacities(target: Target, max_memory: Mapping[int | str, Any] | None) -> dict[int | str, int] | None:
    """Memory per usable device (max_memory key -> bytes), the target's device first; None when the
    hardware does not say."""
    device, idx = target.device, target.index
    if max_memory is not None:
        wanted: dict[int | str, int] = {}
        for key, value in max_memory.items():
            if key == target.name or (isinstance(key, int) and not target.backend.shared_device):
                wanted[key] = parse_size(value, f"max_memory[{key!r}]")
        if not wanted:
            keys = (
                f"{target.name!r}" if target.backend.shared_device else f"device indices (0, 1, ...) for {target.name}"
            )
            raise DeviceError(
                f"max_memory={dict(max_memory)!r} has no entry for the resolved device {device}; give {keys}"
            )
        if idx is not None and idx in wanted:
            # The chosen device first, so the one-device check is against it.
            wanted = {idx: wanted[idx], **wanted}
        return wanted
    if target.backend.memory_by_name:
        memory = usable_memory(target.probe.devices[0]) if target.probe.devices else None
        return {target.name: memory} if memory else None
    devices = _devices(target)
    if not devices or any(d.total_memory is None for d in devices):
        return None
    return {d.index: int(usable_memory(d) or 0) for d in devices}


def _devices(target: Target) -> list[DeviceInfo]:
    """The devices a model may go on, the chosen one first (only it in a distributed run)."""
    devices = list(target.infos)
    if target.index is not None:
        devices = [d for d in devices if d.index == target.index] + [d for d in devices if d.index != target.index]
    return devices[:1] if target.distributed is not None else devices


def usable_memory(info: DeviceInfo) -> int | None:
    # Free memory where the runtime said it (another process may hold the rest), else the total.
    if info.free_memory is not None and info.total_memory is not None:
        return min(info.free_memory, info.total_memory)
    return info.total_memory


def memory_step(target: Target) -> TraceStep:
    """Which figure placement sizes against, free or total, for each device it may use."""
    devices = list(target.infos[:1]) if target.backend.memory_by_name else _devices(target)
    parts = []
    for d in devices:
        name = target.name if target.backend.memory_by_name else f"{target.name}:{d.index}"
        total = format_bytes(d.total_memory) if d.total_memory is not None else "unknown"
        if d.free_memory is not None:
            parts.append(f"{name} {format_bytes(usable_memory(d) or 0)} free of {total}")
        else:
            parts.append(f"{name} {total} total (free memory not reported)")
    return TraceStep("memory", "sized against " + ", ".join(parts))


def can_split(target: Target) -> bool:
    """Whether Accelerate may split a model over several of the target's devices in this process."""
    return target.backend.device_map_auto and target.distributed is None and not target.backend.memory_by_name


def cpu_memory(result: ProbeResult) -> int | None:
    """The CPU memory a process can take now (psutil's available) from the CPU's probe result, else
    the total; None if unknown."""
    if not result.devices:
        return None
    info = result.devices[0]
    return info.free_memory if info.free_memory is not None else info.total_memory
