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
from typing import Any, TypeAlias

from whichdevice.core.errors import DeviceError, exit_code_for
from whichdevice.core.packages import known_versions, package_version
from whichdevice.device.request import TASKS, as_task, parse_device
from whichdevice.hardware import probing
from whichdevice.hardware.registry import backends
from whichdevice.report.environment import environment
from whichdevice.report.findings import other_warnings
from whichdevice.report.rows import backend_row
from whichdevice.resolve.resolver import resolve_device

__all__ = [
    "SCHEMA_VERSION",
    "SIMULATED_NOTICE",
    "VERSION_PACKAGES",
    "error_dict",
    "gather",
    "load_schema",
    "package_versions",
    "simulation",
    "simulation_dict",
]

# Major: a field removed or changed meaning (consumers must adapt); minor: fields added.
# 1.1: the report's ``replay`` section and ``simulation.report`` (whichdevice --simulate-report).
# 1.2: a smoke step's ``import_notes`` (what other packages logged while being imported).
# 1.7: the resolution's ``tuning`` (what prepare() installs, one object; the four flat fields it
# holds, ``single_row`` ... ``packing_at_generate``, stay, derived from it, for 1.x readers), its
# ``training_plan.launched`` and ``largest_fit.plan``, and the warning sources calibration and plugin.
# 1.8: a backend row's ``platform`` (NVIDIA on ARM64); the resolution's ``serving``, ``devices``,
# ``load_peak`` and ``tf32``; a device's ``compute_mode``, ``other_processes`` and ``unusable``.
# 1.9: the resolution's ``device_map_passed`` and ``tuning.decode_attention``; ``attn_implementation`` is
# always a name transformers knows (sdpa where 1.8 said whichdevice_sdpa, which prepare() now installs);
# ``largest_fit.model_context`` is stretched by RoPE scaling.
# also 1.9: the resolution's ``training`` (how a training job trains as priced: method, dtypes, gradient
# checkpointing, optimizer, LoRA's rank) and ``training_plan.gradient_checkpointing``.
# 1.10: ``tuning.upcast_above`` (a bf16 load's prompts computed in fp32 from its weights).
SCHEMA_VERSION = "1.10"

# The packages whose versions decide how a Transformers program picks its device.
VERSION_PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "kernels")

# A report to replay: the path of a ``whichdevice --json`` file, or its parsed dict.
Replayable: TypeAlias = "str | os.PathLike[str] | Mapping[str, Any]"

SIMULATED_NOTICE = "SIMULATED hardware: this report describes the machine given by --simulate, not this one"
REPLAY_NOTICE = (
    "SIMULATED hardware: this report replays the machine that wrote the --simulate-report file, not this one"
)


def load_schema() -> dict[str, Any]:
    """The JSON schema of every ``--json`` output (``report_schema.json``, shipped in the package)."""
    text = resources.files("whichdevice").joinpath("report_schema.json").read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def package_versions() -> dict[str, str | None]:
    """python plus the packages that steer device choice, from metadata (nothing is imported)."""
    out: dict[str, str | None] = {"python": _platform()["python"]}
    for name in VERSION_PACKAGES:
        out[name] = package_version(name)
    out["whichdevice"] = package_version("whichdevice")
    return out


def error_dict(exc: BaseException) -> dict[str, Any]:
    """An exception as the ``error`` object of every ``--json`` output."""
    return {"type": type(exc).__name__, "message": str(exc), "exit_code": exit_code_for(exc)}


@contextlib.contextmanager
def simulation(specs: Sequence[str], report: Replayable | None = None) -> Iterator[Any]:
    """``whichdevice.testing.simulate(*specs)`` (or ``simulate(report=report)``) when given, else nothing."""
    if not specs and report is None:
        yield None
        return
    from whichdevice.testing import simulate

    with simulate(*specs, report=report) as sim:
        yield sim


def simulation_dict(specs: Sequence[str], report: Replayable | None = None) -> dict[str, Any] | None:
    """The ``simulation`` object of a ``--json`` output: the specs (or replayed report) and the notice, or None."""
    if report is not None:
        source = os.fspath(report) if isinstance(report, (str, os.PathLike)) else "the report given"
        return {"specs": list(specs), "report": source, "notice": REPLAY_NOTICE}
    return {"specs": list(specs), "notice": SIMULATED_NOTICE} if specs else None


