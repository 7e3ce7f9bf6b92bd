"""The Intel GPU probe: ``torch.xpu`` of a torch built with XPU support."""

from __future__ import annotations

from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import Backend, ProbeResult
from whichdevice.hardware.probes.common import (
    finish_runtime,
    installed_versions,
    module_devices,
    not_installed,
    raise_import_error,
    read_env,
    read_module_devices,
)
from whichdevice.hardware.probes.presence import no_xpu_reason, xpu_built
from whichdevice.hardware.probes.readings import RuntimeReadings
from whichdevice.hardware.visible import visible_devices

__all__ = ["ENV_VARIABLES", "XpuReadings", "interpret_xpu", "probe_xpu", "read_xpu"]

ENV_VARIABLES = ("ZE_AFFINITY_MASK",)


@frozen_record
class XpuReadings(RuntimeReadings):
    """``installed``: torch was built with XPU support; ``torch_version`` names that torch."""

    torch_version: str = ""


def read_xpu(backend: Backend) -> XpuReadings:
    import torch

    versions = installed_versions(backend)
    torch_version = str(torch.__version__)
    if not xpu_built(torch):
        return XpuReadings(installed=False, versions=versions, torch_version=torch_version)
    available = bool(torch.xpu.is_available())
    count = int(torch.xpu.device_count()) if available else 0
    return XpuReadings(
        env=read_env(ENV_VARIABLES),
        available=available,
        devices=read_module_devices(torch.xpu, count),
        versions=versions,
        torch_version=torch_version,
    )


def interpret_xpu(backend: Backend, readings: XpuReadings) -> ProbeResult:
    if not readings.installed:
        return not_installed(
            backend,
            no_xpu_reason(readings.torch_version, backend.install_command),
            versions=readings.versions,
        )
    raise_import_error(readings)
    vis = visible_devices("xpu", readings.env)
    return finish_runtime(backend, readings, vis, module_devices(readings.devices, vis))


def probe_xpu(backend: Backend) -> ProbeResult:
    return interpret_xpu(backend, read_xpu(backend))
