"""``whichdevice check``: is the device usable here, with enough devices? One JSON-safe answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from whichdevice.core.errors import DeviceError, exit_code_for
from whichdevice.core.records import ProbeResult
from whichdevice.device.request import as_task
from whichdevice.hardware.probing import gave_up
from whichdevice.report.gather import SCHEMA_VERSION, Replayable, simulation, simulation_dict
from whichdevice.report.rows import device_summary
from whichdevice.resolve.resolver import resolve_device

__all__ = ["check"]


def check(
    device: str | None = None,
    *,
    tasks: Sequence[str] = ("inference",),
    min_devices: int = 1,
    simulate: Sequence[str] = (),
    simulate_report: Replayable | None = None,
) -> dict[str, Any]:
    """Resolve ``device`` for each task and count its devices; the ``check`` object of the schema.

    ``exit_code`` is 0 when every task resolved with at least ``min_devices`` visible devices, 1 when
    the hardware falls short, 2 when the request is wrong; ``message`` says which, and what to do.
    """
    result: dict[str, Any] = {
        "kind": "check",
        "schema_version": SCHEMA_VERSION,
        "ok": False,
        "exit_code": 1,
        "requested": device,
        "tasks": list(tasks),
        "min_devices": min_devices,
        "device": None,
        "backend": None,
        "device_count": None,
        "message": "",
        "simulated": bool(simulate) or simulate_report is not None,
        "simulation": simulation_dict(simulate, simulate_report),
    }
    with simulation(simulate, simulate_report):
        code, message = _check_tasks(result, device, tasks, min_devices)
    if simulate:
        message = f"SIMULATED ({' '.join(simulate)}): {message}"
    elif simulate_report is not None:
        message = f"SIMULATED ({result['simulation']['report']}): {message}"
    result.update(ok=code == 0, exit_code=code, message=message)
    return result


def _check_tasks(result: dict[str, Any], device: str | None, tasks: Sequence[str], min_devices: int) -> tuple[int, str]:
    message = ""
    for task in tasks:
        try:
            res = resolve_device(device, task=as_task(task))
        except DeviceError as exc:
            return exit_code_for(exc), str(exc)
        given_up = gave_up()
        if device is None and given_up:
            # Detection without a backend that hung or crashed is not an answer a job should trust.
            name, reason = next(iter(given_up.items()))
            result.update(device=res.device, backend=res.backend.name)
            return (
                1,
                f"{name}: {reason}; detection would pick {res.device} without it (name the device to check it alone)",
            )
        probe = res.probe
        result.update(device=res.device, backend=res.backend.name, device_count=probe.device_count)
        if probe.device_count < min_devices:
            left_out = [s.message for s in res.trace if s.chosen is False and " not used: " in s.message]
            return 1, _too_few(res.backend.name, probe, min_devices, left_out)
        if probe.incompatible:
            # The devices are there, but the installed stack cannot run on them (see compatibility.py).
            return 1, f"{res.device} is present, but this installation cannot run on it: " + "; ".join(
                probe.incompatible
            )
        message = f"ok: {res.device} is usable ({device_summary(res.backend, probe)})"
        if device is None:
            message += f"; resolved by {res.source} for {task}"
    return 0, message


def _too_few(backend: str, probe: ProbeResult, min_devices: int, left_out: Sequence[str] = ()) -> str:
    count = probe.device_count
    vis = probe.visible
    if left_out:
        # The resolution left out devices this process cannot use (DeviceInfo.unusable).
        why = "; ".join(left_out)
    elif vis is not None and vis.variable and vis.ids is not None:
        why = f"{vis.variable}={vis.raw!r} makes only {count} visible; widen or unset it"
    else:
        why = f"run where {min_devices} are visible, or lower --min-devices"
    plural = "device is" if count == 1 else "devices are"
    return f"{backend}: {count} {plural} usable, fewer than --min-devices {min_devices}; {why}"
