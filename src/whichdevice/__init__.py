"""whichdevice: one answer to "which device and settings should this Transformers program use?".

``import whichdevice`` imports neither torch nor transformers, and of its own modules only the
errors: the registry, resolver, probes and training helpers load on first use (see ``_LAZY``).
Scripts import this at the top and every distributed process pays for it; the registry alone
pulls in dataclasses and typing, about 20 ms of standard library.
"""

from __future__ import annotations

import importlib

from whichdevice.core.errors import (
    ArgumentsClassError,
    ConfigConflictError,
    DamagedModelError,
    DeviceError,
    DeviceUnavailableError,
    DoesNotFitError,
    PackageVersionError,
    UnknownDeviceError,
)

# typing costs several ms to import; mypy and ruff treat a module-level TYPE_CHECKING = False the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from whichdevice import testing
    from whichdevice.hardware.probing import (
        DeviceInfo,
        ProbeResult,
        clear_cache,
        gave_up,
        probe,
        probe_all,
        set_probe_timeout,
    )
    from whichdevice.hardware.registry import (
        Backend,
        EnvDefault,
        backend_names,
        backends,
        get_backend,
        register_backend,
        unregister_backend,
    )
    from whichdevice.report.plan import HardwarePlan, plan_hardware
    from whichdevice.resolve.resolver import Resolution, parse_device, resolve_device
    from whichdevice.training.arguments import training_arguments
    from whichdevice.training.lora import LoraTraining, lora_training
    from whichdevice.training.simulated import SimulatedTrainingError

__version__ = "0.1.0"

# public name -> module that defines it, imported when the name is first used
_LAZY = {
    "Backend": "whichdevice.hardware.registry",
    "EnvDefault": "whichdevice.hardware.registry",
    "backends": "whichdevice.hardware.registry",
    "get_backend": "whichdevice.hardware.registry",
    "register_backend": "whichdevice.hardware.registry",
    "unregister_backend": "whichdevice.hardware.registry",
    "backend_names": "whichdevice.hardware.registry",
    "clear_cache": "whichdevice.hardware.probing",
    "gave_up": "whichdevice.hardware.probing",
    "set_probe_timeout": "whichdevice.hardware.probing",
    "SimulatedTrainingError": "whichdevice.training.simulated",
    "DeviceInfo": "whichdevice.hardware.probing",
    "ProbeResult": "whichdevice.hardware.probing",
    "probe": "whichdevice.hardware.probing",
    "probe_all": "whichdevice.hardware.probing",
    "Resolution": "whichdevice.resolve.resolver",
    "parse_device": "whichdevice.resolve.resolver",
    "resolve_device": "whichdevice.resolve.resolver",
    "plan_hardware": "whichdevice.report.plan",
    "HardwarePlan": "whichdevice.report.plan",
    "training_arguments": "whichdevice.training.arguments",
    "LoraTraining": "whichdevice.training.lora",
    "lora_training": "whichdevice.training.lora",
}

__all__ = [
    "ArgumentsClassError",
    "Backend",
    "ConfigConflictError",
    "DamagedModelError",
    "DeviceError",
    "DeviceInfo",
    "DeviceUnavailableError",
    "DoesNotFitError",
    "EnvDefault",
    "HardwarePlan",
    "LoraTraining",
    "PackageVersionError",
    "ProbeResult",
    "Resolution",
    "SimulatedTrainingError",
    "UnknownDeviceError",
    "__version__",
    "backend_names",
    "backends",
    "clear_cache",
    "gave_up",
    "get_backend",
    "lora_training",
    "parse_device",
    "plan_hardware",
    "probe",
    "probe_all",
    "register_backend",
    "resolve_device",
    "set_probe_timeout",
    "testing",
    "training_arguments",
    "unregister_backend",
]


def __getattr__(name: str) -> Any:
    if name == "testing":
        return importlib.import_module("whichdevice.testing")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'whichdevice' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
