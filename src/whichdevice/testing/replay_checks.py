"""A replayed report's rows checked by meaning, after their shape: what no probe writes is damage.

Decoding (testing/replay.py) makes sure each field has its type; a hand-edited or damaged report can
still hold values of the right type that no machine could have reported, and the resolver then fails
deep inside (an ``IndexError`` in device selection, for one). Each rule below is derived from the
backend's registry row and from what the probes write, never from a list of backend names:

- devices: a non-negative index below the row's ``device_count``, each index once, no more devices
  than the count;
- ``unusable``, ``compute_mode`` and ``other_processes`` of a device: only where the resolution can
  leave a device out one by one (device/selection.py narrows an indexed backend whose devices are not
  one shared device and not named by memory, the rows ``devices=`` takes), since only those probes
  read them (hardware/probes/cuda.py's NVML reading).
"""

from __future__ import annotations

from whichdevice.core.errors import DeviceError, shown
from whichdevice.core.records import Backend, ProbeResult

__all__ = ["check_row"]

_PER_DEVICE = ("unusable", "compute_mode", "other_processes")


def check_row(source: str, backend: Backend, result: ProbeResult) -> None:
    """Raise DeviceError (the report is damaged: exit 2) for a value ``result`` holds that no probe of
    ``backend`` writes."""
    where = f"{source}: backend {shown(backend.name)}"
    damaged = "the report is damaged, give the unchanged one"
    if result.device_count < 0:
        raise DeviceError(f"{where}: device_count={result.device_count} is below 0; {damaged}")
    if len(result.devices) > result.device_count:
        raise DeviceError(
            f"{where}: {len(result.devices)} devices listed for a device_count of {result.device_count}; {damaged}"
        )
    seen: set[int] = set()
    narrowable = backend.indexed and not backend.shared_device and not backend.memory_by_name
    for device in result.devices:
        if not 0 <= device.index < result.device_count:
            raise DeviceError(
                f"{where}: device index {device.index} is outside 0 to {result.device_count - 1} "
                f"(device_count={result.device_count}); {damaged}"
            )
        if device.index in seen:
            raise DeviceError(f"{where}: device index {device.index} is listed twice; {damaged}")
        seen.add(device.index)
        if narrowable:
            continue
        for name in _PER_DEVICE:
            if getattr(device, name) is not None:
                raise DeviceError(
                    f"{where}: devices[{device.index}].{name}={shown(getattr(device, name))}, which no probe of "
                    f"{backend.name} writes (its devices are not left out one by one); {damaged}"
                )
