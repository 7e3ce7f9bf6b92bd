"""The target stage: the backend chosen for a request, then the target the job runs on.

``candidate`` is the backend as chosen (asked for, or the first usable one in the detection order), a
:class:`Target` on its first device before anything is narrowed: what a pre-quantized checkpoint's
needs are checked against (memory/prequantized.py may move it to a later backend that runs its
method). ``narrowed_target`` makes the target the deciders ask: the launched run this process belongs
to (read by the resolver: launch/steps.py), the devices it uses (``devices=``, or those this process
can use) and the device string and index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from whichdevice.core.records import Trace, TraceStep
from whichdevice.device.detection import choose_backend, device_string
from whichdevice.device.selection import select_devices
from whichdevice.device.target import Target

if TYPE_CHECKING:
    from whichdevice.device.request import DeviceRequest
    from whichdevice.device.selection import DevicesAsked
    from whichdevice.launch.context import DistributedContext

__all__ = ["candidate", "narrowed_target"]


def candidate(request: DeviceRequest, prefer: Any, exclude: Any) -> tuple[Target, list[TraceStep]]:
    """The backend the request resolves to, on its first device, with the lines that say why."""
    (backend, result), steps = choose_backend(request, prefer, exclude)
    return Target.of(backend, result), steps


def narrowed_target(
    chosen: Target, asked: DevicesAsked | None, dist: DistributedContext | None, task: str, request: DeviceRequest
) -> tuple[Target, list[TraceStep]]:
    """The target on ``chosen``'s backend in ``dist``, the launched run this process belongs to (None: one
    process; launch/steps.py's launch_of): its devices narrowed to ``asked`` (and to those this process can
    use), and its device; with the lines that say why."""
    backend = chosen.backend
    trace = Trace()
    result, selection = trace.take(select_devices(backend, chosen.probe, asked, dist, task, request))
    device, index, count = trace.take(device_string(backend, result, request, dist, task))
    return Target(backend, result, device, index, count, selection, dist, request.source), trace
