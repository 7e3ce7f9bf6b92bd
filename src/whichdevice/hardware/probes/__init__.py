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

Modules: ``common`` (shared readings, ``finish``, ``not_installed``), ``cpu``, ``cuda``, ``hpu``,
``mps``, ``tpu``, ``xpu``, ``vendor`` (npu, mlu, musa, neuron). Each declares the environment
variables it reads as ``ENV_VARIABLES``; :data:`ENV_VARIABLES` here is their union.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from whichdevice.core.packages import package_version
from whichdevice.core.records import Backend, ProbeResult
from whichdevice.hardware.probes import common, cpu, cuda, hpu, mps, tpu, vendor, xpu
from whichdevice.hardware.probes.common import DeviceReading, RuntimeReadings, finish, installed_versions, not_installed
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
from whichdevice.hardware.probes.cuda import CudaReadings, cuda_order_warnings, interpret_cuda, probe_cuda, read_cuda
from whichdevice.hardware.probes.hpu import (
    GAUDI_GROUP_SIZES,
    HpuReadings,
    gaudi_generation,
    hpu_group_warnings,
    interpret_hpu,
    probe_hpu,
    read_hpu,
)
from whichdevice.hardware.probes.mps import MpsReadings, interpret_mps, probe_mps, read_mps
from whichdevice.hardware.probes.tpu import TpuReadings, interpret_tpu, probe_tpu, read_tpu
from whichdevice.hardware.probes.vendor import (
    VendorReadings,
    interpret_vendor,
    probe_mlu,
    probe_musa,
    probe_neuron,
    probe_npu,
    read_vendor,
)
from whichdevice.hardware.probes.xpu import XpuReadings, interpret_xpu, probe_xpu, read_xpu

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

# The out-of-tree device modules share one reading and one interpretation.
interpret_npu = interpret_mlu = interpret_musa = interpret_neuron = interpret_vendor

# Every environment variable a probe reads, declared by the module that reads it.
ENV_VARIABLES: tuple[str, ...] = tuple(
    dict.fromkeys(name for module in (common, cpu, cuda, hpu, mps, tpu, vendor, xpu) for name in module.ENV_VARIABLES)
)

# Readings type -> its interpretation (subclasses first: every runtime reading is a RuntimeReadings).
_INTERPRETERS: tuple[tuple[type, Callable[[Backend, Any], ProbeResult]], ...] = (
    (CpuReadings, interpret_cpu),
    (CudaReadings, interpret_cuda),
    (HpuReadings, interpret_hpu),
    (MpsReadings, interpret_mps),
    (TpuReadings, interpret_tpu),
    (XpuReadings, interpret_xpu),
    (RuntimeReadings, interpret_vendor),
)


def interpret(backend: Backend, readings: CpuReadings | RuntimeReadings) -> ProbeResult:
    """The interpretation that belongs to ``readings``' type (a plain :class:`RuntimeReadings`:
    an out-of-tree torch device module, like npu's)."""
    for kind, function in _INTERPRETERS:
        if isinstance(readings, kind):
            return function(backend, readings)
    raise TypeError(f"no interpretation for {type(readings).__name__}")
