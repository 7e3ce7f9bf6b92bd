"""Raw readings for simulated hardware: what each runtime would report for a spec.

These builders stand in for the probes' ``read_<x>`` functions and nothing else; the readings go
through the same ``interpret_<x>`` as a real machine's. What they model is the runtime (how many
devices a visible-devices variable leaves, what a missing or broken package looks like), never a
rule of whichdevice's: a detail the spec leaves out gets a plausible raw value (the device name a
Gaudi 2 reports, macOS 14.5), and the interpretation derives the rest from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from itertools import takewhile
from typing import Any

from packaging.version import InvalidVersion, Version

from whichdevice.core.packages import package_version
from whichdevice.core.records import Backend
from whichdevice.hardware.envhooks import apply_env_defaults
from whichdevice.hardware.probes import cuda, hpu, tpu, vendor, xpu
from whichdevice.hardware.probes.common import index_present, read_env
from whichdevice.hardware.probes.compute_mode import needs_trial
from whichdevice.hardware.probes.cpu import ONEDNN_ISA_VARIABLE, CpuReadings, read_cpu
from whichdevice.hardware.probes.cuda import CudaReadings
from whichdevice.hardware.probes.hpu import HpuReadings, accelerate_block
from whichdevice.hardware.probes.mps import MpsReadings
from whichdevice.hardware.probes.readings import DeviceReading, RuntimeReadings
from whichdevice.hardware.probes.tpu import TpuReadings
from whichdevice.hardware.probes.vendor import VendorReadings
from whichdevice.hardware.probes.xpu import XpuReadings
from whichdevice.hardware.registry import get_backend
from whichdevice.hardware.visible import visible_devices
from whichdevice.testing.gpus import known_model
from whichdevice.testing.spec import SimulatedDevice, family, gpu_details, parse_spec

__all__ = ["BUSY_GPU_TEXT", "DEFAULTS", "RUNTIME_TEXTS", "simulated_readings"]

_GiB = 1024**3

# Plausible details per backend, so a bare "hpu:8" resolves like a real Gaudi 2 server.
DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {"name": "NVIDIA A100-SXM4-80GB", "mem": 80 * _GiB, "cc": (8, 0)},
    "rocm": {"name": "AMD Instinct MI300X", "mem": 192 * _GiB, "cc": (9, 4)},
    "hpu": {"name": "GAUDI2", "mem": 96 * _GiB},
    "npu": {"name": "Ascend910B2", "mem": 64 * _GiB, "bf16": True},
    "neuron": {"name": "Trainium2", "mem": 96 * _GiB},
    "tpu": {"name": "TPU v5e", "mem": 16 * _GiB},
    "xpu": {"name": "Intel(R) Data Center GPU Max 1550", "mem": 128 * _GiB, "bf16": True},
    "mps": {"name": "Apple M2", "mem": 16 * _GiB, "macos": "14.5"},
    "mlu": {"name": "MLU370-X8", "mem": 48 * _GiB, "bf16": True},
    "musa": {"name": "MTT S4000", "mem": 48 * _GiB, "bf16": True},
}

# The host of a simulated GPU whose model does not fix one (testing.gpus: Grace and Jetson modules do).
DEFAULT_HOST = "x86_64"
# The first line of /etc/nv_tegra_release on a Jetson with JetPack 6.2 (Jetson Linux 36.4.3).
TEGRA_RELEASE = "# R36 (release), REVISION: 4.3, GCID: simulated, BOARD: generic, EABI: aarch64, DATE: simulated"

BROKEN_IMPORT = "simulated: importing {module} failed (libascend_hal.so: cannot open shared object file)"

# What the real runtimes print in the same situations, recorded from them on a machine without the
# hardware (tests/hardware/test_vendor_stacks.py checks each against the real runtime, `nox -s vendor-stacks`).
RUNTIME_TEXTS = {
    # torch 2.14.1+cu130 (torch._C._cuda_init()) without libcuda.so.1
    "cuda-no-driver": (
        "Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed "
        "a driver from http://www.nvidia.com/Download/index.aspx"
    ),
    # nvidia-ml-py 13.615.71 (pynvml.nvmlInit()) without libnvidia-ml.so.1
    "nvml-no-library": "NVML Shared Library Not Found",
    # torch_npu 2.13.0 (import torch_npu) without the CANN toolkit
    "npu-no-cann": "libhccl.so: cannot open shared object file: No such file or directory",
    # torch-neuronx 1.0, the placeholder on PyPI (import torch_neuronx)
    "neuron-placeholder": (
        "WRONG PACKAGE. Please install the package from Neuron Repository - pip.repos.neuron.amazonaws.com"
    ),
}

# What torch says when a context cannot be made on an exclusive-process GPU another process holds:
# its "CUDA error: " and the CUDA runtime's string for cudaErrorDevicesUnavailable (46), the first
# line the trial child keeps (hardware/probes/cuda_trial.py). Not recorded from a real GPU here.
BUSY_GPU_TEXT = "RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable"

# The import failure of a simulated broken package, where the real runtime's is recorded.
_BROKEN_TEXTS = {"npu": RUNTIME_TEXTS["npu-no-cann"], "neuron": RUNTIME_TEXTS["neuron-placeholder"]}

Readings = CpuReadings | RuntimeReadings


def simulated_readings(spec: str | SimulatedDevice, packages: Mapping[str, str | None] | None = None) -> Readings:
    """The raw readings ``simulate(spec)`` hands to the interpretation of ``spec``'s backend.

    Inside a simulation this is what its probe reads (env hooks included, so call it inside one);
    ``packages`` are the versions ``simulate(packages=...)`` was given.
    """
    sim = parse_spec(spec) if isinstance(spec, str) else spec
    backend = get_backend(sim.backend)
    return _BUILDERS[family(sim.backend)](backend, sim, _versions(backend, packages or {}))


def _versions(backend: Backend, packages: Mapping[str, str | None]) -> dict[str, str]:
    out = {}
    for dist in dict.fromkeys(("torch", backend.package)):
        value = packages.get(dist, "simulated")
        if value:
            out[dist] = value
    return out


def _details(sim: SimulatedDevice, defaults: Mapping[str, Any], name: str | None = None) -> DeviceReading:
    return DeviceReading(
        name or sim.name or defaults.get("name"),
        sim.memory or defaults.get("mem"),
        bf16=sim.bf16 if sim.bf16 is not None else defaults.get("bf16"),
    )


def free_at(sim: SimulatedDevice, index: int, total: int | None) -> int | None:
    """The free memory of physical device ``index`` in ``sim`` (its total past the spec's list)."""
    if not sim.free:
        return None
    if len(sim.free) == 1:
        return sim.free[0]
    return sim.free[index] if index < len(sim.free) else total


def _shown(
    backend: Backend, env: Mapping[str, str], count: int, variant: str | None, present: Callable[[str], bool]
) -> int:
    # The runtime lists the variable's devices up to the first one the machine lacks (CUDA's rule).
    vis = visible_devices(backend.name, env, variant=variant)
    if vis.ids is None:
        return count
    return len(list(takewhile(present, vis.ids)))


def _runtime(
    backend: Backend,
    sim: SimulatedDevice,
    versions: dict[str, str],
    variables: tuple[str, ...],
    details: DeviceReading,
    *,
    hooks: bool,
    variant: str | None = None,
    present: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """The :class:`RuntimeReadings` fields a device runtime would give for ``sim``."""
    if sim.mode == "missing":
        return {"installed": False, "versions": versions}
    env_set = apply_env_defaults(backend, "import") if hooks else ()
    if sim.mode == "broken":
        failure = _BROKEN_TEXTS.get(backend.name, BROKEN_IMPORT.format(module=backend.module))
        return {"import_error": failure, "env_set": env_set, "versions": versions}
    env = read_env(variables)
    present = present or index_present(sim.count)
    shown = 0 if sim.mode == "unavailable" else _shown(backend, env, sim.count, variant, present)
    return {
        "env_set": env_set,
        "env": env,
        "available": shown > 0,
        "devices": tuple(_with_free(details, sim, i, env, backend, variant) for i in range(shown)),
        "physical_count": sim.count,
        "versions": versions,
    }


def _with_free(
    details: DeviceReading,
    sim: SimulatedDevice,
    shown: int,
    env: Mapping[str, str],
    backend: Backend,
    variant: str | None,
) -> DeviceReading:
    if not sim.free:
        return details
    vis = visible_devices(backend.name, env, variant=variant)
    pid = vis.ids[shown] if vis.ids is not None else str(shown)
    index = int(pid.split(".")[0]) if pid.split(".")[0].isdigit() else shown
    return replace(details, free=free_at(sim, index, details.memory))


def _cpu(backend: Backend, sim: SimulatedDevice, versions: dict[str, str]) -> Readings:
    # The rest of the CPU is this machine's.
    real = read_cpu(backend)
    return replace(
        real,
        name=sim.name or real.name,
        flags=sim.flags if sim.flags is not None else real.flags,
        memory=sim.memory or real.memory,
        # a simulated size without free= leaves free unknown, as a runtime that does not say
        free=free_at(sim, 0, sim.memory or real.memory) if sim.free else (None if sim.memory else real.free),
        # a spec that pins the CPU pins its oneDNN cap too; otherwise the shell's value applies
        env=({ONEDNN_ISA_VARIABLE: sim.isa} if sim.isa else {}) if sim.flags is not None or sim.isa else real.env,
    )


def _cuda(backend: Backend, sim: SimulatedDevice, versions: dict[str, str]) -> Readings:
    rocm = sim.variant == "rocm"
    defaults = DEFAULTS["rocm" if rocm else "cuda"]
    # name, memory and cc of one model: what the spec gives, the rest from the model it describes
    name, memory, cc = gpu_details(sim.name, sim.variant or cuda.VARIANTS[0], sim.capability, sim.memory)
    gpu = replace(_details(sim, defaults, name), memory=memory, capability=cc)
    # NVML's list: every GPU with its UUID; the simulated machine has no MIG instances.
    inventory = tuple(_nvml_gpu(gpu, sim, i) for i in range(sim.count))
    readings = CudaReadings(inventory=inventory or None, mig_uuids=())
    fields = _runtime(
        backend,
        sim,
        versions,
        cuda.ENV_VARIABLES,
        DeviceReading(),
        hooks=False,
        variant=sim.variant,
        present=lambda pid: cuda.listed(readings, pid),
    )
    fields.pop("physical_count", None)  # NVML's list says how many there are
    model = known_model(name, sim.variant or cuda.VARIANTS[0])
    readings = replace(
        readings,
        **fields,
        torch_version=versions.get("torch", "simulated"),
        cuda_version=None if rocm else (sim.cuda or "simulated"),
        hip_version="simulated" if rocm else None,
        arch_list=sim.arch or (),
        machine=sim.host or (model.host if model is not None and model.host else DEFAULT_HOST),
        # Jetson Linux's release file, as a Jetson module's host has it (JetPack 6.2's release)
        tegra=TEGRA_RELEASE if model is not None and model.tegra else None,
    )
    if sim.driver == "none" and sim.mode is None:
        # No driver: NVML and nvidia-smi (both part of it) list nothing and torch says why.
        return replace(
            readings, available=False, devices=(), inventory=None, driver_error=RUNTIME_TEXTS["cuda-no-driver"]
        )
    return replace(readings, driver_version=sim.driver)


def _nvml_gpu(gpu: DeviceReading, sim: SimulatedDevice, index: int) -> DeviceReading:
    """One GPU as NVML lists it: its UUID, free memory, compute mode and the other processes there,
    and what the child process's trial context said where the reader would try one."""
    held = _per_device(sim.held, index, 0)
    free = free_at(sim, index, gpu.memory)
    if free is None and sim.held is not None and gpu.memory is not None:
        free = max(gpu.memory - held, 0)
    reading = replace(
        gpu,
        uuid=f"GPU-00000000-0000-0000-0000-{index:012d}",
        free=free,
        compute_mode=_per_device(sim.compute_modes, index, "default") if sim.compute_modes else None,
        other_processes=(1 if held else 0) if sim.held is not None else None,
    )
    if needs_trial(reading):
        # What the child's torch.zeros(1, device=...) meets: the holder keeps every other context out.
        reading = replace(reading, trial=BUSY_GPU_TEXT if held else "")
    return reading


def _per_device(values: tuple[Any, ...] | None, index: int, default: Any) -> Any:
    """A per-device spec value: one value for all, the list's entry, or ``default`` past the list."""
    if not values:
        return default
    if len(values) == 1:
        return values[0]
    return values[index] if index < len(values) else default


def _hpu(backend: Backend, sim: SimulatedDevice, versions: dict[str, str]) -> Readings:
    accelerate = package_version("accelerate")
    if sim.mode != "missing" and accelerate_block(accelerate) is not None:
        return HpuReadings(accelerate_version=accelerate, versions=versions)  # the reader stops here
    # The runtime reports "GAUDI3" for a Gaudi 3; the probe reads the generation from that name.
    name = sim.name or (sim.generation.upper() if sim.generation else None)
    details = _details(sim, DEFAULTS["hpu"], name)
    return HpuReadings(
        **_runtime(backend, sim, versions, hpu.ENV_VARIABLES, details, hooks=True), accelerate_version=accelerate
    )


def _mps(backend: Backend, sim: SimulatedDevice, versions: dict[str, str]) -> Readings:
    macos = sim.macos or DEFAULTS["mps"]["macos"]
    readings = MpsReadings(versions=versions, system="Darwin", macos=macos)
    if sim.mode == "missing":
        return replace(readings, installed=False)
    if sim.mode == "broken":
        return replace(readings, import_error=BROKEN_IMPORT.format(module=backend.module))
    if sim.mode == "unavailable" or sim.count == 0:
        return readings
    chip = _details(sim, DEFAULTS["mps"])
    return replace(readings, available=True, devices=(replace(chip, free=free_at(sim, 0, chip.memory)),))


def _tpu(backend: Backend, sim: SimulatedDevice, versions: dict[str, str]) -> Readings:
    fields = _runtime(backend, sim, versions, tpu.ENV_VARIABLES, _details(sim, DEFAULTS["tpu"]), hooks=False)
    return TpuReadings(**fields, accelerator="tpu" if fields.get("available") else None)


def _xpu(backend: Backend, sim: SimulatedDevice, versions: dict[str, str]) -> Readings:
    fields = _runtime(backend, sim, versions, xpu.ENV_VARIABLES, _details(sim, DEFAULTS["xpu"]), hooks=False)
    return XpuReadings(**fields, torch_version=versions.get("torch", "simulated"))


def _module(backend: Backend, sim: SimulatedDevice, versions: dict[str, str]) -> Readings:
    details = _details(sim, DEFAULTS.get(backend.name, {}))
    fields = _runtime(backend, sim, versions, vendor.variables_for(backend), details, hooks=True)
    return VendorReadings(**fields, requires_torch=_pinned_torch(backend, versions))


# Plugins whose release X.Y.Z declares Requires-Dist: torch==X.Y.Z.* (torch_npu 2.13.0 does).
_PINS_OWN_VERSION = ("npu",)


def _pinned_torch(backend: Backend, versions: Mapping[str, str]) -> str | None:
    """The torch a simulated plugin requires, when simulate(packages=...) gave its version."""
    plugin = versions.get(backend.package)
    if backend.name not in _PINS_OWN_VERSION or plugin in (None, "simulated"):
        return None
    try:
        return f"=={Version(str(plugin)).base_version}.*"
    except InvalidVersion:
        return None


_BUILDERS: dict[str, Callable[[Backend, SimulatedDevice, dict[str, str]], Readings]] = {
    "cpu": _cpu,
    "cuda": _cuda,
    "hpu": _hpu,
    "mps": _mps,
    "tpu": _tpu,
    "xpu": _xpu,
    "module": _module,
}
