"""How much memory each device offers the model: the free memory the runtime reports, less a margin,
or the user's max_memory; the devices a process may use; whether a model may be split over them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DeviceError
from whichdevice.core.records import TraceStep
from whichdevice.core.sizes import format_bytes, parse_size

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, DeviceInfo, ProbeResult
    from whichdevice.launch.distributed import DistributedContext

__all__ = ["can_split", "capacities", "cpu_memory", "memory_step", "usable_memory"]


def capacities(
    backend: Backend,
    result: ProbeResult,
    device: str,
    dist: DistributedContext | None,
    max_memory: Mapping[int | str, Any] | None,
) -> dict[int | str, int] | None:
    """Memory per usable device (max_memory key -> bytes); None when the hardware does not say."""
    _, _, idx = device.partition(":")
    if max_memory is not None:
        wanted: dict[int | str, int] = {}
        for key, value in max_memory.items():
            if key == backend.name or (isinstance(key, int) and not backend.shared_device):
                wanted[key] = parse_size(value, f"max_memory[{key!r}]")
        if not wanted:
            keys = f"{backend.name!r}" if backend.shared_device else f"device indices (0, 1, ...) for {backend.name}"
            raise DeviceError(
                f"max_memory={dict(max_memory)!r} has no entry for the resolved device {device}; give {keys}"
            )
        if idx and int(idx) in wanted:
            # The chosen device first, so the one-device check is against it.
            wanted = {int(idx): wanted[int(idx)], **wanted}
        return wanted
    if backend.memory_by_name:
        memory = usable_memory(result.devices[0]) if result.devices else None
        return {backend.name: memory} if memory else None
    devices = _devices(result, device, dist)
    if not devices or any(d.total_memory is None for d in devices):
        return None
    return {d.index: int(usable_memory(d) or 0) for d in devices}


def _devices(result: ProbeResult, device: str, dist: DistributedContext | None) -> list[DeviceInfo]:
    """The devices a model may go on, the chosen one first (only it in a distributed run)."""
    _, _, idx = device.partition(":")
    devices = list(result.devices)
    if idx:
        devices = [d for d in devices if d.index == int(idx)] + [d for d in devices if d.index != int(idx)]
    return devices[:1] if dist is not None else devices


def usable_memory(info: DeviceInfo) -> int | None:
    # Free memory where the runtime said it (another process may hold the rest), else the total.
    if info.free_memory is not None and info.total_memory is not None:
        return min(info.free_memory, info.total_memory)
    return info.total_memory


def memory_step(backend: Backend, result: ProbeResult, device: str, dist: DistributedContext | None) -> TraceStep:
    """Which figure placement sizes against, free or total, for each device it may use."""
    devices = result.devices[:1] if backend.memory_by_name else _devices(result, device, dist)
    parts = []
    for d in devices:
        name = backend.name if backend.memory_by_name else f"{backend.name}:{d.index}"
        total = format_bytes(d.total_memory) if d.total_memory is not None else "unknown"
        if d.free_memory is not None:
            parts.append(f"{name} {format_bytes(usable_memory(d) or 0)} free of {total}")
        else:
            parts.append(f"{name} {total} total (free memory not reported)")
    return TraceStep("memory", "sized against " + ", ".join(parts))


def can_split(backend: Backend, dist: DistributedContext | None) -> bool:
    """Whether Accelerate may split a model over several of ``backend``'s devices in this process."""
    return backend.device_map_auto and dist is None and not backend.memory_by_name


def cpu_memory(result: ProbeResult) -> int | None:
    """The CPU memory a process can take now (psutil's available) from the CPU's probe result, else
    the total; None if unknown."""
    if not result.devices:
        return None
    info = result.devices[0]
    return info.free_memory if info.free_memory is not None else info.total_memory
