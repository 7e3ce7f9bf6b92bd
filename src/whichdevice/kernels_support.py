"""Hub kernels (``use_kernels=True``): on only where the kernels package, the backend and the Hub allow."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from whichdevice.errors import ConfigConflictError
from whichdevice.probes import _version_tuple, package_version

if TYPE_CHECKING:
    from whichdevice.probing import ProbeResult
    from whichdevice.registry import Backend
    from whichdevice.resolver import TraceStep

__all__ = ["decide_kernels", "kernels_compatibility", "kernels_key", "transformers_kernels_range"]


@lru_cache(maxsize=1)
def transformers_kernels_range() -> tuple[str | None, str | None]:
    """(minimum, exclusive maximum) kernels version the installed transformers accepts.

    Read from transformers' dependency table as text, so transformers is not imported.
    """
    spec = find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    table = Path(next(iter(spec.submodule_search_locations))) / "dependency_versions_table.py"
    try:
        text = table.read_text(encoding="utf-8")
    except OSError:
        return None, None
    match = re.search(r'"kernels":\s*"kernels([^"]*)"', text)
    if not match:
        return None, None
    low = re.search(r">=\s*([\w.]+)", match.group(1))
    high = re.search(r"<\s*([\w.]+)", match.group(1))
    return (low.group(1) if low else None, high.group(1) if high else None)


def kernels_compatibility() -> tuple[bool, str]:
    """Whether the installed ``kernels`` is one the installed transformers will use, and why."""
    installed = package_version("kernels")
    low, high = transformers_kernels_range()
    wanted = ",".join(p for p in (f">={low}" if low else "", f"<{high}" if high else "") if p)
    tf = package_version("transformers") or "?"
    if installed is None:
        return False, f"the kernels package is not installed (transformers {tf} wants kernels{wanted}): pip install 'kernels{wanted}'"
    version = _version_tuple(installed)
    if (low and version < _version_tuple(low)) or (high and version >= _version_tuple(high)):
        return False, (
            f"kernels {installed} is installed but transformers {tf} wants kernels{wanted}, so it "
            f"ignores Hub kernels: pip install 'kernels{wanted}'"
        )
    return True, f"kernels {installed} is within transformers {tf}'s range (kernels{wanted})"


def kernels_key(backend: Backend, result: ProbeResult) -> str | None:
    """The kernels device key: the backend's own, except ROCm which is its own target ("rocm")."""
    if backend.name == "cuda" and result.variant == "rocm":
        return "rocm"
    return backend.kernels_key


def hub_access() -> tuple[bool, str]:
    """Whether a Hub kernel can be had without whichdevice touching the network."""
    if os.environ.get("LOCAL_KERNELS"):
        return True, "LOCAL_KERNELS points at local kernel builds"
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
            os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
        )
        cached = any(Path(cache).glob("models--kernels-community--*")) if os.path.isdir(cache) else False
        if cached:
            return True, f"HF_HUB_OFFLINE=1 and kernels are in the cache ({cache})"
        return False, f"HF_HUB_OFFLINE=1 and no kernels-community kernel is in the cache ({cache})"
    # Online: whichdevice does not open a connection on every resolution; transformers fetches
    # the kernel on first use and falls back with its own message when the Hub is unreachable.
    return True, "the Hub is not switched off (HF_HUB_OFFLINE unset); kernels download on first use"


def decide_kernels(
    backend: Backend, result: ProbeResult, requested: Any, trace: list[TraceStep]
) -> tuple[bool, str | None]:
    """(use_kernels, kernels device key); explicit True raises when it cannot work."""
    from whichdevice.resolver import TraceStep

    key = kernels_key(backend, result)
    if requested in (False, None):
        trace.append(TraceStep("kernels", "Hub kernels off (use_kernels=False)"))
        return False, key
    if requested not in ("auto", True):
        raise ConfigConflictError(f"use_kernels={requested!r}: use 'auto', True or False")
    checks = [kernels_compatibility()]
    if key is None:
        checks.append((False, f"Hub kernels have no device key for {backend.name} (keys: cuda, rocm, xpu, npu, neuron, tpu, mps)"))
    else:
        checks.append((True, f"kernel device key {key!r}"))
    checks.append(hub_access())
    failed = [why for ok, why in checks if not ok]
    if failed:
        if requested is True:
            raise ConfigConflictError("use_kernels=True cannot work here: " + "; ".join(failed))
        trace.append(TraceStep("kernels", "Hub kernels off: " + "; ".join(failed)))
        return False, key
    trace.append(TraceStep("kernels", "Hub kernels on: " + "; ".join(why for _, why in checks)))
    return True, key
