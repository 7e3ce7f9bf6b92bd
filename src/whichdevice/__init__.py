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
from whichdevice.resolver import Resolution, parse_device, resolve_device
from whichdevice.training import training_arguments

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
    "Resolution",
    "UnknownDeviceError",
    "__version__",
    "backends",
    "get_backend",
    "parse_device",
    "probe",
    "probe_all",
    "register_backend",
    "resolve_device",
    "testing",
    "training_arguments",
]


def __getattr__(name: str) -> object:
    # ``wd.testing`` without an explicit import, as DESIGN.md shows it, but not loaded until used.
    if name == "testing":
        import importlib

        return importlib.import_module("whichdevice.testing")
    raise AttributeError(f"module 'whichdevice' has no attribute {name!r}")
