"""Which of a backend's devices a resolution uses: the ones ``devices=`` names, less those this process cannot use.

``devices=`` takes Lightning's forms (``lightning.fabric.utilities.device_parser._parse_gpu_ids``): a
count ``N`` (N devices), a list of indices (``[1, 3]``), ``-1`` (every device), or a string of those
(``"0,2"``, ``"-1"``; as Lightning reads a string, ``"2"`` is a count and ``"2,"`` the index 2).
Indices are the ones this process sees, after ``CUDA_VISIBLE_DEVICES``. A count takes the usable
devices with free memory first (a device with under ``BUSY_FRACTION`` of the best one's free memory
comes last), in index order.

The answer is the one making those devices visible would give: the probe result keeps only them,
under the indices this process gives them (``device_map``, ``max_memory`` and the device string in
this process), and its visibility names their physical devices, which the launch command writes
(``env CUDA_VISIBLE_DEVICES=2,3 torchrun --nproc-per-node=2 ...``). A device this process cannot use
(``DeviceInfo.unusable``: exclusive-process mode held by another process, prohibited mode) is left
out the same way when nothing was asked, and refused when asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import ConfigConflictError, DeviceError, DeviceUnavailableError, shown
from whichdevice.core.frozen import frozen_record
from whichdevice.core.numbers import parse_number
from whichdevice.core.records import ProbeResult, TraceStep, Visibility
from whichdevice.core.sizes import format_bytes
from whichdevice.device.choice import idle_indices

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, DeviceInfo
    from whichdevice.device.request import DeviceRequest
    from whichdevice.launch.context import DistributedContext

__all__ = ["DevicesAsked", "narrowed_training", "parse_devices", "select_devices"]

_FORMS = "a count (2), a list of indices ([0, 2]), -1 for every device, or a string of those ('0,2', '2', '-1')"


@frozen_record
class DevicesAsked:
    """``devices=`` as parsed: a count, a list of indices, or every device."""

    shown: str  # as the user wrote it, for messages
    count: int | None = None
    indices: tuple[int, ...] | None = None

    @property
    def every(self) -> bool:
        return self.count is None and self.indices is None


def parse_devices(value: Any, what: str = "devices") -> DevicesAsked | None:
    """``devices=`` in one of Lightning's forms (None: not given); DeviceError for anything else."""
    if value is None:
        return None
    said = f"{what}={shown(value)}"
    if isinstance(value, str):
        text = value.strip()
        if text == "-1":
            return DevicesAsked(said)
        if "," in text:
            parts = [p.strip() for p in text.split(",") if p.strip()]
            if not parts or not all(_is_index(p) for p in parts):
                raise DeviceError(f"{said}: a comma string lists device indices ('0,2'); give {_FORMS}")
            return _indices(said, [int(p) for p in parts])
        if not _is_index(text):
            raise DeviceError(f"{said}: give {_FORMS}")
        return _count(said, int(text))
    if isinstance(value, bool):
        raise DeviceError(f"{said}: True and False are not device counts; give {_FORMS}")
    if isinstance(value, int):
        return DevicesAsked(said) if value == -1 else _count(said, value)
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise DeviceError(f"{said}: a list holds device indices, whole numbers such as [0, 2]; give {_FORMS}")
        return _indices(said, list(value))
    raise DeviceError(f"{said}: give {_FORMS}, not {type(value).__name__}")


def _is_index(text: str) -> bool:
    # ASCII digits, and few of them (core.numbers, the one parser of numbers people set).
    return parse_number("devices", text).value is not None


def _count(said: str, count: int) -> DevicesAsked:
    if count == 0:
        raise DeviceError(f"{said} selects no device: pass device='cpu' to run on the CPU, or leave devices out")
    if count < 0 or count > 10**7:
        raise DeviceError(f"{said}: a count is 1 or more (or -1 for every device); give {_FORMS}")
    return DevicesAsked(said, count=count)


def _indices(said: str, indices: list[int]) -> DevicesAsked:
    if not indices:
        raise DeviceError(f"{said} names no device; give {_FORMS}")
    if any(i < 0 or i > 10**7 for i in indices):
        raise DeviceError(f"{said}: device indices start at 0; give {_FORMS}")
    twice = sorted({i for i in indices if indices.count(i) > 1})
    if twice:
        raise DeviceError(f"{said} names device {', '.join(map(str, twice))} twice; name each device once")
    return DevicesAsked(said, indices=tuple(indices))


Selected = tuple[tuple[ProbeResult, "tuple[int, ...] | None"], list[TraceStep]]


