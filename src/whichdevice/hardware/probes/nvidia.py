"""What the NVIDIA driver stack says without starting CUDA: NVML, nvidia-smi and libcuda.

Readers only (the CUDA probe's I/O): the GPUs NVML or nvidia-smi list with the driver version, each
GPU's compute mode and the processes that hold it, why NVML could not be read, torch's own words
when no driver library loads, and the kernel architectures a torch build carries. None of them
calls cuInit, so the process can still fork; :func:`driver_compute_modes` asks the driver only
after the user's own CUDA init (torch's device properties carry no compute mode).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from importlib.util import find_spec
from typing import Any

from whichdevice.core.frozen import frozen_record
from whichdevice.core.numbers import parse_tool_number
from whichdevice.hardware.probes.readings import DeviceReading

__all__ = [
    "COMPUTE_MODES",
    "ENV_VARIABLES",
    "NvidiaStack",
    "arch_list",
    "driver_compute_modes",
    "driver_error",
    "nvml_devices",
    "smi_devices",
]

ENV_VARIABLES: tuple[str, ...] = ()

# The compute modes by the number NVML and the driver give them: nvml.h's nvmlComputeMode_t
# (pynvml's NVML_COMPUTEMODE_DEFAULT 0, _EXCLUSIVE_THREAD 1, _PROHIBITED 2, _EXCLUSIVE_PROCESS 3) and
# cuda.h's CUcomputemode, which keeps the same numbers (1, the exclusive-thread mode, is gone from
# current drivers). The names are NVML's, lower-cased; nvidia-smi prints them capitalised.
COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
# cuda.h: CU_DEVICE_ATTRIBUTE_COMPUTE_MODE in CUdevice_attribute.
_CU_DEVICE_ATTRIBUTE_COMPUTE_MODE = 20


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


@frozen_record
class NvidiaStack:
    """What NVML or nvidia-smi listed: the GPUs, the driver version, and why it could not be read."""

    devices: tuple[DeviceReading, ...] = ()
    driver: str | None = None
    error: str | None = None
    # Rows nvidia-smi printed that were refused (a memory of "inf", ...), each said as a warning.
    skipped: tuple[str, ...] = ()


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
            pids = _nvml_pids(pynvml, h)
            out.append(
                DeviceReading(
                    name.decode() if isinstance(name, bytes) else name,
                    int(memory.total),
                    (int(major), int(minor)),
                    uuid.decode() if isinstance(uuid, bytes) else uuid,
                    free=int(memory.free),
                    compute_mode=_nvml_mode(pynvml, h),
                    other_processes=None if pids is None else sum(1 for p in pids if p != os.getpid()),
                    own_context=pids is not None and os.getpid() in pids,
                )
            )
        return NvidiaStack(tuple(out), driver)
    except Exception as exc:
        return NvidiaStack(error=str(exc) or type(exc).__name__)


def _nvml_mode(pynvml: Any, handle: Any) -> str | None:
    try:
        return COMPUTE_MODES.get(int(pynvml.nvmlDeviceGetComputeMode(handle)))
    except Exception:  # NVML_ERROR_NOT_SUPPORTED on some boards: the mode stays unknown
        return None


def _nvml_pids(pynvml: Any, handle: Any) -> list[int] | None:
    """The processes with a compute context on the GPU (None: NVML would not say). In a container
    without the host's process namespace the list can be empty while another process holds the GPU,
    which is why an exclusive-process GPU is also tried (cuda_trial.py)."""
    try:
        return [int(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
    except Exception:
        return None


def driver_compute_modes(count: int) -> tuple[str | None, ...]:
    """The compute mode of each of ``count`` visible GPUs, asked of the driver library
    (cuDeviceGetAttribute). Only after CUDA is initialised in this process: it needs cuInit done,
    and it makes no context, so an exclusive-process GPU is not taken by asking."""
    try:
        lib = ctypes.CDLL(_DRIVER_LIBRARY.get(sys.platform, "libcuda.so.1"))
    except OSError:
        return (None,) * count
    modes: list[str | None] = []
    for index in range(count):
        device, value = ctypes.c_int(), ctypes.c_int()
        try:
            ok = lib.cuDeviceGet(ctypes.byref(device), index) == 0 and (
                lib.cuDeviceGetAttribute(ctypes.byref(value), _CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, device) == 0
            )
        except (AttributeError, OSError):
            ok = False
        modes.append(COMPUTE_MODES.get(value.value) if ok else None)
    return tuple(modes)


def _decoded(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _smi(smi: str, query: str) -> str | None:
    """What ``nvidia-smi <query> --format=csv,noheader,nounits`` prints (None: it failed)."""
    try:
        return subprocess.run(
            [smi, query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def smi_devices() -> NvidiaStack:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return NvidiaStack()
    out = _smi(smi, "--query-gpu=name,memory.total,compute_cap,uuid,driver_version,memory.free,compute_mode")
    if out is None:
        return NvidiaStack()
    devices = []
    driver = None
    skipped: list[str] = []
    holders = _smi_processes(smi)
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        driver = parts[4] or driver
        # Every number through parse_tool_number: "inf" or "nan" is refused there, never an OverflowError.
        read = [parse_tool_number("memory.total", parts[1])]
        read += [parse_tool_number("compute_cap", x, maximum=99) for x in parts[2].split(".", 1)]
        problem = next((r.problem for r in read if r.problem), None)
        if problem is not None or len(read) != 3:
            skipped.append(f"nvidia-smi printed a row whichdevice skipped ({problem or 'compute_cap ' + parts[2]!r})")
            continue
        memory, major, minor = (r.value or 0 for r in read)
        free = _mib(parts[5]) if len(parts) > 5 else None
        # nvidia-smi prints NVML's names capitalised ("Exclusive_Process").
        mode = parts[6].lower() if len(parts) > 6 and parts[6].lower() in COMPUTE_MODES.values() else None
        pids = holders.get(parts[3]) if holders is not None else None
        others = None if holders is None else sum(1 for p in pids or () if p != os.getpid())
        own = bool(pids) and os.getpid() in (pids or ())
        devices.append(
            DeviceReading(
                parts[0], memory * 1024**2, (major, minor), parts[3], free=free, compute_mode=mode,
                other_processes=others, own_context=own,
            )
        )  # fmt: skip
    return NvidiaStack(tuple(devices), driver, skipped=tuple(skipped))


def _smi_processes(smi: str) -> dict[str, list[int]] | None:
    """GPU UUID -> the pids with a compute context there (None: nvidia-smi would not say)."""
    out = _smi(smi, "--query-compute-apps=gpu_uuid,pid")
    if out is None:
        return None
    holders: dict[str, list[int]] = {}
    for line in out.strip().splitlines():
        uuid, _, pid = (p.strip() for p in line.partition(","))
        number = parse_tool_number("pid", pid, maximum=1 << 22)  # Linux's pid_max is at most 2**22
        if number.value is not None:
            holders.setdefault(uuid, []).append(number.value)
    return holders


def _mib(text: str) -> int | None:
    # None for "[N/A]" (some boards), and for whatever parse_tool_number refuses (inf, nan, negatives).
    value = parse_tool_number("memory.free", text).value
    return None if value is None else value * 1024**2
