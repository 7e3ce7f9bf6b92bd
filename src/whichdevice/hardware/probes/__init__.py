"""Per-backend probes: read what each runtime says, then interpret the readings by pure rules.

Each backend module holds a ``read_<x>(backend)`` that does all the I/O (find_spec, importing the
vendor package, NVML, environment variables, /proc/cpuinfo) and returns a frozen readings record,
and an ``interpret_<x>(backend, readings)`` that turns those readings into a
:class:`~whichdevice.core.records.ProbeResult` without touching the machine. ``probe_<x>`` is the two in
a row; :mod:`whichdevice.hardware.probing` runs it (time limit, exception capture, cache), and
:func:`whichdevice.testing.simulate` builds readings from a spec and calls the same interpretation.

Rules the readers keep: an absent package is found with ``importlib.util.find_spec`` and never
imported; CUDA and MLU are counted through their management libraries (NVML, CNDEV) so a process
can still fork afterwards; anything that would initialise a device is avoided.

Modules: ``common`` (the readers' helpers, ``finish``, ``not_installed``), ``readings`` (the records a
reader fills), ``cpu``, ``cuda``, ``hpu``, ``mps``, ``tpu``, ``xpu``, ``vendor`` (npu, mlu, musa,
neuron), and ``presence``, whose probes answer "not installed" for a backend whose package (or torch's
build of its runtime) is absent without importing its module. Each declares the
environment variables it reads as ``ENV_VARIABLES``; :data:`ENV_VARIABLES` here is their union.

The names below are imported on first use (``_LAZY``), as the package's own ``__init__`` does: a
resolve imports the probes it runs and no other (``tests/hardware/test_presence.py``).
"""

from __future__ import annotations

import importlib

from whichdevice.core.packages import package_version
from whichdevice.hardware.probes.common import finish, installed_versions, not_installed
from whichdevice.hardware.probes.presence import (
    probe_cuda,
    probe_hpu,
    probe_mlu,
    probe_mps,
    probe_musa,
    probe_neuron,
    probe_npu,
    probe_tpu,
    probe_xpu,
)

# typing costs several ms to import; mypy and ruff treat a module-level TYPE_CHECKING = False the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from whichdevice.core.records import Backend, ProbeResult

    # the submodules, read as attributes (probes.cuda) whether imported or not: see __getattr__
    from whichdevice.hardware.probes import common as common
    from whichdevice.hardware.probes import cpu as cpu
    from whichdevice.hardware.probes import cuda as cuda
    from whichdevice.hardware.probes import hpu as hpu
    from whichdevice.hardware.probes import mps as mps
    from whichdevice.hardware.probes import tpu as tpu
    from whichdevice.hardware.probes import vendor as vendor
    from whichdevice.hardware.probes import xpu as xpu
    from whichdevice.hardware.probes.cpu import (
        BF16_CPU_FLAGS,
        ONEDNN_ISA_VARIABLE,
        CpuReadings,
        bf16_cap,
        cpu_facts,
        cpu_result,
        interpret_cpu,
        probe_cpu,
        read_cpu,
    )
    from whichdevice.hardware.probes.cuda import CudaReadings, cuda_order_warnings, interpret_cuda, read_cuda
    from whichdevice.hardware.probes.hpu import (
        GAUDI_GROUP_SIZES,
        HpuReadings,
        gaudi_generation,
        hpu_group_warnings,
        interpret_hpu,
        read_hpu,
    )
    from whichdevice.hardware.probes.mps import MpsReadings, interpret_mps, read_mps
    from whichdevice.hardware.probes.readings import DeviceReading, RuntimeReadings
    from whichdevice.hardware.probes.tpu import TpuReadings, interpret_tpu, read_tpu
    from whichdevice.hardware.probes.vendor import VendorReadings, interpret_vendor, read_vendor
    from whichdevice.hardware.probes.vendor import interpret_vendor as interpret_mlu
    from whichdevice.hardware.probes.vendor import interpret_vendor as interpret_musa
    from whichdevice.hardware.probes.vendor import interpret_vendor as interpret_neuron
    from whichdevice.hardware.probes.vendor import interpret_vendor as interpret_npu
    from whichdevice.hardware.probes.xpu import XpuReadings, interpret_xpu, read_xpu

    ENV_VARIABLES: tuple[str, ...]

