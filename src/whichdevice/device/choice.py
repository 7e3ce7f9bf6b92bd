"""Which device of several, when none was named: the one with the most free memory, device 0 on a tie.

On a shared machine device 0 is often the busy one (every program's default). Free memory comes from
the probe (NVML for CUDA, read without starting a context); where it is unknown, or where device 0
has about as much as the best, device 0 stays, so a single-user machine behaves as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from whichdevice.core.records import TraceStep
from whichdevice.core.sizes import format_bytes

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, DeviceInfo, ProbeResult

__all__ = ["BUSY_FRACTION", "idle_indices", "least_busy"]

# Device 0 counts as busy when it has less than this share of the best device's free memory: a few
# hundred MiB held by a driver or a desktop must not move a job off device 0.
BUSY_FRACTION = 0.9


def _free(info: DeviceInfo) -> int | None:
    return info.free_memory


def idle_indices(devices: Sequence[DeviceInfo]) -> tuple[int, ...] | None:
    """The indices of ``devices`` with at least ``BUSY_FRACTION`` of the best one's free memory (None:
    some device's free memory is unknown, so none can be called busy)."""
    if any(_free(d) is None for d in devices):
        return None
    best = max((_free(d) or 0 for d in devices), default=0)
    return tuple(d.index for d in devices if (_free(d) or 0) >= BUSY_FRACTION * best)


def least_busy(backend: Backend, result: ProbeResult, task: str) -> tuple[int, list[TraceStep]]:
    """The index to use among ``result``'s devices, and the trace lines that say why."""
    devices = list(result.devices)
    # The first device this resolution may use: device 0, or the first of a selection (device/selection.py).
    first_index = devices[0].index if devices else 0
    if len(devices) < 2 or any(_free(d) is None for d in devices):
        return first_index, []
    best = max(devices, key=lambda d: (_free(d) or 0, -d.index))
    first = devices[0]
    if (_free(first) or 0) >= BUSY_FRACTION * (_free(best) or 0):
        return first_index, []
    busy = (
        f"{backend.name}:{first.index} has {format_bytes(_free(first) or 0)} free of "
        f"{format_bytes(first.total_memory or 0)} (another process uses it)"
    )
    if task == "training" and first.index != 0:
        return first_index, []  # a selection: its own warning names the variable that makes Trainer use it
    if task == "training":
        # Trainer in one process always trains on device 0: only the visible-devices variable moves it.
        variable = result.visible.variable if result.visible and result.visible.variable else None
        variable = variable or (backend.visible_devices_env[0] if backend.visible_devices_env else None)
        fix = f"{variable or 'the visible-devices variable'}={best.physical_id or best.index}"
        idle = list(idle_indices(devices) or ())
        every = (
            f"; to train on every idle device, resolve with devices={idle} (res.launch_command then starts one "
            "process on each)"
            if len(idle) > 1
            else ""
        )
        return 0, [
            TraceStep(
                "warning",
                f"{busy}; {backend.name}:{best.index} has {format_bytes(_free(best) or 0)} free. Trainer trains on "
                f"{backend.name}:0 in one process: start with {fix} python train.py to train there{every}",
            )
        ]
    why = (
        f"{backend.name}:{best.index}: the most free memory of the {len(devices)} visible devices "
        f"({format_bytes(_free(best) or 0)} of {format_bytes(best.total_memory or 0)}); {busy}"
    )
    return best.index, [TraceStep("device", why)]