def select_devices(
    backend: Backend,
    result: ProbeResult,
    asked: DevicesAsked | None,
    dist: DistributedContext | None,
    task: str,
    request: DeviceRequest,
) -> Selected:
    """The probe result narrowed to the devices this resolution uses, and their indices (None: every
    visible device, nothing narrowed), with the trace lines that say why."""
    _check_request(backend, result, asked, request)
    (narrowed, chosen), steps = _select(backend, result, asked, dist)
    if task == "training" and dist is None and chosen is not None:
        steps.append(TraceStep("warning", narrowed_training(backend, chosen, narrowed) or ""))
    return (narrowed, chosen), steps


def _check_request(backend: Backend, result: ProbeResult, asked: DevicesAsked | None, request: DeviceRequest) -> None:
    """A device index asked for (device=, WHICHDEVICE_DEVICE) is one device: not beside a list, and usable."""
    if request.index is None:
        return
    where = f"{request.source}={request.asked!r}" if request.source != "device" else f"device={request.asked!r}"
    if asked is not None:
        raise ConfigConflictError(
            f"{where} names one device and {asked.shown} a list: give one of them (device={backend.name!r} "
            "with devices= picks from the list)"
        )
    mine = next((d for d in result.devices if d.index == request.index), None)
    if mine is not None and mine.unusable is not None:
        usable = ", ".join(f"{backend.name}:{d.index}" for d in result.devices if d.unusable is None)
        raise DeviceUnavailableError(
            f"{where} cannot be used by this process: {mine.unusable}. Usable here: {usable or 'none'}"
        )


def _select(
    backend: Backend, result: ProbeResult, asked: DevicesAsked | None, dist: DistributedContext | None
) -> Selected:
    if asked is not None and (not backend.indexed or backend.shared_device or backend.memory_by_name):
        where = f" (select them with {backend.visible_devices_env[0]})" if backend.visible_devices_env else ""
        raise ConfigConflictError(
            f"{asked.shown}: {backend.name}'s device strings carry no index, so there is no device list to "
            f"choose from{where}; leave devices out"
        )
    devices = list(result.devices)
    left_out = [d for d in devices if d.unusable is not None]
    if dist is not None:
        return _launched(backend, result, asked, dist, left_out)
    steps = [TraceStep("device", f"{backend.name}:{d.index} not used: {d.unusable}", False) for d in left_out]
    if asked is None:
        if not left_out:
            return (result, None), []
        usable = [d for d in devices if d.unusable is None]
        return (_narrowed(backend, result, usable), tuple(d.index for d in usable)), steps
    applied = _applied(result, asked)
    if applied:
        return (result, None), [TraceStep("device", applied)]
    chosen, why = _chosen(backend, devices, asked)
    if len(chosen) == len(devices):
        return (result, None), [TraceStep("device", f"{asked.shown}: every visible {backend.name} device")]
    narrowed = _narrowed(backend, result, chosen)
    assert narrowed.visible is not None
    vis = narrowed.visible
    steps.append(
        TraceStep(
            "device",
            f"{asked.shown}: {', '.join(f'{backend.name}:{d.index}' for d in chosen)}{why}; the same answer as "
            f"{vis.variable}={vis.raw}, which the launch command sets (res.launch_command)",
        )
    )
    return (narrowed, tuple(d.index for d in chosen)), steps


def _chosen(backend: Backend, devices: list[DeviceInfo], asked: DevicesAsked) -> tuple[list[DeviceInfo], str]:
    """The devices ``asked`` names, checked, and what the trace adds about a count's choice."""
    usable = [d for d in devices if d.unusable is None]
    valid = ", ".join(str(d.index) for d in devices) or "none"
    if asked.indices is not None:
        by_index = {d.index: d for d in devices}
        missing = [i for i in asked.indices if i not in by_index]
        if missing:
            raise DeviceUnavailableError(
                f"{asked.shown} names {backend.name} device {', '.join(map(str, missing))}, which this process "
                f"does not see: its {backend.name} devices are {valid}{_variable_note(devices)}"
            )
        bad = [by_index[i] for i in asked.indices if by_index[i].unusable is not None]
        if bad:
            reasons = "; ".join(f"{backend.name}:{d.index}: {d.unusable}" for d in bad)
            raise DeviceUnavailableError(
                f"{asked.shown} names a device this process cannot use ({reasons}); the usable ones are "
                f"{', '.join(str(d.index) for d in usable) or 'none'}"
            )
        return sorted((by_index[i] for i in asked.indices), key=lambda d: d.index), ""
    wanted = len(usable) if asked.count is None else asked.count
    if wanted > len(usable):
        unusable = len(devices) - len(usable)
        raise DeviceUnavailableError(
            f"{asked.shown} asks for {wanted} {backend.name} devices, but this process sees {len(devices)} "
            f"({valid})" + (f", {unusable} of them unusable" if unusable else "") + f": give at most {len(usable)}"
        )
    ranked = sorted(usable, key=lambda d: (_busy(d, usable), d.index))
    chosen = sorted(ranked[:wanted], key=lambda d: d.index)
    passed = [d for d in usable if d not in chosen and d.index < max(c.index for c in chosen)]
    why = ""
    if passed:
        why = " (" + "; ".join(f"{backend.name}:{d.index} passed over: {_busy_text(d)}" for d in passed) + ")"
    return chosen, why


