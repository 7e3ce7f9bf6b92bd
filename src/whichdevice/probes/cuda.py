"""The CUDA probe (NVIDIA, and AMD through the ROCm build): counted without starting CUDA.

The count comes from ``torch.cuda`` with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` so no cuInit happens
and the process can still fork; names, memory and compute capability come from NVML or
``nvidia-smi``, matched to visible indices through the visible-devices variables.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib.util import find_spec
from typing import Any

from whichdevice.envhooks import scoped_env
from whichdevice.probes.common import (
    DeviceReading,
    RuntimeReadings,
    absent_warnings,
    finish,
    installed_versions,
    not_installed,
    physical_id,
    raise_import_error,
    read_env,
    unusable_reason,
)
from whichdevice.records import Backend, DeviceInfo, ProbeResult
from whichdevice.visible import Visibility, visible_devices

__all__ = [
    "ENV_VARIABLES",
    "CudaReadings",
    "cuda_order_warnings",
    "interpret_cuda",
    "listed",
    "probe_cuda",
    "read_cuda",
]

ENV_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")

# The builds of torch this probe tells apart (its result's ``variant``): NVIDIA's CUDA and AMD's ROCm.
VARIANTS = ("cuda", "rocm")


@dataclass(frozen=True)
class CudaReadings(RuntimeReadings):
    """``devices``: one per GPU torch counts, with properties only once CUDA is initialised.

    ``inventory``: every physical GPU as NVML or nvidia-smi lists it (None: neither answered);
    ``mig_uuids``: the MIG instances the machine has (None: not read, as the reader does today);
    ``earlier_visible``: other CUDA_VISIBLE_DEVICES values seen by earlier probes in this process.
    """

    torch_version: str = ""
    cuda_version: str | None = None
    hip_version: str | None = None
    initialized: bool = False
    inventory: tuple[DeviceReading, ...] | None = None
    mig_uuids: tuple[str, ...] | None = None
    earlier_visible: tuple[str | None, ...] = ()


_cuda_visible_seen: list[str | None] = []


def read_cuda(backend: Backend) -> CudaReadings:
    import torch

    build = CudaReadings(
        installed=False,
        versions=installed_versions(backend),
        torch_version=str(torch.__version__),
        cuda_version=_text(getattr(torch.version, "cuda", None)),
        hip_version=_text(getattr(torch.version, "hip", None)),
    )
    if not hasattr(torch._C, "_cuda_getDeviceCount"):
        return build
    env = read_env(ENV_VARIABLES)
    initialized = bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
    inventory = None
    if initialized:
        count = torch.cuda.device_count()
        available = count > 0
        devices = tuple(_properties(torch.cuda.get_device_properties(i), _mem_free(torch, i)) for i in range(count))
    else:
        # NVML-based counting does not call cuInit, so the process can still fork afterwards.
        with scoped_env(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
            available = bool(torch.cuda.is_available())
            count = torch.cuda.device_count() if available else 0
        devices = (DeviceReading(),) * count
        # Also when CUDA is unavailable: GPUs that NVML lists then point at the driver.
        inventory = tuple(_nvml_devices() or _smi_devices()) or None
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
    )


def _text(value: object) -> str | None:
    return str(value) if value else None


def _properties(p: Any, free: int | None) -> DeviceReading:
    return DeviceReading(p.name, int(p.total_memory), (p.major, p.minor), free=free)


def _mem_free(torch: Any, index: int) -> int | None:
    # CUDA is started already (this branch only runs then), so asking costs no new context.
    try:
        return int(torch.cuda.mem_get_info(index)[0])
    except Exception:
        return None


def interpret_cuda(backend: Backend, readings: CudaReadings) -> ProbeResult:
    if not readings.installed:
        return not_installed(
            backend,
            f"this torch ({readings.torch_version}) is a CPU-only build without CUDA or ROCm: "
            f"{backend.install_command}",
            versions=readings.versions,
        )
    raise_import_error(readings)
    variant = VARIANTS[1] if readings.hip_version else VARIANTS[0]
    vis = visible_devices("cuda", readings.env, variant=variant)
    inventory = readings.inventory
    warnings = absent_warnings(vis, lambda pid: listed(readings, pid)) if inventory else []
    devices = _cuda_devices(readings, vis, warnings)
    warnings += _initialised_warnings(readings, vis)
    warnings += cuda_order_warnings(vis, devices, readings.env.get("CUDA_DEVICE_ORDER"))
    versions = dict(readings.versions)
    runtime = readings.hip_version if variant == "rocm" else readings.cuda_version
    if runtime:
        versions[variant] = runtime
    present = len(inventory) if inventory else None
    return finish(
        backend,
        devices,
        visibility=vis,
        variant=variant,
        warnings=warnings,
        versions=versions,
        unavailable_reason=unusable_reason(backend, readings, vis, present),
    )


def _cuda_devices(readings: CudaReadings, vis: Visibility, warnings: list[str]) -> list[DeviceInfo]:
    count = len(readings.devices)
    if count <= 0:
        return []
    if readings.initialized:
        return [
            DeviceInfo(i, d.name, d.memory, d.capability, physical_id=physical_id(vis, i), free_memory=d.free)
            for i, d in enumerate(readings.devices)
        ]
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
        if info is None:
            out.append(DeviceInfo(i, physical_id=pid))
        else:
            out.append(DeviceInfo(i, info.name, info.memory, info.capability, physical_id=pid, free_memory=info.free))
    return out


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


def _nvml_devices() -> list[DeviceReading]:
    if find_spec("pynvml") is None:
        return []
    try:
        import pynvml

        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            # NVML's free memory counts every process's allocations, and reading it starts no context.
            memory = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append(
                DeviceReading(
                    name.decode() if isinstance(name, bytes) else name,
                    int(memory.total),
                    (int(major), int(minor)),
                    uuid.decode() if isinstance(uuid, bytes) else uuid,
                    free=int(memory.free),
                )
            )
        return out
    except Exception:
        return []


def _smi_devices() -> list[DeviceReading]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total,compute_cap,uuid,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    devices = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            major, minor = (int(x) for x in parts[2].split("."))
            memory = int(float(parts[1])) * 1024**2
        except ValueError:
            continue
        free = _mib(parts[4]) if len(parts) > 4 else None
        devices.append(DeviceReading(parts[0], memory, (major, minor), parts[3], free=free))
    return devices


def _mib(text: str) -> int | None:
    try:
        return int(float(text)) * 1024**2
    except ValueError:  # "[N/A]" on some boards
        return None


def probe_cuda(backend: Backend) -> ProbeResult:
    return interpret_cuda(backend, read_cuda(backend))
