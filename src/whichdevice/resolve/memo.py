"""The memo key of resolve_device(): its arguments plus every environment variable a resolution reads.

The variables are not listed here. Each module that reads the environment on the resolve path
declares its own (``ENV_VARIABLES`` next to the code that reads them, as Ray's ``hpu.py`` holds
``HABANA_VISIBLE_DEVICES_ENV_VAR``), and each registered backend's row declares its env hooks; the
key is their union, so a new reader or a plugin backend cannot be left out. The other variables the
probes read are not in it: they are cached with the probe results, which ``refresh=True`` clears.
The rows' visible-devices variables are in it, as they are in the probe cache's key: a notebook
that edits CUDA_VISIBLE_DEVICES between calls gets an answer (and a launch command) that follows.
"""

from __future__ import annotations

import os
from typing import Any

from whichdevice.attention import kernels as kernels_support
from whichdevice.core import packages
from whichdevice.device import request
from whichdevice.hardware.registry import backends, on_change
from whichdevice.launch import accelerate_settings, distributed
from whichdevice.measure import calibration
from whichdevice.precision import tf32
from whichdevice.resolve.arguments import Arguments
from whichdevice.tuning import compile_support

__all__ = ["DECLARING_MODULES", "environment_mapping", "memo_key", "memo_variables", "read_environment"]

# The modules on the resolve path that read the environment (tests/resolve/test_memo.py fails when a
# module reads a variable it does not declare, or declares one this list does not reach).
DECLARING_MODULES = (request, distributed, kernels_support, accelerate_settings, calibration, compile_support, tf32)

# os.environ.get costs about 0.7 us a name (str -> bytes, Mapping.get); the backing dict of bytes
# answers in a tenth of that, which keeps a repeated resolve_device() well under 20 us.
_RAW_ENV: Any = getattr(os.environ, "_data", None) if os.name == "posix" else None
# (names, their raw keys) for the registry as it is; emptied whenever a backend row changes. One
# slot, replaced whole, so a thread that reads it while another empties it gets an entry or None.
_variables: list[tuple[tuple[str, ...], tuple[bytes, ...]] | None] = [None]
Reading = tuple[tuple[str, ...], tuple[Any, ...]]


def _forget(_name: str) -> None:
    _variables[0] = None


on_change(_forget)


def memo_variables() -> tuple[str, ...]:
    """Every variable whose value is part of the memo key, each once."""
    return _current()[0]


def _current() -> tuple[tuple[str, ...], tuple[bytes, ...]]:
    entry = _variables[0]
    if entry is not None:
        return entry
    declared = [name for module in DECLARING_MODULES for name in module.ENV_VARIABLES]
    hooks = [default.name for backend in backends() for default in backend.env_defaults]
    visible = [name for backend in backends() for name in backend.visible_devices_env]
    names = tuple(dict.fromkeys([*declared, *hooks, *visible]))
    entry = (names, tuple(os.fsencode(name) for name in names))
    _variables[0] = entry
    return entry


def read_environment() -> Reading:
    """(names, values): one reading of every variable in the key (None for unset), taken at once."""
    names, raw_keys = _variables[0] or _current()
    if _RAW_ENV is not None:
        return names, tuple(map(_RAW_ENV.get, raw_keys))
    return names, tuple(map(os.environ.get, names))


def environment_mapping(reading: Reading) -> dict[str, str]:
    """``read_environment()``'s reading as name -> value (set variables only), for envview.pinned."""
    names, values = reading
    return {
        name: value if isinstance(value, str) else os.fsdecode(value)
        for name, value in zip(names, values, strict=True)
        if value is not None
    }


def memo_key(args: Arguments, environment: Reading | None = None) -> Any:
    """A hashable key for these arguments, or None when an answer must not be reused.

    ``environment`` is a ``read_environment()`` reading (default: one taken now); resolve_device()
    resolves under that same reading (envview.pinned), so the key and the answer cannot disagree.
    A model or memory budget is never memoised: the files behind a path can change.
    """
    if args.model is not None or args.max_memory is not None:
        return None
    device, prefer, exclude = args.device, args.prefer, args.exclude
    if type(device).__name__ == "device" or list in (type(prefer), type(exclude), type(args.devices)):
        args = args._replace(
            device=str(device) if type(device).__name__ == "device" else device,
            prefer=tuple(prefer) if isinstance(prefer, list) else prefer,
            exclude=tuple(exclude) if isinstance(exclude, list) else exclude,
            devices=tuple(args.devices) if isinstance(args.devices, list) else args.devices,
        )
    key = (args, (read_environment() if environment is None else environment)[1], packages.generation())
    try:
        hash(key)
    except TypeError:
        return None
    return key
