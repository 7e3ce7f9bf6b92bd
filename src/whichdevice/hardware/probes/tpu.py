"""The TPU probe: native TorchTPU, where ``torch.accelerator`` reports a device of type ``tpu``."""

from __future__ import annotations

import importlib
from importlib.util import find_spec

from whichdevice.core.frozen import frozen_record
from whichdevice.core.packages import package_version
from whichdevice.core.records import Backend, ProbeResult
from whichdevice.hardware.compatibility import plugin_problem
from whichdevice.hardware.probes.common import (
    finish_runtime,
    import_failure,
    installed_versions,
    module_devices,
    not_installed,
    raise_import_error,
    read_env,
)
from whichdevice.hardware.probes.presence import XLA_PACKAGE, tpu_installed
from whichdevice.hardware.probes.readings import DeviceReading, RuntimeReadings
from whichdevice.hardware.visible import visible_devices

__all__ = ["ENV_VARIABLES", "TpuReadings", "interpret_tpu", "probe_tpu", "read_tpu"]

ENV_VARIABLES = ("TPU_VISIBLE_CHIPS", "PJRT_DEVICE")


@frozen_record
class TpuReadings(RuntimeReadings):
    """``accelerator``: the type ``torch.accelerator.current_accelerator()`` reported (None: none);
    ``xla_version``: torch_xla's, when it is installed (read from its metadata, never imported)."""

    accelerator: str | None = None
    xla_version: str | None = None


def read_tpu(backend: Backend) -> TpuReadings:
    versions = installed_versions(backend)
    if not tpu_installed(backend):
        xla = package_version(XLA_PACKAGE)
        return TpuReadings(installed=False, versions=versions, xla_version=xla, env=read_env(ENV_VARIABLES))
    import torch

    if find_spec("torch_tpu") is not None:
        try:
            importlib.import_module("torch_tpu")
        except Exception as exc:
            return TpuReadings(import_error=import_failure(exc), versions=versions)
    env = read_env(ENV_VARIABLES)
    current = torch.accelerator.current_accelerator()
    accelerator = current.type if current is not None else None
    count = int(torch.accelerator.device_count()) if accelerator == "tpu" else 0
    # torch.accelerator names no model and no memory: only the count is read.
    devices = (DeviceReading(),) * count
    return TpuReadings(env=env, available=count > 0, devices=devices, versions=versions, accelerator=accelerator)


def interpret_tpu(backend: Backend, readings: TpuReadings) -> ProbeResult:
    """TPU chips count only when torch's accelerator is a TPU (another accelerator is not ours)."""
    if not readings.installed:
        return not_installed(backend, _xla_reason(backend, readings), versions=readings.versions)
    raise_import_error(readings)
    vis = visible_devices("tpu", readings.env)
    devices = module_devices(readings.devices, vis) if readings.accelerator == "tpu" else []
    return finish_runtime(backend, readings, vis, devices)


def _xla_reason(backend: Backend, readings: TpuReadings) -> str | None:
    """torch_xla without torch-tpu: say that its devices are not this row's, and check the pair."""
    if readings.xla_version is None:
        return None
    pjrt = readings.env.get("PJRT_DEVICE")
    where = f" (PJRT_DEVICE={pjrt}: XLA runs on the CPU, not on a TPU)" if pjrt and pjrt.upper() == "CPU" else ""
    pair = plugin_problem(XLA_PACKAGE, readings.xla_version, readings.versions.get("torch"), None)
    return (
        f"{backend.package} is not installed: {backend.install_command}. {XLA_PACKAGE} {readings.xla_version} is "
        f"installed{where}, but whichdevice's tpu row is native TorchTPU and never picks torch_xla's "
        "xla devices" + (f"; also, {pair}" if pair else "")
    )


def probe_tpu(backend: Backend) -> ProbeResult:
    return interpret_tpu(backend, read_tpu(backend))
