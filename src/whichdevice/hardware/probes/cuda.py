"""The CUDA probe (NVIDIA, and AMD through the ROCm build): counted without starting CUDA.

The count comes from ``torch.cuda`` with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` so no cuInit happens
and the process can still fork; names, memory, compute capability and compute mode come from NVML
or ``nvidia-smi``, matched to visible indices through the visible-devices variables. A GPU this
process cannot use (exclusive-process mode held by another process, prohibited mode) stays listed
under its index, marked ``unusable`` with the reason (compute_mode.py); resolutions leave it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import whichdevice.hardware.probes.cuda_trial as cuda_trial
import whichdevice.hardware.probes.nvidia as nvidia
import whichdevice.hardware.probes.nvidia_platforms as platforms
from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import Backend, DeviceInfo, ProbeResult
from whichdevice.hardware.compatibility import arch_problem, driver_problem, min_driver
from whichdevice.hardware.envhooks import scoped_env
from whichdevice.hardware.probes.common import (
    absent_warnings,
    finish,
    installed_versions,
    not_installed,
    physical_id,
    raise_import_error,
    read_env,
    unusable_reason,
)
from whichdevice.hardware.probes.compute_mode import EXCLUSIVE_MODES, needs_trial
from whichdevice.hardware.probes.compute_mode import unusable_reason as unusable
from whichdevice.hardware.probes.presence import cpu_only_reason
from whichdevice.hardware.probes.readings import DeviceReading, RuntimeReadings
from whichdevice.hardware.visible import Visibility, visible_devices

__all__ = [
    "BUILDS",
    "ENV_VARIABLES",
    "CudaReadings",
    "cuda_order_warnings",
    "interpret_cuda",
    "listed",
    "probe_cuda",
    "read_cuda",
]

# The builds this probe reports as ``ProbeResult.variant``, as a person names them.
BUILDS = {"cuda": "CUDA", "rocm": "ROCm"}

ENV_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")

# The builds of torch this probe tells apart (its result's ``variant``): NVIDIA's CUDA and AMD's ROCm.
VARIANTS = ("cuda", "rocm")


@frozen_record
class CudaReadings(RuntimeReadings):
    """``devices``: one per GPU torch counts, with properties only once CUDA is initialised.

    ``inventory``: every physical GPU as NVML or nvidia-smi lists it (None: neither answered);
    ``mig_uuids``: the MIG instances the machine has (None: not read, as the reader does today);
    ``earlier_visible``: other CUDA_VISIBLE_DEVICES values seen by earlier probes in this process;
    ``driver_version``: the NVIDIA driver NVML or nvidia-smi reported; ``driver_error``: torch's own
    words when no NVIDIA driver could be loaded; ``nvml_error``: why nvidia-ml-py could not be read;
    ``arch_list``: the kernel architectures of the build (``torch.cuda.get_arch_list()``);
    ``machine``: the host architecture (``platform.machine()``); ``tegra``: the first line of Jetson
    Linux's release file, None where there is none (nvidia_platforms.py reads both).
    """

    torch_version: str = ""
    cuda_version: str | None = None
    hip_version: str | None = None
    initialized: bool = False
    inventory: tuple[DeviceReading, ...] | None = None
    mig_uuids: tuple[str, ...] | None = None
    earlier_visible: tuple[str | None, ...] = ()
    driver_version: str | None = None
    driver_error: str | None = None
    nvml_error: str | None = None
    arch_list: tuple[str, ...] = ()
    machine: str = ""
    tegra: str | None = None
    tool_skipped: tuple[str, ...] = ()  # rows nvidia-smi printed that its number parser refused


_cuda_visible_seen: list[str | None] = []


def read_cuda(backend: Backend) -> CudaReadings:
    import torch

    machine, tegra = platforms.read_host()
    build = CudaReadings(
        installed=False,
        versions=installed_versions(backend),
        torch_version=str(torch.__version__),
        cuda_version=_text(getattr(torch.version, "cuda", None)),
        hip_version=_text(getattr(torch.version, "hip", None)),
        machine=machine,
        tegra=tegra,
    )
    if not hasattr(torch._C, "_cuda_getDeviceCount"):
        if machine != platforms.ARM64 or tegra is not None:
            return build
        # A CPU-only torch on ARM64: the GPUs NVML lists say which machine this is, and so what to install.
        nvml = nvidia.nvml_devices()
        smi = nvidia.NvidiaStack() if nvml.devices else nvidia.smi_devices()
        return replace(build, inventory=tuple(nvml.devices or smi.devices) or None, tool_skipped=smi.skipped)
    env = read_env(ENV_VARIABLES)
    initialized = bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
    inventory = driver_error = None
    nvml = nvidia.NvidiaStack()
    if initialized:
        count = torch.cuda.device_count()
        available = count > 0
        devices = _initialised_devices(torch, count)
    else:
        # NVML-based counting does not call cuInit, so the process can still fork afterwards.
        with scoped_env(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
            available = bool(torch.cuda.is_available())
            count = torch.cuda.device_count() if available else 0
        devices = (DeviceReading(),) * count
        # Also when CUDA is unavailable: GPUs that NVML lists then point at the driver.
        nvml = nvidia.nvml_devices()
        smi = nvidia.NvidiaStack() if nvml.devices else nvidia.smi_devices()
        inventory = _tried(tuple(nvml.devices or smi.devices) or None, env, count, build.hip_version)
        nvml, build = replace(nvml, driver=nvml.driver or smi.driver), replace(build, tool_skipped=smi.skipped)
        if not available and build.cuda_version:
            driver_error = nvidia.driver_error(torch)
    current = env.get("CUDA_VISIBLE_DEVICES")
    earlier = tuple(v for v in _cuda_visible_seen if v != current)
    if current not in _cuda_visible_seen:  # distinct values only: refreshed probes must not grow it
        _cuda_visible_seen.append(current)
    return replace(
        build,
        installed=True,
        env=env,
        available=available,
        devices=devices,
        initialized=initialized,
        inventory=inventory,
        earlier_visible=earlier,
        driver_version=nvml.driver,
        driver_error=driver_error,
        nvml_error=nvml.error,
        arch_list=nvidia.arch_list(torch),
    )


def _text(value: object) -> str | None:
    return str(value) if value else None


def _tried(
    inventory: tuple[DeviceReading, ...] | None, env: dict[str, str], count: int, hip: str | None
) -> tuple[DeviceReading, ...] | None:
    """The inventory with a child process's trial context on each visible GPU that needs one."""
    if not inventory:
        return inventory
    vis = visible_devices("cuda", env, variant=VARIANTS[1] if hip else VARIANTS[0])
    wanted: dict[int, int] = {}  # visible index -> position in the inventory
    for index in range(count):
        found = _match_physical(inventory, physical_id(vis, index))
        if found is not None and needs_trial(found):
            wanted[index] = inventory.index(found)
    if not wanted:
        return inventory
    said = cuda_trial.try_contexts(sorted(wanted))
    out = list(inventory)
    for index, position in wanted.items():
        out[position] = replace(out[position], trial=said.get(index))
    return tuple(out)


