"""Training on the devices it fits: where no strategy fits every visible device because other processes
fill some of them, the same job is planned again on the others, as ``devices=`` naming them would.

A multi-device plan is sized by its fullest device (every rank holds the same share), so one GPU that
another process fills leaves nothing fitting on all of them. A device with under ``BUSY_FRACTION`` of
the best one's free memory is the one passed over, as a ``devices=`` count passes it over
(``device/selection.py``). Only where nothing fits with it: a job that fits every device keeps them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from whichdevice.core.records import TraceStep
from whichdevice.core.sizes import format_bytes
from whichdevice.device.choice import idle_indices

if TYPE_CHECKING:
    from whichdevice.core.records import ProbeResult
    from whichdevice.memory.training_records import TrainingPlan

__all__ = ["idle_devices", "passed_over_step"]


def idle_devices(
    task: str, devices: object, launched: bool, plan: TrainingPlan | None, probe: ProbeResult
) -> tuple[int, ...] | None:
    """The devices to plan the training on instead of every visible one (None: keep the plan). ``devices``
    is what the caller passed as ``devices=``; ``launched``: a launcher started this process."""
    if task != "training" or devices is not None or launched:
        return None
    if plan is None or plan.chosen is not None or plan.launched is not None:
        return None
    idle = idle_indices(probe.devices)
    return idle if idle is not None and 0 < len(idle) < len(probe.devices) else None


def passed_over_step(probe: ProbeResult, idle: tuple[int, ...]) -> TraceStep:
    """Why the devices outside ``idle`` were left out of the training plan."""
    name = probe.backend
    busy = [d for d in probe.devices if d.index not in idle]
    said = "; ".join(
        f"{name}:{d.index} has {format_bytes(d.free_memory or 0)} free of "
        f"{format_bytes(d.total_memory) if d.total_memory is not None else 'unknown'}"
        for d in busy
    )
    planned = ", ".join(f"{name}:{i}" for i in idle)
    return TraceStep(
        "device",
        f"no training strategy fits all {len(probe.devices)} visible {name} devices, each sized by the "
        f"fullest ({said}: another process uses it); planned on {planned} instead, the devices with free memory",
    )
