"""Out-of-tree torch device modules: Ascend (npu), Cambricon (mlu), Moore Threads (musa), Trainium (neuron).

Each ships a package that, once imported, adds ``torch.<name>`` with ``is_available``,
``device_count`` and device properties; one reader and one interpretation serve them all (and
third-party backends in simulations).
"""

from __future__ import annotations

import importlib

from whichdevice.core.frozen import frozen_record
from whichdevice.core.packages import requirement_on
from whichdevice.core.records import Backend, ProbeResult
from whichdevice.hardware.envhooks import apply_env_defaults, scoped_env
from whichdevice.hardware.probes.common import (
    finish_runtime,
    import_failure,
    installed_versions,
    module_devices,
    not_installed,
    raise_import_error,
    read_env,
    read_module_devices,
)
from whichdevice.hardware.probes.presence import vendor_installed
from whichdevice.hardware.probes.readings import RuntimeReadings
from whichdevice.hardware.visible import visible_devices

__all__ = [
    "ENV_VARIABLES",
    "VendorReadings",
    "interpret_vendor",
    "probe_mlu",
    "probe_musa",
    "probe_neuron",
    "probe_npu",
    "read_vendor",
    "variables_for",
]

# The visible-devices variable each runtime reads (the registry row names it too; a test compares).
VISIBLE_VARIABLES = {
    "npu": ("ASCEND_RT_VISIBLE_DEVICES",),
    "mlu": ("MLU_VISIBLE_DEVICES",),
    "musa": ("MUSA_VISIBLE_DEVICES",),
    "neuron": ("NEURON_RT_VISIBLE_CORES",),
}
ENV_VARIABLES = tuple(name for names in VISIBLE_VARIABLES.values() for name in names)

# Switches that make a count answer without starting the driver (fork-safe, like CUDA's NVML check).
_COUNT_SWITCHES = {"mlu": {"PYTORCH_CNDEV_BASED_MLU_CHECK": "1"}}


def variables_for(backend: Backend) -> tuple[str, ...]:
    """The visible-devices variables the reader reads for ``backend`` (a plugin's: from its row)."""
    return VISIBLE_VARIABLES.get(backend.name, backend.visible_devices_env)


@frozen_record
class VendorReadings(RuntimeReadings):
    """What ``torch.<name>`` said after its package was imported (see :class:`RuntimeReadings`)."""


def read_vendor(backend: Backend) -> VendorReadings:
    versions = installed_versions(backend)
    if not vendor_installed(backend):
        return VendorReadings(installed=False, versions=versions)
    env_set = apply_env_defaults(backend, "import")
    requires = requirement_on(backend.package, "torch")
    import torch

    try:
        importlib.import_module(backend.module)
    except Exception as exc:
        return VendorReadings(
            import_error=import_failure(exc), env_set=env_set, versions=versions, requires_torch=requires
        )
    module = getattr(torch, backend.name, None)
    if module is None:
        raise RuntimeError(f"{backend.module} imported but torch.{backend.name} does not exist")
    env = read_env(variables_for(backend))
    with scoped_env(**_COUNT_SWITCHES.get(backend.name, {})):
        available = bool(module.is_available())
        count = int(module.device_count()) if available else 0
    return VendorReadings(
        env_set=env_set,
        env=env,
        available=available,
        devices=read_module_devices(module, count),
        versions=versions,
        requires_torch=requires,
    )


def interpret_vendor(backend: Backend, readings: RuntimeReadings) -> ProbeResult:
    """Visible devices as the runtime listed them, with the physical id behind each."""
    if not readings.installed:
        return not_installed(backend, versions=readings.versions)
    raise_import_error(readings, backend)
    vis = visible_devices(backend.name, readings.env)
    return finish_runtime(backend, readings, vis, module_devices(readings.devices, vis))


def probe_npu(backend: Backend) -> ProbeResult:
    return interpret_vendor(backend, read_vendor(backend))


def probe_mlu(backend: Backend) -> ProbeResult:
    return interpret_vendor(backend, read_vendor(backend))


def probe_musa(backend: Backend) -> ProbeResult:
    return interpret_vendor(backend, read_vendor(backend))


def probe_neuron(backend: Backend) -> ProbeResult:
    return interpret_vendor(backend, read_vendor(backend))
