"""What every probe shares: the helpers of its readers and the two ways a result ends.

A reader fills a :class:`RuntimeReadings` (or a subclass of it; defined in
:mod:`whichdevice.hardware.probes.readings`, and read here as before) with what the runtime said; an
interpreter turns it into a :class:`ProbeResult` through :func:`finish` or :func:`not_installed`.
The readers' helpers (:func:`read_env`, :func:`installed_versions`, :func:`read_module_devices`) do
I/O; everything else here is pure, except that ``finish`` and ``not_installed`` read the installed
versions when the caller passes none (third-party probes call them that way).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from whichdevice.core.packages import package_version
from whichdevice.core.records import Backend, DeviceInfo, ProbeResult, Visibility

# typing costs several ms to import; mypy and ruff treat a module-level TYPE_CHECKING = False the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from whichdevice.hardware.probes.readings import DeviceReading, RuntimeReadings

__all__ = [
    "ENV_VARIABLES",
    "NOT_SIMULATED",
    "DeviceReading",
    "RuntimeReadings",
    "absent_reason",
    "absent_warnings",
    "finish",
    "finish_runtime",
    "import_failure",
    "index_present",
    "installed_versions",
    "module_devices",
    "not_installed",
    "physical_id",
    "plugin_incompatible",
    "raise_import_error",
    "read_env",
    "read_module_devices",
    "simulated_absent_reason",
    "toolkit_note",
    "unusable_reason",
]

# Read by no backend in particular; each backend module declares its own.
ENV_VARIABLES: tuple[str, ...] = ()


def __getattr__(name: str) -> Any:
    # The readings records live in probes/readings.py, built only by a probe that reads a runtime;
    # ``common.DeviceReading`` (what third-party probes import) still names them.
    if name in ("DeviceReading", "RuntimeReadings"):
        from whichdevice.hardware.probes.readings import DeviceReading, RuntimeReadings

        return {"DeviceReading": DeviceReading, "RuntimeReadings": RuntimeReadings}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def read_env(names: Iterable[str]) -> dict[str, str]:
    """The variables among ``names`` that are set, as a plain dict (the readers' only env access)."""
    return {name: os.environ[name] for name in dict.fromkeys(names) if name in os.environ}


def installed_versions(backend: Backend) -> dict[str, str]:
    """Installed versions of torch and ``backend``'s package (those that are installed)."""
    out = {}
    for dist in dict.fromkeys(("torch", backend.package)):
        v = package_version(dist)
        if v:
            out[dist] = v
    return out


def import_failure(exc: BaseException) -> str:
    """The text a reader keeps of a failed import (the type too, unless it is an ImportError)."""
    return str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"


def raise_import_error(readings: RuntimeReadings, backend: Backend | None = None) -> None:
    """Re-raise a failed import so probing reports the package as installed but broken.

    With ``backend``, a plugin built for another torch says so: that is the likeliest cause.
    """
    if readings.import_error is None:
        return
    # A hook's variable stays set (the user may retry after fixing the install); say so.
    done = "; ".join(a.message for a in readings.env_set if a.action == "set")
    mismatch = plugin_incompatible(backend, readings) if backend is not None else ()
    note = toolkit_note(backend.name, readings.import_error) if backend is not None else None
    cause = "".join(f"; {m}" for m in (*mismatch, *([note] if note else [])))
    raise ImportError(readings.import_error + (f" (whichdevice had {done})" if done else "") + cause)


# Shared libraries a plugin loads from its vendor's toolkit, which pip does not install.
TOOLKITS: dict[str, tuple[tuple[str, ...], str]] = {
    "npu": (
        ("libhccl", "libascend", "libacl", "libge_", "libgraph", "libruntime", "libc_sec", "libmmpa", "libopapi"),
        "the CANN toolkit (Ascend's runtime libraries; not on PyPI): install CANN, then "
        "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` so its libraries are on the library path",
    ),
}


def toolkit_note(backend_name: str, failure: str) -> str | None:
    """Which vendor toolkit a failed import is missing, when the failure names one of its libraries."""
    prefixes, toolkit = TOOLKITS.get(backend_name, ((), ""))
    for word in failure.replace("'", " ").replace(":", " ").split():
        if word.startswith(prefixes) and ".so" in word:
            return f"{word} comes with {toolkit}"
    return None


def plugin_incompatible(backend: Backend, readings: RuntimeReadings) -> tuple[str, ...]:
    """A plugin package built for another torch than the installed one (empty: it fits, or unknown)."""
    if backend.package == "torch":
        return ()
    from whichdevice.hardware.compatibility import plugin_problem  # read only where a plugin is installed

    v = readings.versions
    found = plugin_problem(backend.package, v.get(backend.package), v.get("torch"), readings.requires_torch)
    return (found,) if found else ()


NOT_SIMULATED = "not present on the simulated machine"


def absent_reason(backend: Backend) -> str:
    """The reason of a backend whose package is not installed (hardware/absent.py folds such backends)."""
    return f"{backend.package} is not installed: {backend.install_command}"


def simulated_absent_reason(backend: Backend) -> str:
    """The reason of a backend a simulation does not have."""
    return f"{NOT_SIMULATED} ({backend.install_command})"


def not_installed(
    backend: Backend,
    why: str | None = None,
    *,
    simulated: bool = False,
    versions: Mapping[str, str] | None = None,
) -> ProbeResult:
    """The result for a backend whose package (or torch build) is not here, naming the install."""
    reason = why or absent_reason(backend)
    return ProbeResult(
        backend.name,
        installed=False,
        available=False,
        versions=dict(versions) if versions is not None else installed_versions(backend),
        reason=reason,
        simulated=simulated,
    )


def finish(
    backend: Backend,
    devices: Sequence[DeviceInfo],
    *,
    visibility: Visibility | None = None,
    variant: str | None = None,
    warnings: Sequence[str] = (),
    env_set: Sequence[Any] = (),
    features: frozenset[str] = frozenset(),
    os_version: str | None = None,
    versions: Mapping[str, str] | None = None,
    unavailable_reason: str | None = None,
    simulated: bool = False,
    incompatible: Sequence[str] = (),
) -> ProbeResult:
    """Build the result for an installed backend from its visible devices."""
    vis = visibility if visibility is not None else Visibility()
    if unavailable_reason is not None:
        devices = ()  # an unusable backend lists no devices, matching device_count == 0
    devices = tuple(
        d
        if d.physical_id is not None or vis.ids is None or d.index >= len(vis.ids)
        else replace(d, physical_id=vis.physical_id(d.index))
        for d in devices
    )
    all_warnings = list(vis.warnings) + list(warnings)
    reason = unavailable_reason
    if not devices and reason is None:
        if vis.ids is not None and not vis.ids:
            reason = (
                f"{vis.variable}={vis.raw!r} hides every {backend.name} device; "
                f"unset it (unset {vis.variable}) or list the devices to use"
            )
        else:
            reason = f"{backend.package} is installed but finds no {backend.hardware} device"
    return ProbeResult(
        backend.name,
        installed=True,
        available=bool(devices) and unavailable_reason is None,
        device_count=len(devices),
        devices=devices,
        versions=dict(versions) if versions is not None else installed_versions(backend),
        variant=variant,
        reason=reason,
        warnings=tuple(dict.fromkeys(all_warnings)),
        env_set=tuple(env_set),
        features=features,
        os_version=os_version,
        visible=vis,
        simulated=simulated,
        incompatible=tuple(incompatible),
    )


def physical_id(vis: Visibility, index: int) -> str:
    """The physical device behind visible ``index`` (the index itself past the variable's list)."""
    return vis.physical_id(index) if vis.ids is not None and index < len(vis.ids) else str(index)


def module_devices(devices: Sequence[DeviceReading], vis: Visibility) -> list[DeviceInfo]:
    """One :class:`DeviceInfo` per device a torch device module showed, with its physical id."""
    return [
        DeviceInfo(i, d.name, d.memory, d.capability, physical_id=physical_id(vis, i), bf16=d.bf16, free_memory=d.free)
        for i, d in enumerate(devices)
    ]


def index_present(count: int) -> Callable[[str], bool]:
    """Whether a visible-devices entry ("3", or "0.1" for device 0's tile 1) is among ``count`` devices."""
    ids = {str(k) for k in range(count)}
    return lambda entry: entry.split(".")[0] in ids


def absent_warnings(vis: Visibility, present: Callable[[str], bool]) -> list[str]:
    """A visible-devices variable that names devices the machine lacks (the runtime drops them)."""
    if vis.ids is None:
        return []
    missing = [i for i in vis.ids if not present(i)]
    if not missing:
        return []
    return [f"{vis.variable}={vis.raw!r} names device(s) {', '.join(missing)} that this machine lacks"]


def unusable_reason(backend: Backend, readings: RuntimeReadings, vis: Visibility, present: int | None) -> str | None:
    """Devices are there but the runtime says it cannot use any: a driver problem, not an absence."""
    if readings.available or not present or vis.ids is not None:
        return None
    return (
        f"{backend.package} is installed and {present} {backend.name} device(s) are present, but its "
        f"runtime reports none usable; check the driver (is it older than this {backend.package} needs?)"
    )


def finish_runtime(
    backend: Backend,
    readings: RuntimeReadings,
    vis: Visibility,
    devices: Sequence[DeviceInfo],
    warnings: Sequence[str] = (),
) -> ProbeResult:
    """``finish`` for a runtime reading: devices the machine lacks, hooks that kept a user's value."""
    present = readings.physical_count
    notes = absent_warnings(vis, index_present(present)) if present is not None else []
    notes += warnings
    notes += [a.message for a in readings.env_set if a.action == "kept"]
    return finish(
        backend,
        devices,
        visibility=vis,
        warnings=notes,
        env_set=readings.env_set,
        versions=readings.versions,
        unavailable_reason=unusable_reason(backend, readings, vis, present),
        incompatible=plugin_incompatible(backend, readings),
    )


def read_module_devices(module: Any, count: int) -> tuple[DeviceReading, ...]:
    """Names, memory, free memory and bf16 from a torch device module (torch.npu, torch.xpu, ...),
    where it has them (the module's runtime is started by its properties query already, so its
    ``mem_get_info`` costs nothing more)."""
    from whichdevice.hardware.probes.readings import DeviceReading

    bf16 = None
    if hasattr(module, "is_bf16_supported"):
        try:
            bf16 = bool(module.is_bf16_supported())
        except Exception:
            bf16 = None
    out = []
    for i in range(count):
        name = memory = None
        try:
            props = module.get_device_properties(i)
            name = getattr(props, "name", None)
            memory = getattr(props, "total_memory", None)
        except Exception:
            try:
                name = module.get_device_name(i)
            except Exception:
                name = None
        out.append(DeviceReading(name, int(memory) if memory else None, bf16=bf16, free=_free(module, i)))
    return tuple(out)


def _free(module: Any, index: int) -> int | None:
    try:
        free, _total = module.mem_get_info(index)
        return int(free)
    except Exception:
        return None
