"""Which backend and which device string: detection in the declared order, or the one asked for, checked.

Detection walks the registry's order (``prefer``/``exclude`` reorder it) and takes the first backend
whose probe says it is usable. A backend asked for by name is probed alone; when it cannot be used,
or its index is not visible, the error says why, what this machine has, and what to change.

Usable means the installed stack runs on it, not only that devices are present: a probe's
``incompatible`` (a GPU architecture the torch build has no kernels for, a driver older than the
build's CUDA, a plugin built for another torch; see hardware/compatibility.py) makes detection go
on to the next backend with the reason in the trace, and an explicit request fail naming the build
or driver to install, because the user's first kernel would fail anyway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import ConfigConflictError, DeviceError, DeviceUnavailableError
from whichdevice.core.records import Backend, ProbeResult, TraceStep
from whichdevice.device.choice import least_busy
from whichdevice.device.others import other_accelerators
from whichdevice.device.request import ENV_DEVICE, DeviceRequest, device_names, parse_device
from whichdevice.device.target import Target
from whichdevice.hardware import probing
from whichdevice.hardware.registry import backends, get_backend

if TYPE_CHECKING:
    from whichdevice.launch.context import DistributedContext

__all__ = ["candidates_after", "choose_backend", "describe", "detection_order", "device_string"]


# (the backend, its probe result), and the trace lines that say why
_Chosen = tuple[tuple[Backend, ProbeResult], list[TraceStep]]


def choose_backend(request: DeviceRequest, prefer: Any, exclude: Any) -> _Chosen:
    """The backend and its probe result: the one asked for, or the first usable in the order."""
    if request.detect:
        order, steps = detection_order(prefer, exclude)
        steps.append(
            TraceStep(
                "request",
                f"no device given and {ENV_DEVICE} unset: first available in the order "
                + ", ".join(b.name for b in order),
            )
        )
        chosen, found = _detect(order)
        return chosen, steps + found
    return _asked_for(request)


def candidates_after(chosen: Target, prefer: Any, exclude: Any) -> list[Target]:
    """The usable backends after ``chosen`` in the detection order, each a candidate target on its first
    device (a pre-quantized checkpoint's method may run on one of them)."""
    order = detection_order(prefer, exclude)[0]
    names = [b.name for b in order]
    later = order[names.index(chosen.name) + 1 :] if chosen.name in names else []
    found = ((backend, probing.probe(backend.name)) for backend in later)
    return [Target.of(backend, result) for backend, result in found if result.available]


def detection_order(prefer: Any, exclude: Any) -> tuple[list[Backend], list[TraceStep]]:
    """The registry's order with ``exclude`` removed and ``prefer`` moved to the front."""
    preferred = device_names(prefer, "prefer")
    excluded = set(device_names(exclude, "exclude"))
    order = [b for b in backends() if b.name not in excluded]
    steps = []
    if preferred:
        rank = {name: i for i, name in enumerate(preferred)}
        order.sort(key=lambda b: rank.get(b.name, len(rank)))
        steps.append(TraceStep("order", f"prefer={preferred} moves them to the front"))
    if excluded:
        steps.append(TraceStep("order", f"exclude={sorted(excluded)} removes them"))
    return order, steps


def _detect(order: list[Backend]) -> _Chosen:
    steps = []
    timed_out: list[str] = []
    for position, backend in enumerate(order):
        result = probing.probe(backend.name)
        if result.available and result.incompatible:
            steps.append(TraceStep(backend.name, f"not chosen: {'; '.join(result.incompatible)}", False))
            continue
        if result.available:
            steps.append(TraceStep(backend.name, f"chosen: {describe(backend, result)}", True))
            later = order[position + 1 :]
            # The accelerators after the chosen one are probed too (a second one is warned about); the
            # CPU, which shares the host, is not.
            steps += other_accelerators(
                backend, [(b, None if b.shared_device else probing.probe(b.name)) for b in later]
            )
            return (backend, result), steps
        steps.append(TraceStep(backend.name, f"not chosen: {result.reason}", False))
        if result.reason and "did not finish within" in result.reason:
            timed_out.append(backend.name)
    raise DeviceUnavailableError(_nothing_usable(order, timed_out))


def _nothing_usable(order: list[Backend], timed_out: list[str]) -> str:
    """Why detection found nothing, naming what would change that: the time limit, or exclude=."""
    if not order:  # prefer=/exclude= left nothing to try
        return "no usable device: exclude= leaves no backend to try; leave 'cpu' out of exclude= to fall back to it"
    message = f"no usable device: every backend in {', '.join(b.name for b in order)} is unavailable"
    if timed_out:
        limit = probing.probe_timeout()
        message += (
            f"; the probes of {', '.join(timed_out)} did not finish within the time limit of {limit:g} s "
            f"(WHICHDEVICE_PROBE_TIMEOUT): raise it (WHICHDEVICE_PROBE_TIMEOUT=60) or unset it for the default "
            f"of {probing.DEFAULT_TIMEOUT_S:g} s"
        )
    if "cpu" not in {b.name for b in order}:
        return message + "; leave 'cpu' out of exclude= to fall back to it"
    return message + ("" if timed_out else " (see the reasons in `whichdevice`)")


def _asked_for(request: DeviceRequest) -> _Chosen:
    backend = get_backend(request.name)
    result = probing.probe(request.name)
    asked, source = request.asked or request.name, request.source
    if not result.available:
        raise _unavailable(asked, backend, result, source)
    if result.incompatible:
        where = f"{source}={asked!r}" if source != "device" else f"device {asked!r}"
        fix = "" if source == "device" else f" Or fix or unset {source}."
        raise DeviceUnavailableError(
            f"{where} cannot run with the installed stack: {'; '.join(result.incompatible)}. "
            f"This machine can use: {_machine_has()}.{fix}"
        )
    if request.index is not None and request.index >= result.device_count:
        raise _index_error(asked, backend, result, request.index, source)
    steps = [
        TraceStep(other.name, f"not considered: {source} asked for {asked!r}", False)
        for other in backends()
        if other.name != request.name
    ]
    steps.append(TraceStep(request.name, f"chosen: {describe(backend, result)}", True))
    return (backend, result), steps


def describe(backend: Backend, result: ProbeResult) -> str:
    """ "NVIDIA GPU, 8 devices; NVIDIA H200": the hardware, its count and its device names."""
    names = sorted({d.name for d in result.devices if d.name})
    # The cuda row covers two vendors; the probe's variant says which one this is.
    what = (
        backend.hardware if backend.name != "cuda" else ("AMD GPU (ROCm)" if result.variant == "rocm" else "NVIDIA GPU")
    )
    detail = f"; {', '.join(names)}" if names else ""
    return f"{what}, {result.device_count} device{'s' if result.device_count != 1 else ''}{detail}"


def _machine_has() -> str:
    found = [
        f"{r.backend} ({r.device_count} device{'s' if r.device_count != 1 else ''})"
        for r in probing.probe_all()
        if r.available and not r.incompatible
    ]
    return ", ".join(found) or "nothing usable"


def _unavailable(asked: str, backend: Backend, result: ProbeResult, source: str) -> DeviceError:
    where = f"{source}={asked!r}" if source != "device" else f"device {asked!r}"
    fix = "" if source == "device" else f" Fix or unset {source}."
    setting = _visibility_error(backend, result)
    if setting is not None:
        # A visible-devices variable no runtime accepts is a wrong request (exit 2), not missing hardware.
        return DeviceError(f"{where} cannot be used: {setting}")
    reason = result.reason or f"{backend.name} is not available"
    vis = result.visible
    if vis is not None and vis.variable and vis.ids is not None and vis.variable not in reason:
        # The variable chose which devices this process sees: say so, or the user looks elsewhere.
        said = [w for w in result.warnings if vis.variable in w]
        reason += "; " + ("; ".join(said) if said else f"{vis.variable}={vis.raw!r} selects the visible devices")
        reason += f": fix or unset {vis.variable}"
    return DeviceUnavailableError(f"{where} is not usable here: {reason}. This machine has: {_machine_has()}.{fix}")


def _visibility_error(backend: Backend, result: ProbeResult) -> DeviceError | None:
    """The error of a malformed visible-devices variable when that is what stopped the probe."""
    if not result.installed or result.available or result.visible is not None:
        return None
    from whichdevice.hardware.visible import visibility_error

    return visibility_error(backend.name, variant=result.variant, reason=result.reason)


def _index_error(asked: str, backend: Backend, result: ProbeResult, index: int, source: str) -> DeviceError:
    count = result.device_count
    vis = result.visible
    valid = f"{backend.name}:0..{backend.name}:{count - 1}" if count > 1 else f"{backend.name}:0"
    because = ""
    if vis is not None and vis.variable:
        because = f" because {vis.variable}={vis.raw!r}"
    fix = f" Fix or unset {source}." if source != "device" else ""
    return DeviceUnavailableError(
        f"{source} {asked!r} asks for {backend.name} index {index}, but {count} "
        f"{'is' if count == 1 else 'are'} visible{because}; use {valid}"
        + (f" or change {vis.variable}" if because and vis is not None else "")
        + f".{fix}"
    )


def device_string(
    backend: Backend,
    result: ProbeResult,
    request: DeviceRequest,
    dist: DistributedContext | None,
    task: str = "inference",
) -> tuple[tuple[str, int | None, int], list[TraceStep]]:
    """The device string, its index (None: the backend's strings carry none) and how many devices this
    process uses.

    In a distributed run each process takes the device accelerate will give it: the device of its
    local rank; its current device on a backend without indices in its device strings (Gaudi,
    Trainium, TPU: accelerate uses ``torch.device("hpu", current_device())``, each process owning
    one device); ``ACCELERATE_TORCH_DEVICE`` as given when set (Ray Train sets it); and the one
    device every process shares on the CPU. Otherwise, with no index asked for, the device with the
    most free memory (:func:`whichdevice.device.choice.least_busy`; device 0 on a tie).
    """
    index = request.index
    if dist is not None and not backend.shared_device:
        if backend.distributed_backend is None:
            raise DeviceError(
                f"{dist.launcher} started {dist.world_size} processes, but {backend.name} has no "
                f"distributed backend ({backend.hardware} runs one process); run a single process or "
                "use device='cpu' (gloo)"
            )
        if index is not None:
            return (f"{backend.name}:{index}", index, 1), []
        return _rank_device(backend, result, dist)
    steps = _accelerate_device_differs(backend, dist)
    if backend.shared_device:
        return (backend.name, None, 1), steps
    if index and backend.one_device_a_process and task != "training":  # training: trainer_device_steps says it
        raise ConfigConflictError(_not_addressable(backend, result, index))
    if index is not None:
        return (f"{backend.name}:{index}", index, 1), steps
    if backend.indexed:
        chosen, why = least_busy(backend, result, task)
        return (f"{backend.name}:{chosen}", chosen, result.device_count), steps + why
    return (backend.name, None, result.device_count), steps


def _not_addressable(backend: Backend, result: ProbeResult, index: int) -> str:
    """Why '<name>:<index>' is refused where a process addresses one device, and the ways to run there."""
    import shlex  # an error's suggestion only

    physical = result.visible.physical_id(index) if result.visible is not None else str(index)
    variable = backend.visible_devices_env[0] if backend.visible_devices_env else None
    alone = (
        f", or start the program with that device alone visible: {shlex.quote(f'{variable}={physical}')} "
        f"python your_script.py (it is {backend.name!r} there)"
        if variable
        else ""
    )
    return (
        f"device '{backend.name}:{index}': each {backend.hardware} process uses one device, its current one, and "
        f"its device strings take no index (accelerate uses torch.device({backend.name!r}, current_device())); "
        f"pass device={backend.name!r} for this process's device{alone}, or run one process per device "
        f"(docs/backends/{backend.docs or backend.name}.md)"
    )


def _accelerate_device(dist: DistributedContext | None) -> tuple[str, int | None] | None:
    """ACCELERATE_TORCH_DEVICE as (backend name, index), read once here; None where unset, not seen by
    accelerate, or not a device string (then accelerate's own parse fails, and nothing is taken from it)."""
    given = dist.accelerate_device if dist is not None and dist.seen else None
    if given is None:
        return None
    try:
        return parse_device(given, "ACCELERATE_TORCH_DEVICE")
    except DeviceError:
        return None


def _rank_device(
    backend: Backend, result: ProbeResult, dist: DistributedContext
) -> tuple[tuple[str, int | None, int], list[TraceStep]]:
    if dist.local_rank >= result.device_count:
        vis = result.visible
        because = f" ({vis.variable}={vis.raw!r})" if vis is not None and vis.variable else ""
        raise DeviceUnavailableError(
            f"{dist.local_rank_variable}={dist.local_rank} but only {result.device_count} "
            f"{backend.name} device(s) are visible{because}; start at most "
            f"{result.device_count} processes per node (--nproc_per_node={result.device_count}) "
            "or make more devices visible"
        )
    given = _accelerate_device(dist)
    if given is not None and given[0] == backend.name:
        why = f"ACCELERATE_TORCH_DEVICE={dist.accelerate_device!r} ({dist.launcher}): the device accelerate will use"
        return (str(dist.accelerate_device), given[1], 1), [TraceStep("device", why)]
    if not backend.indexed:
        why = (
            f"{backend.name}: local rank {dist.local_rank} ({dist.local_rank_variable}) owns one device, "
            f"which is its current device; accelerate uses torch.device({backend.name!r}, current_device()) "
            "and device_map stays on it"
        )
        return (backend.name, None, 1), [TraceStep("device", why)]
    device = f"{backend.name}:{dist.local_rank}"
    why = f"{device}: local rank {dist.local_rank} ({dist.local_rank_variable}) picks its own device"
    return (device, dist.local_rank, 1), [TraceStep("device", why), *_accelerate_device_differs(backend, dist)]


def _accelerate_device_differs(backend: Backend, dist: DistributedContext | None) -> list[TraceStep]:
    """A warning when ACCELERATE_TORCH_DEVICE will put the Trainer on another kind of device."""
    given = _accelerate_device(dist)
    if given is None or given[0] == backend.name:
        return []
    said = dist.accelerate_device if dist is not None else None
    return [
        TraceStep(
            "warning",
            f"ACCELERATE_TORCH_DEVICE={said!r}: accelerate will train on {said}, not on {backend.name}; "
            f"pass device={given[0]!r} or unset ACCELERATE_TORCH_DEVICE",
        )
    ]
