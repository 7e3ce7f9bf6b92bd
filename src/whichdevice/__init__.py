"""whichdevice: one answer to "which device and settings should this Transformers program use?".

``import whichdevice`` imports neither torch nor transformers; they load when a probe or a
resolution needs them.
"""

from __future__ import annotations

from whichdevice.errors import (
    ConfigConflictError,
    DeviceError,
    DeviceUnavailableError,
    DoesNotFitError,
    UnknownDeviceError,
)
from whichdevice.probing import DeviceInfo, ProbeResult, probe, probe_all
from whichdevice.registry import Backend, EnvDefault, backends, get_backend, register_backend

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "ConfigConflictError",
    "DeviceError",
    "DeviceInfo",
    "DeviceUnavailableError",
    "DoesNotFitError",
    "EnvDefault",
    "ProbeResult",
    "UnknownDeviceError",
    "__version__",
    "backends",
    "get_backend",
    "probe",
    "probe_all",
    "register_backend",
]