__all__ = [
    "BF16_CPU_FLAGS",
    "ENV_VARIABLES",
    "GAUDI_GROUP_SIZES",
    "ONEDNN_ISA_VARIABLE",
    "CpuReadings",
    "CudaReadings",
    "DeviceReading",
    "HpuReadings",
    "MpsReadings",
    "RuntimeReadings",
    "TpuReadings",
    "VendorReadings",
    "XpuReadings",
    "bf16_cap",
    "cpu_facts",
    "cpu_result",
    "cuda_order_warnings",
    "finish",
    "gaudi_generation",
    "hpu_group_warnings",
    "installed_versions",
    "interpret",
    "interpret_cpu",
    "interpret_cuda",
    "interpret_hpu",
    "interpret_mlu",
    "interpret_mps",
    "interpret_musa",
    "interpret_neuron",
    "interpret_npu",
    "interpret_tpu",
    "interpret_vendor",
    "interpret_xpu",
    "not_installed",
    "package_version",
    "probe_cpu",
    "probe_cuda",
    "probe_hpu",
    "probe_mlu",
    "probe_mps",
    "probe_musa",
    "probe_neuron",
    "probe_npu",
    "probe_tpu",
    "probe_xpu",
    "read_cpu",
    "read_cuda",
    "read_hpu",
    "read_mps",
    "read_tpu",
    "read_vendor",
    "read_xpu",
]

# The probe modules, in the order their ENV_VARIABLES are joined.
_MODULES = ("common", "cpu", "cuda", "hpu", "mps", "tpu", "vendor", "xpu")
# Submodules that read no environment variable, read as attributes all the same.
_OTHER_MODULES = ("readings",)

# public name -> (probe module that defines it, its name there); imported when first used.
_LAZY: dict[str, tuple[str, str]] = {
    **{
        name: ("cpu", name)
        for name in (
            "BF16_CPU_FLAGS",
            "ONEDNN_ISA_VARIABLE",
            "CpuReadings",
            "bf16_cap",
            "cpu_facts",
            "cpu_result",
            "interpret_cpu",
            "probe_cpu",
            "read_cpu",
        )
    },
    **{name: ("cuda", name) for name in ("CudaReadings", "cuda_order_warnings", "interpret_cuda", "read_cuda")},
    **{
        name: ("hpu", name)
        for name in (
            "GAUDI_GROUP_SIZES",
            "HpuReadings",
            "gaudi_generation",
            "hpu_group_warnings",
            "interpret_hpu",
            "read_hpu",
        )
    },
    **{name: ("mps", name) for name in ("MpsReadings", "interpret_mps", "read_mps")},
    **{name: ("readings", name) for name in ("DeviceReading", "RuntimeReadings")},
    **{name: ("tpu", name) for name in ("TpuReadings", "interpret_tpu", "read_tpu")},
    **{name: ("vendor", name) for name in ("VendorReadings", "interpret_vendor", "read_vendor")},
    # The out-of-tree device modules share one reading and one interpretation.
    **{f"interpret_{name}": ("vendor", "interpret_vendor") for name in ("npu", "mlu", "musa", "neuron")},
    **{name: ("xpu", name) for name in ("XpuReadings", "interpret_xpu", "read_xpu")},
}


def __getattr__(name: str) -> Any:
    if name == "ENV_VARIABLES":
        # Every environment variable a probe reads, declared by the module that reads it.
        modules = [importlib.import_module(f"{__name__}.{m}") for m in _MODULES]
        value: Any = tuple(dict.fromkeys(v for module in modules for v in module.ENV_VARIABLES))
    elif name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    elif name in _MODULES or name in _OTHER_MODULES:
        # ``probes.cuda`` reads as the submodule, imported or not (``from . import cuda`` does the same).
        return importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def interpret(backend: Backend, readings: CpuReadings | RuntimeReadings) -> ProbeResult:
    """The interpretation that belongs to ``readings``' type (a plain :class:`RuntimeReadings`:
    an out-of-tree torch device module, like npu's)."""
    from whichdevice.hardware.probes import cpu, cuda, hpu, mps, tpu, vendor, xpu
    from whichdevice.hardware.probes.readings import RuntimeReadings

    # Readings type -> its interpretation (subclasses first: every runtime reading is a RuntimeReadings).
    interpreters: tuple[tuple[type, Any], ...] = (
        (cpu.CpuReadings, cpu.interpret_cpu),
        (cuda.CudaReadings, cuda.interpret_cuda),
        (hpu.HpuReadings, hpu.interpret_hpu),
        (mps.MpsReadings, mps.interpret_mps),
        (tpu.TpuReadings, tpu.interpret_tpu),
        (xpu.XpuReadings, xpu.interpret_xpu),
        (RuntimeReadings, vendor.interpret_vendor),
    )
    for kind, function in interpreters:
        if isinstance(readings, kind):
            result: ProbeResult = function(backend, readings)
            return result
    raise TypeError(f"no interpretation for {type(readings).__name__}")
