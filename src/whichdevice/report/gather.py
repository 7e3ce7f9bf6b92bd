"""Gathering the report: probe results, environment, warnings, resolutions and versions, JSON-safe.

:func:`gather` builds the dict that ``report_schema.json`` documents and ``whichdevice --json``
prints. Gathering is fast on purpose: versions come from package metadata, so transformers,
accelerate and peft are never imported; only the probes import torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from typing import Any

from whichdevice import probing
from whichdevice.errors import DeviceError, DeviceUnavailableError, DoesNotFitError
from whichdevice.packages import package_version
from whichdevice.registry import backends
from whichdevice.report.environment import environment
from whichdevice.report.findings import other_warnings
from whichdevice.report.rows import backend_row
from whichdevice.resolver import TASKS, parse_device, resolve_device

__all__ = [
    "SCHEMA_VERSION",
    "SIMULATED_NOTICE",
    "VERSION_PACKAGES",
    "error_dict",
    "exit_code_for",
    "gather",
    "load_schema",
    "package_versions",
    "simulation",
    "simulation_dict",
]

# Major: a field removed or changed meaning (consumers must adapt); minor: fields added.
SCHEMA_VERSION = "1.0"

# The packages whose versions decide how a Transformers program picks its device.
VERSION_PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "kernels")

SIMULATED_NOTICE = "SIMULATED hardware: this report describes the machine given by --simulate, not this one"


def load_schema() -> dict[str, Any]:
    """The JSON schema of every ``--json`` output (``report_schema.json``, shipped in the package)."""
    text = resources.files("whichdevice").joinpath("report_schema.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def package_versions() -> dict[str, str | None]:
    """python plus the packages that steer device choice, from metadata (nothing is imported)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSION_PACKAGES:
        out[name] = package_version(name)
    out["whichdevice"] = package_version("whichdevice")
    return out


def exit_code_for(exc: BaseException) -> int:
    """1 when the hardware cannot do what was asked, 2 when the request itself is wrong."""
    if isinstance(exc, (DeviceUnavailableError, DoesNotFitError)):
        return 1
    if isinstance(exc, DeviceError):
        return 2
    return 1


def error_dict(exc: BaseException) -> dict[str, Any]:
    """An exception as the ``error`` object of every ``--json`` output."""
    return {"type": type(exc).__name__, "message": str(exc), "exit_code": exit_code_for(exc)}


@contextlib.contextmanager
def simulation(specs: Sequence[str]) -> Iterator[Any]:
    """``whichdevice.testing.simulate(*specs)`` when specs are given, else nothing."""
    if not specs:
        yield None
        return
    from whichdevice.testing import simulate

    with simulate(*specs) as sim:
        yield sim


def simulation_dict(specs: Sequence[str]) -> dict[str, Any] | None:
    """The ``simulation`` object of a ``--json`` output: the specs and the notice, or None."""
    return {"specs": list(specs), "notice": SIMULATED_NOTICE} if specs else None


def gather(
    *,
    tasks: Sequence[str] = TASKS,
    device: str | None = None,
    simulate: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The whole report as a JSON-safe dict (see ``report_schema.json``).

    ``device`` is resolved as ``resolve_device(device)`` would; ``simulate`` specs go to
    ``whichdevice.testing.simulate``. Resolution failures are part of the report (the rest of
    it is what a person needs to understand them); an invalid ``device`` string raises.
    """
    for task in tasks:
        if task not in TASKS:
            raise DeviceError(f"task={task!r}: use 'inference' or 'training'")
    if device is not None:
        parse_device(device, "--device")
    # The user's environment as it was before any probe ran: env-setup hooks (Gaudi's
    # PT_ENABLE_INT64_SUPPORT) may set variables while probing, and the report must show
    # what the user exported, with what whichdevice added said separately.
    env = dict(os.environ if environ is None else environ)
    with simulation(simulate):
        results = probing.probe_all()
        resolutions = [_resolve(task, device) for task in tasks]
        calibration_entry = _calibration()
    rows = [backend_row(b, r) for b, r in zip(backends(), results, strict=True)]
    versions = package_versions()
    entries, env_warnings = environment(env, {r.backend: r for r in results}, resolutions, device)
    return {
        "kind": "report",
        "schema_version": SCHEMA_VERSION,
        "simulated": bool(simulate),
        "simulation": simulation_dict(simulate),
        "request": {"tasks": list(tasks), "device": device},
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "versions": versions,
        "backends": rows,
        "environment": entries,
        "warnings": env_warnings + other_warnings(env, results, resolutions, versions),
        "resolutions": resolutions,
        "calibration": calibration_entry,
        "exit_code": max((r["error"]["exit_code"] for r in resolutions if r["error"]), default=0),
    }


def _calibration() -> dict[str, Any]:
    """The CPU's calibration as the resolutions used it (cached or simulated figures, never measured here)."""
    from whichdevice.calibration import calibration

    calib, why = calibration(measure=False)
    return {"figures": calib.to_dict() if calib else None, "spec": calib.spec() if calib else None, "why": why}


def _resolve(task: str, device: str | None) -> dict[str, Any]:
    try:
        res = resolve_device(device, task=task)
    except DeviceError as exc:
        return {"task": task, "ok": False, "resolution": None, "explanation": None, "error": error_dict(exc)}
    return {
        "task": task,
        "ok": True,
        "resolution": res.to_dict(),
        "explanation": res.explain(),
        "error": None,
    }