def _busy(info: DeviceInfo, usable: Sequence[DeviceInfo]) -> bool:
    idle = idle_indices(usable)
    return idle is not None and info.index not in idle


def _busy_text(info: DeviceInfo) -> str:
    total = format_bytes(info.total_memory) if info.total_memory is not None else "unknown"
    return f"{format_bytes(info.free_memory or 0)} free of {total}, another process uses it"


def _variable_note(devices: Sequence[DeviceInfo]) -> str:
    pids = [d.physical_id for d in devices]
    if any(p is not None and p != str(d.index) for p, d in zip(pids, devices, strict=True)):
        return f" (physical {', '.join(str(p) for p in pids)}, after the visible-devices variable)"
    return ""


def _applied(result: ProbeResult, asked: DevicesAsked) -> str | None:
    """The trace line when ``asked`` names the physical devices the visible-devices variable already
    shows: the launch command whichdevice wrote for it started this process."""
    vis = result.visible
    if asked.indices is None or vis is None or vis.ids is None:
        return None
    if list(vis.ids) != [str(i) for i in asked.indices] or result.device_count != len(asked.indices):
        return None
    return (
        f"{asked.shown} are the devices {vis.variable}={vis.raw!r} already shows (as the launch command sets "
        f"it): every device this process sees"
    )


def _narrowed(backend: Backend, result: ProbeResult, chosen: Sequence[DeviceInfo]) -> ProbeResult:
    """``result`` as if only ``chosen`` were visible, each under its index in this process."""
    old = result.visible
    variable = old.variable if old is not None and old.variable else backend.visible_devices_env[0]
    ids = tuple(d.physical_id or str(d.index) for d in chosen)
    return replace(
        result,
        devices=tuple(chosen),
        device_count=len(chosen),
        visible=Visibility(variable, ",".join(ids), ids, old.warnings if old is not None else ()),
    )


def _launched(
    backend: Backend,
    result: ProbeResult,
    asked: DevicesAsked | None,
    dist: DistributedContext,
    left_out: list[DeviceInfo],
) -> Selected:
    """In a launched run each rank takes its local rank's device: the launch selects the devices."""
    if asked is not None and not _applied(result, asked):
        every = asked.every or asked.count == result.device_count
        if not every:
            raise ConfigConflictError(
                f"{asked.shown} in a run {dist.launcher} started: each rank uses its local rank's device "
                f"({dist.local_rank_variable}), so the launch selects the devices; start the run with the "
                f"command res.launch_command(['train.py']) gives outside it, which sets "
                f"{backend.visible_devices_env[0]} before the launcher"
            )
    mine = next((d for d in result.devices if d.index == dist.local_rank), None)
    if mine is not None and mine.unusable is not None:
        usable = [d for d in result.devices if d.unusable is None]
        pids = ",".join(d.physical_id or str(d.index) for d in usable)
        variable = (result.visible.variable if result.visible else None) or backend.visible_devices_env[0]
        raise DeviceUnavailableError(
            f"{dist.local_rank_variable}={dist.local_rank}: {backend.name}:{mine.index} cannot be used by this "
            f"process ({mine.unusable}); launch one process per usable device: "
            f"env {variable}={pids} with --nproc-per-node={len(usable)}"
        )
    steps = [
        TraceStep("warning", f"{backend.name}:{d.index} cannot be used ({d.unusable}): the rank given it will fail")
        for d in left_out
    ]
    return (result, None), steps


def narrowed_training(backend: Backend, devices: tuple[int, ...] | None, probe: ProbeResult) -> str | None:
    """Why TrainingArguments built in this (unlaunched) process would not train on the devices a
    resolution chose (None: it would): Trainer trains on every GPU this process sees, from device 0."""
    if devices is None or probe.visible is None:
        return None
    vis = probe.visible
    command = f"env {vis.variable}={vis.raw} python train.py"
    launch = f"env {vis.variable}={vis.raw} torchrun --nproc-per-node={len(devices)} train.py"
    which = ", ".join(f"{backend.name}:{i}" for i in devices)
    return (
        f"this resolution trains on {which}, but Trainer in this process trains on every {backend.name} device it "
        f"sees, from {backend.name}:0, and {vis.variable} takes effect only when a process starts: start it with "
        f"`{command}` (one process), or launch `{launch}` (res.launch_command(['train.py']))"
    )
