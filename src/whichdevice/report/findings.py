"""The WARNINGS section: what works but is probably not what the user meant, each said once.

Sources: the probes' own warnings, what the installed stack cannot run on (``incompatible``), GPUs
of different models numbered differently by CUDA and nvidia-smi, a kernels package transformers
ignores, an accelerate too old for Gaudi, and what the resolver found while deciding. The
environment section adds its own (see ``environment.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from whichdevice.core.packages import version_before
from whichdevice.core.records import ProbeResult
from whichdevice.hardware.plugin_loading import plugin_problems
from whichdevice.hardware.registry import backends
from whichdevice.report.third_party import third_party_warnings

__all__ = ["ACCELERATE_MIN_FOR_GAUDI", "dedupe", "other_warnings", "warning"]

# Gaudi needs accelerate 1.5.0: before it, transformers and accelerate ignore HPUs.
ACCELERATE_MIN_FOR_GAUDI = "1.5.0"


def warning(source: str, message: str) -> dict[str, str]:
    """One ``warnings`` entry: who found it ("environment", "probe:hpu", ...) and what it says."""
    return {"source": source, "message": message}


def hides_every_device(value: str) -> bool:
    """A visible-devices value that leaves no device at all ("" or "-1")."""
    return value.strip() in ("", "-1")


def other_warnings(
    env: Mapping[str, str],
    results: Sequence[ProbeResult],
    resolutions: Sequence[dict[str, Any]],
    versions: Mapping[str, str | None],
) -> list[dict[str, str]]:
    """Every warning but the environment section's own, without repeats."""
    warnings = _probe_warnings(env, results)
    # A plugin that did not load is left out of detection; the report says so, with its package.
    warnings += [warning(f"plugin:{name}", message) for name, message in plugin_problems().items()]
    warnings += [warning(f"compatibility:{r.backend}", m) for r in results for m in r.incompatible]
    warnings += _numbering_warnings(env, results)
    warnings += _package_warnings(versions)
    warnings += third_party_warnings(env, results, versions)
    warnings += _resolution_warnings(resolutions, {w["message"] for w in warnings})
    return dedupe(warnings)


def _probe_warnings(env: Mapping[str, str], results: Sequence[ProbeResult]) -> list[dict[str, str]]:
    visible = {var for b in backends() for var in b.visible_devices_env}
    hidden = {var for var in visible if var in env and hides_every_device(env[var])}
    out = []
    for result in results:
        for w in result.warnings:
            # The environment section already said that this variable hides every device.
            if any(w.startswith(var) and "hides every" in w for var in hidden):
                continue
            out.append(warning(f"probe:{result.backend}", w))
    return out


def _numbering_warnings(env: Mapping[str, str], results: Sequence[ProbeResult]) -> list[dict[str, str]]:
    # CUDA_DEVICE_ORDER is read by the CUDA runtime, so only the cuda row can be misnumbered.
    cuda = next((r for r in results if r.backend == "cuda"), None)
    if cuda is None or not cuda.available or env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return []
    names = sorted({d.name for d in cuda.devices if d.name})
    if len(names) < 2 or any("CUDA_DEVICE_ORDER" in w for w in cuda.warnings):
        return []
    return [
        warning(
            "environment",
            f"the GPUs are different models ({', '.join(names)}) and CUDA_DEVICE_ORDER is not "
            "PCI_BUS_ID: CUDA numbers them fastest first, nvidia-smi by PCI bus, so cuda:N may "
            "not be nvidia-smi's GPU N; export CUDA_DEVICE_ORDER=PCI_BUS_ID",
        )
    ]


def _package_warnings(versions: Mapping[str, str | None]) -> list[dict[str, str]]:
    from whichdevice.attention.kernels import kernels_compatibility

    out = []
    if versions.get("kernels") is not None:
        ok, why = kernels_compatibility()
        if not ok:
            out.append(warning("kernels", why))
    accelerate = versions.get("accelerate")
    if accelerate is not None and version_before(accelerate, ACCELERATE_MIN_FOR_GAUDI):
        out.append(
            warning(
                "accelerate",
                f"accelerate {accelerate} is older than {ACCELERATE_MIN_FOR_GAUDI}: transformers and accelerate "
                "ignore Gaudi (hpu) devices before it, and whichdevice needs it: "
                f"pip install 'accelerate>={ACCELERATE_MIN_FOR_GAUDI}'",
            )
        )
    return out


def _resolution_warnings(resolutions: Sequence[dict[str, Any]], seen: set[str]) -> list[dict[str, str]]:
    # Warnings the resolver added that no probe made (a resolution's own findings).
    out = []
    for r in resolutions:
        if not r["ok"]:
            continue
        for step in r["resolution"]["trace"]:
            if step["topic"] == "warning" and step["message"] not in seen:
                seen.add(step["message"])
                out.append(warning(f"resolution:{r['task']}", step["message"]))
    return out


def dedupe(warnings: list[dict[str, str]]) -> list[dict[str, str]]:
    """The warnings in order, each message once."""
    seen: set[str] = set()
    out = []
    for w in warnings:
        if w["message"] not in seen:
            seen.add(w["message"])
            out.append(w)
    return out