def _initialised_devices(torch: Any, count: int) -> tuple[DeviceReading, ...]:
    """CUDA is started here already: properties and free memory through torch, and the compute mode
    from the driver, so that asking for free memory (which makes a context) never takes a GPU in an
    exclusive mode that this process does not hold yet; such a GPU is tried in a child instead."""
    modes = nvidia.driver_compute_modes(count)
    devices = []
    for i in range(count):
        own = _has_context(torch, i)
        reading = DeviceReading(compute_mode=modes[i], own_context=own)
        guarded = modes[i] == "prohibited" or (modes[i] in EXCLUSIVE_MODES and not own)
        props = torch.cuda.get_device_properties(i)
        free = None if guarded else _mem_free(torch, i)
        devices.append(replace(reading, **_properties(props, free)))
    tried = cuda_trial.try_contexts([i for i, d in enumerate(devices) if needs_trial(d)])
    return tuple(replace(d, trial=tried[i]) if i in tried else d for i, d in enumerate(devices))


def _has_context(torch: Any, index: int) -> bool:
    try:
        return bool(torch._C._cuda_hasPrimaryContext(index))
    except Exception:
        return False


def _properties(p: Any, free: int | None) -> dict[str, Any]:
    return {"name": p.name, "memory": int(p.total_memory), "capability": (p.major, p.minor), "free": free}


