"""What the NVIDIA driver stack says without starting CUDA: NVML, nvidia-smi and libcuda.

Readers only (the CUDA probe's I/O): the GPUs NVML or nvidia-smi list with the driver version, why
NVML could not be read, torch's own words when no driver library loads, and the kernel
architectures a torch build carries. None of them calls cuInit, so the process can still fork.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

from whichdevice.hardware.probes.common import DeviceReading

__all__ = ["ENV_VARIABLES", "NvidiaStack", "arch_list", "driver_error", "nvml_devices", "smi_devices"]

ENV_VARIABLES: tuple[str, ...] = ()


# The NVIDIA driver's CUDA library: when it does not load, there is no driver and nothing can start.
_DRIVER_LIBRARY = {"win32": "nvcuda.dll"}


def driver_error(torch: Any) -> str | None:
    """torch's own words for a missing NVIDIA driver (None: the driver library loads).

    Asked only when the library does not load, so starting CUDA cannot succeed, no context is made
    and forking stays safe.
    """
    try:
        ctypes.CDLL(_DRIVER_LIBRARY.get(sys.platform, "libcuda.so.1"))
        return None
    except OSError as exc:
        loading = str(exc)
    if not hasattr(torch._C, "_cuda_init"):
        return loading
    try:
        torch._C._cuda_init()  # torch raises "Found no NVIDIA driver on your system. ..."
    except Exception as exc:
        return str(exc).strip() or loading
    return loading


def arch_list(torch: Any) -> tuple[str, ...]:
    # torch.cuda.get_arch_list() answers [] while CUDA is unavailable; the flags it reads do not.
    try:
        flags = torch._C._cuda_getArchFlags()
    except Exception:
        return ()
    return tuple(str(flags).split()) if flags else ()


@dataclass(frozen=True)
class NvidiaStack:
    """What NVML or nvidia-smi listed: the GPUs, the driver version, and why it could not be read."""

    devices: tuple[DeviceReading, ...] = ()
    driver: str | None = None
    error: str | None = None


def nvml_devices() -> NvidiaStack:
    if find_spec("pynvml") is None:
        return NvidiaStack()
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # nvidia-ml-py without libnvidia-ml (no driver): fail soft, keep why
        return NvidiaStack(error=str(exc) or type(exc).__name__)
    try:
        driver = _decoded(pynvml.nvmlSystemGetDriverVersion())
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
        return NvidiaStack(tuple(out), driver)
    except Exception as exc:
        return NvidiaStack(error=str(exc) or type(exc).__name__)


def _decoded(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def smi_devices() -> NvidiaStack:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return NvidiaStack()
    try:
        out = subprocess.run(
            [
                smi,
                "--query-gpu=name,memory.total,compute_cap,uuid,driver_version,memory.free",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return NvidiaStack()
    devices = []
    driver = None
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        driver = parts[4] or driver
        try:
            major, minor = (int(x) for x in parts[2].split("."))
            memory = int(float(parts[1])) * 1024**2
        except ValueError:
            continue
        free = _mib(parts[5]) if len(parts) > 5 else None
        devices.append(DeviceReading(parts[0], memory, (major, minor), parts[3], free=free))
    return NvidiaStack(tuple(devices), driver)


def _mib(text: str) -> int | None:
    try:
        return int(float(text)) * 1024**2
    except ValueError:  # "[N/A]" on some boards
        return None
