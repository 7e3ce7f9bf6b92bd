"""Why ``import torch`` failed in this process: a device extension torch autoloads is named, with its fix.

Apart from the probes' shared readings (common.py) because naming the extension asks the registry
which backend ships it.
"""

from __future__ import annotations

import re

from whichdevice.hardware.probes.common import import_failure, toolkit_note
from whichdevice.hardware.registry import backends

__all__ = ["torch_import_failed", "torch_import_reason"]


_AUTOLOAD = re.compile(r"Failed to load the backend extension: (\w+(?:\.\w+)*)")


# The first failure: a second ``import torch`` after a failed one fails with an unrelated error.
_torch_failures: list[str] = []


def torch_import_failed() -> bool:
    """Whether ``import torch`` failed in this process (probing saw it)."""
    return bool(_torch_failures)


def torch_import_reason(exc: BaseException) -> str:
    """Why ``import torch`` failed, with the fix; a device plugin torch auto-loads is named."""
    if _torch_failures:
        return _torch_failures[0]
    match = _AUTOLOAD.search(str(exc))
    if match is None:
        _torch_failures.append(f"torch failed to import ({type(exc).__name__}: {exc}); reinstall it: pip install torch")
        return _torch_failures[0]
    module = match.group(1)
    cause = exc.__cause__
    found = [b for b in backends() if b.module.split(".")[0] == module]
    dist = found[0].package if found else module
    note = toolkit_note(found[0].name, str(cause)) if found and cause is not None else None
    reason = (
        f"importing torch fails because torch loads the {module} device extension on import and "
        f"{module} failed to load"
        + (f" ({import_failure(cause)})" if cause is not None else "")
        + (f"; {note}" if note else "")
        + f". Fix {dist}'s install, uninstall it (pip uninstall {dist}), or start torch without it: "
        "export TORCH_DEVICE_BACKEND_AUTOLOAD=0"
    )
    _torch_failures.append(reason)
    return reason