def _mem_free(torch: Any, index: int) -> int | None:
    # CUDA is started already (this branch only runs then), so asking costs no new context.
    try:
        return int(torch.cuda.mem_get_info(index)[0])
    except Exception:
        return None


def interpret_cuda(backend: Backend, readings: CudaReadings) -> ProbeResult:
    names = [d.name for d in (*readings.devices, *(readings.inventory or ()))]
    platform = platforms.nvidia_platform(readings.machine, readings.tegra, names)
    l4t = platforms.tegra_release(readings.tegra)
    if not readings.installed:
        install = platforms.install_line(platform, l4t) if platform else backend.install_command
        where = f"; for {platform.name}" if platform else ""
        result = not_installed(
            backend,
            cpu_only_reason(readings.torch_version, install, where),
            versions=readings.versions,
        )
        return replace(result, platform=platform.key if platform else None, warnings=readings.tool_skipped)
    raise_import_error(readings)
    variant = VARIANTS[1] if readings.hip_version else VARIANTS[0]
    vis = visible_devices("cuda", readings.env, variant=variant)
    inventory = readings.inventory
    warnings = [*readings.tool_skipped, *(absent_warnings(vis, lambda pid: listed(readings, pid)) if inventory else [])]
    devices = _cuda_devices(readings, vis, warnings)
    warnings += _initialised_warnings(readings, vis)
    warnings += cuda_order_warnings(vis, devices, readings.env.get("CUDA_DEVICE_ORDER"))
    if readings.nvml_error:
        warnings.append(
            f"NVML (nvidia-ml-py) could not be read: {readings.nvml_error}; GPU names, memory and the "
            "driver version come from nvidia-smi where it runs, and stay unknown otherwise"
        )
    versions = dict(readings.versions)
    runtime = readings.hip_version if variant == "rocm" else readings.cuda_version
    if runtime:
        versions[variant] = runtime
    if readings.driver_version:
        versions["nvidia-driver"] = readings.driver_version
    if l4t is not None:
        versions["jetson-linux"] = l4t
    present = len(inventory) if inventory else None
    reason = (
        unusable_reason(backend, readings, vis, present)
        or _no_gpu_reason(readings, variant, devices, vis)
        or _all_unusable(devices)
    )
    result = finish(
        backend,
        devices,
        visibility=vis,
        variant=variant,
        warnings=warnings,
        features=frozenset(readings.arch_list) if variant == "cuda" else frozenset(),
        versions=versions,
        unavailable_reason=reason,
        incompatible=_incompatible(readings, variant, devices),
    )
    return replace(result, platform=platform.key if platform and variant == "cuda" else None)


def _build(readings: CudaReadings, variant: str) -> str:
    runtime = readings.hip_version if variant == "rocm" else readings.cuda_version
    return f"torch {readings.torch_version} is a {BUILDS[variant]} {runtime} build"


def _no_gpu_reason(readings: CudaReadings, variant: str, devices: Sequence[DeviceInfo], vis: Visibility) -> str | None:
    """Why an installed CUDA or ROCm build shows no GPU: no driver (torch's words), or none here."""
    if readings.driver_error:
        needed = min_driver(readings.cuda_version)
        return (
            f"{_build(readings, variant)}, but this machine has no NVIDIA driver (torch: "
            f"{readings.driver_error!r}): install the NVIDIA driver{f' ({needed} or newer)' if needed else ''}, "
            "or run on a GPU node (a container needs --gpus all)"
        )
    if devices or (vis.ids is not None and not vis.ids):
        return None  # devices, or a visible-devices variable that hides them all: finish says which
    gpu = "AMD GPU" if variant == "rocm" else "NVIDIA GPU"
    if vis.ids is not None:
        return f"{_build(readings, variant)} and finds no {gpu} among the visible devices"
    return f"{_build(readings, variant)} and finds no {gpu}: run on a machine (or container) that has one"


def _incompatible(readings: CudaReadings, variant: str, devices: Sequence[DeviceInfo]) -> tuple[str, ...]:
    if variant != "cuda":
        return ()
    capabilities = [d.capability for d in devices if d.capability] or [
        d.capability for d in readings.inventory or () if d.capability
    ]
    found = (
        arch_problem(capabilities, readings.arch_list, readings.cuda_version),
        driver_problem(readings.driver_version, readings.cuda_version),
    )
    return tuple(f for f in found if f)