def _platform() -> dict[str, str]:
    from whichdevice.testing.replay import replaying

    machine = replaying()
    if machine is not None and machine.platform:
        return dict(machine.platform)
    return {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


def replay_section(env: Mapping[str, str]) -> dict[str, Any]:
    """The ``replay`` object: what ``--simulate-report`` needs besides the backend rows."""
    from whichdevice.testing.replay import recorded_environment

    return {"environ": recorded_environment(env), "packages": dict(sorted(known_versions().items()))}


def gather(
    *,
    tasks: Sequence[str] = TASKS,
    device: str | None = None,
    simulate: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    simulate_report: Replayable | None = None,
    job: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole report as a JSON-safe dict (see ``report_schema.json``).

    ``job`` (``model``, ``batch_size``, ``max_length``, ``max_new_tokens``, as resolve_device() takes
    them) sizes a model in the resolutions, whose traces then say the longest length and largest
    batch that fit.

    ``device`` is resolved as ``resolve_device(device)`` would; ``simulate`` specs go to
    ``whichdevice.testing.simulate``, ``simulate_report`` (a report's path or dict) to its ``report=``.
    Resolution failures are part of the report (the rest of it is what a person needs to understand
    them); an invalid ``device`` string raises.
    """
    for task in tasks:
        if task not in TASKS:
            raise DeviceError(f"task={task!r}: use 'inference' or 'training'")
    if device is not None:
        parse_device(device, "--device")
    # The user's environment as it was before any probe ran: env-setup hooks (Gaudi's
    # PT_ENABLE_INT64_SUPPORT) may set variables while probing, and the report must show
    # what the user exported, with what whichdevice added said separately.
    # (A replay sets the recorded machine's variables on entering, so the snapshot comes after it.)
    with simulation(simulate, simulate_report):
        env = dict(os.environ if environ is None or simulate_report is not None else environ)
        results = probing.probe_all()
        resolutions = [_resolve(task, device, job) for task in tasks]
        versions = package_versions()
        machine = _platform()
        replay = replay_section(env)
        calibration_entry = _calibration()
    rows = [backend_row(b, r) for b, r in zip(backends(), results, strict=True)]
    entries, env_warnings = environment(env, {r.backend: r for r in results}, resolutions, device)
    simulated = bool(simulate) or simulate_report is not None
    return {
        "kind": "report",
        "schema_version": SCHEMA_VERSION,
        "simulated": simulated,
        "simulation": simulation_dict(simulate, simulate_report),
        "request": {"tasks": list(tasks), "device": device},
        "platform": machine,
        "versions": versions,
        "backends": rows,
        "environment": entries,
        "warnings": env_warnings + other_warnings(env, results, resolutions, versions) + _unsteady(calibration_entry),
        "resolutions": resolutions,
        "calibration": calibration_entry,
        "exit_code": max((r["error"]["exit_code"] for r in resolutions if r["error"]), default=0),
        "replay": replay,
    }


def _calibration() -> dict[str, Any]:
    """The CPU's calibration as the resolutions used it (cached or simulated figures, never measured here)."""
    from whichdevice.measure.calibration import calibration

    calib, why = calibration(measure=False)
    return {"figures": calib.to_dict() if calib else None, "spec": calib.spec() if calib else None, "why": why}


def _unsteady(entry: Mapping[str, Any]) -> list[dict[str, str]]:
    """A calibration a busy machine kept from being steady, named once for the whole report (each
    resolution's trace says only that the CPU's flags decide)."""
    from whichdevice.measure.calibration import UNSTEADY

    figures = entry["figures"]
    moved = figures["unsteady"] if figures else []
    if figures is None and str(entry["why"]).startswith(UNSTEADY):
        return [{"source": "calibration", "message": f"the CPU calibration was not used: {entry['why']}"}]
    if moved:
        message = (
            f"the CPU calibration's {', '.join(moved)} could not be timed steadily: jobs that need them "
            "follow the CPU's flags"
        )
        return [{"source": "calibration", "message": message}]
    return []


def _resolve(task: str, device: str | None, job: Mapping[str, Any] | None = None) -> dict[str, Any]:
    try:
        res = resolve_device(device, task=as_task(task), **{k: v for k, v in (job or {}).items() if v is not None})
    except DeviceError as exc:
        return {"task": task, "ok": False, "resolution": None, "explanation": None, "error": error_dict(exc)}
    return {
        "task": task,
        "ok": True,
        "resolution": res.to_dict(),
        # Every step, each install command included: the text report folds the absent backends itself.
        "explanation": res.explain(verbose=True),
        "error": None,
    }
