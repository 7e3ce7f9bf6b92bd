"""The Apple Silicon probe: an MPS build of torch on macOS; bf16 from macOS 14."""

from __future__ import annotations

import platform

from whichdevice.core.frozen import frozen_record
from whichdevice.core.packages import version_at_least
from whichdevice.core.records import Backend, DeviceInfo, ProbeResult
from whichdevice.hardware.probes.common import finish, installed_versions, not_installed, raise_import_error
from whichdevice.hardware.probes.cpu import available_memory, cpu_facts
from whichdevice.hardware.probes.presence import mps_built, no_mps_reason
from whichdevice.hardware.probes.readings import DeviceReading, RuntimeReadings

__all__ = ["ENV_VARIABLES", "MpsReadings", "interpret_mps", "probe_mps", "read_mps"]

ENV_VARIABLES: tuple[str, ...] = ()

# MPS runs bf16 from this macOS on.
MPS_BF16_MACOS = "14"
# torch's MPS backend needs this macOS; before it torch.backends.mps.is_available() is False.
MPS_MIN_MACOS = "12.3"
# The macOS releases that run on Apple Silicon (after 15 the numbering jumped to the year: 26).
MACOS_RELEASES = (11, 12, 13, 14, 15, 26)


@frozen_record
class MpsReadings(RuntimeReadings):
    """``installed``: torch has MPS built in; ``system`` and ``macos`` say which OS this is.

    ``devices`` holds the one GPU: the chip's name (as ``platform.processor()`` gives it) and the
    machine's memory, which the GPU shares.
    """

    system: str = ""
    macos: str | None = None


def read_mps(backend: Backend) -> MpsReadings:
    import torch

    versions = installed_versions(backend)
    system = platform.system()
    if not mps_built(torch, system):
        return MpsReadings(installed=False, versions=versions, system=system)
    mac = platform.mac_ver()[0] or None
    if not torch.backends.mps.is_available():
        return MpsReadings(versions=versions, system=system, macos=mac)
    # The GPU shares the machine's memory: what the system has available is what it can take.
    device = DeviceReading(platform.processor() or None, cpu_facts()[2], free=available_memory())
    return MpsReadings(available=True, devices=(device,), versions=versions, system=system, macos=mac)


def interpret_mps(backend: Backend, readings: MpsReadings) -> ProbeResult:
    mac = readings.macos
    if readings.system != "Darwin" or not readings.installed:
        return not_installed(
            backend,
            no_mps_reason(readings.system),
            versions=readings.versions,
        )
    raise_import_error(readings)
    if not readings.available:
        return finish(
            backend,
            [],
            os_version=mac,
            unavailable_reason=f"MPS is built into torch but not available (macOS {mac}; needs {MPS_MIN_MACOS}+)",
            versions=readings.versions,
        )
    chip = readings.devices[0] if readings.devices else DeviceReading()
    bf16 = mac is not None and version_at_least(mac, MPS_BF16_MACOS)
    device = DeviceInfo(
        0, name=chip.name or "Apple Silicon", total_memory=chip.memory, bf16=bf16, free_memory=chip.free
    )
    return finish(backend, [device], os_version=mac, versions=readings.versions)


def probe_mps(backend: Backend) -> ProbeResult:
    return interpret_mps(backend, read_mps(backend))