def _cuda_devices(readings: CudaReadings, vis: Visibility, warnings: list[str]) -> list[DeviceInfo]:
    count = len(readings.devices)
    if count <= 0:
        return []
    if readings.initialized:
        return [_info(i, d, physical_id(vis, i)) for i, d in enumerate(readings.devices)]
    if not readings.inventory:
        warnings.append(
            "GPU model and compute capability are unknown without initialising CUDA; "
            "pip install nvidia-ml-py lets whichdevice read them through NVML"
        )
        return [DeviceInfo(i) for i in range(count)]
    out = []
    for i in range(count):
        pid = physical_id(vis, i)
        info = _match_physical(readings.inventory, pid)
        out.append(DeviceInfo(i, physical_id=pid) if info is None else _info(i, info, pid))
    return out


def _info(index: int, reading: DeviceReading, pid: str) -> DeviceInfo:
    return DeviceInfo(
        index,
        reading.name,
        reading.memory,
        reading.capability,
        physical_id=pid,
        free_memory=reading.free,
        compute_mode=reading.compute_mode,
        other_processes=reading.other_processes,
        unusable=unusable(reading),
    )


def _all_unusable(devices: Sequence[DeviceInfo]) -> str | None:
    """Why the backend is unavailable when every visible GPU is unusable here (None: one is usable)."""
    if not devices or any(d.unusable is None for d in devices):
        return None
    each = "; ".join(f"cuda:{d.index} ({d.physical_id}): {d.unusable}" for d in devices)
    return f"every visible GPU is unusable by this process: {each}"


def _initialised_warnings(readings: CudaReadings, vis: Visibility) -> list[str]:
    # CUDA_VISIBLE_DEVICES is read once, when CUDA starts: a later change does nothing in this process.
    if not readings.initialized:
        return []
    count = len(readings.devices)
    expected = vis.count(None)
    if (expected is not None and expected != count) or readings.earlier_visible:
        current = readings.env.get("CUDA_VISIBLE_DEVICES")
        return [
            f"CUDA_VISIBLE_DEVICES is now {current!r} but CUDA was already initialised in this "
            f"process with {count} GPU(s); the change takes effect only in a new process"
        ]
    return []


def cuda_order_warnings(vis: Visibility, devices: Sequence[DeviceInfo], order: str | None) -> list[str]:
    """CUDA numbers GPUs fastest first, nvidia-smi by PCI bus: mixed models make indices differ."""
    if (
        vis.variable == "CUDA_VISIBLE_DEVICES"
        and order != "PCI_BUS_ID"
        and len({d.name for d in devices if d.name}) > 1
    ):
        return [
            "CUDA_VISIBLE_DEVICES is set but CUDA_DEVICE_ORDER is not PCI_BUS_ID and the GPUs are "
            "different models: CUDA numbers them fastest first, nvidia-smi by PCI bus, so the "
            "indices may not be the GPUs you meant; export CUDA_DEVICE_ORDER=PCI_BUS_ID"
        ]
    return []


def listed(readings: CudaReadings, pid: str) -> bool:
    """Whether the machine's lists show the GPU ``pid`` names (True where they cannot tell)."""
    if pid.startswith("MIG-"):
        mig = readings.mig_uuids
        return mig is None or any(m.startswith(pid) or pid.startswith(m) for m in mig)
    inventory = readings.inventory or ()
    if not pid.isdigit() and not any(d.uuid for d in inventory):
        return True
    return _match_physical(inventory, pid) is not None


def _match_physical(physical: Sequence[DeviceReading] | None, pid: str) -> DeviceReading | None:
    if not physical:
        return None
    if pid.isdigit():
        index = int(pid)
        return physical[index] if index < len(physical) else None
    for dev in physical:
        if dev.uuid and (dev.uuid.startswith(pid) or pid.startswith(dev.uuid)):
            return dev
    return None


def probe_cuda(backend: Backend) -> ProbeResult:
    return interpret_cuda(backend, read_cuda(backend))
