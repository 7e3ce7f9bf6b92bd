"""The Intel Gaudi probe: accelerate's minimum first, the int64 hook before the import, then torch.hpu.

Importing ``habana_frameworks.torch`` registers ``torch.hpu`` and loads the Gaudi software into the
process, so the reader stops before it when accelerate is too old for the result to be usable anyway.
The patches that change torch itself (``torch.gather``, ``take_along_dim``, ``scatter``, and
``torch.compile`` defaulting to the HPU backend) are transformers' own: its
``is_torch_hpu_available()`` installs them on first call (transformers/utils/import_utils.py, 5.25),
and this probe never calls it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from whichdevice.core.frozen import frozen_record
from whichdevice.core.packages import package_version, requirement_on, version_before
from whichdevice.core.records import Backend, ProbeResult
from whichdevice.hardware.envhooks import apply_env_defaults
from whichdevice.hardware.probes.common import (
    finish,
    finish_runtime,
    import_failure,
    installed_versions,
    module_devices,
    not_installed,
    raise_import_error,
    read_env,
    read_module_devices,
)
from whichdevice.hardware.probes.presence import hpu_installed
from whichdevice.hardware.probes.readings import RuntimeReadings
from whichdevice.hardware.visible import Visibility, visible_devices

__all__ = [
    "ENV_VARIABLES",
    "GAUDI_GROUP_SIZES",
    "GAUDI_MODULE_GROUPS",
    "LAZY_MODE_VARIABLE",
    "MODULES_VARIABLE",
    "HpuReadings",
    "accelerate_block",
    "execution_mode",
    "gaudi_generation",
    "hpu_group_warnings",
    "interpret_hpu",
    "probe_hpu",
    "read_hpu",
]

# PT_HPU_LAZY_MODE: 1 lazy mode, 0 eager mode (with torch.compile). Intel's PyTorch Support Matrix
# (docs.habana.ai, PyTorch/Reference/PyTorch_Support_Matrix): eager with torch.compile is the
# default, lazy a legacy fallback; torch.compile(backend="hpu_backend") runs in eager mode only.
LAZY_MODE_VARIABLE = "PT_HPU_LAZY_MODE"
# Stable module ids (hardware/visible.py reads it first, before HABANA_VISIBLE_DEVICES' indices).
MODULES_VARIABLE = "HABANA_VISIBLE_MODULES"
ENV_VARIABLES = (MODULES_VARIABLE, "HABANA_VISIBLE_DEVICES", LAZY_MODE_VARIABLE)

# Intel supports partial-server distributed work only in groups of 2 or 4 Gaudis.
GAUDI_GROUP_SIZES = (2, 4)
# The module ids such a group may take (HABANA_VISIBLE_MODULES), from Intel's "Multiple Workloads on a Single
# Docker" (docs.habana.ai, PyTorch/Reference/PT_Multiple_Tenants_on_HPU), as tgi-gaudi's README quotes it:
# 2-Gaudi "0,1", "2,3", "4,5" or "6,7"; 4-Gaudi "0,1,2,3" or "4,5,6,7". docs/backends/hpu.md lists the same
# (tests/hardware/test_probes_interpret.py compares them). Any other group of 2 or 4 is warned about.
GAUDI_MODULE_GROUPS: tuple[tuple[int, ...], ...] = ((0, 1), (2, 3), (4, 5), (6, 7), (0, 1, 2, 3), (4, 5, 6, 7))

# The generations gaudi_generation() reads from a device name; a new one is added here.
GAUDI_GENERATIONS = ("gaudi1", "gaudi2", "gaudi3")

# transformers' and accelerate's is_torch_hpu_available() is False before this accelerate.
_MIN_ACCELERATE = "1.5.0"


@frozen_record
class HpuReadings(RuntimeReadings):
    """torch.hpu's readings, and the accelerate version (read first: it decides whether to import)."""

    accelerate_version: str | None = None


def accelerate_block(accelerate_version: str | None) -> str | None:
    """Why this accelerate makes Gaudi unusable, or None."""
    if accelerate_version is None or not version_before(accelerate_version, _MIN_ACCELERATE):
        return None
    return (
        f"accelerate {accelerate_version} is too old for Gaudi (transformers and accelerate "
        f"ignore HPUs before {_MIN_ACCELERATE}): pip install 'accelerate>={_MIN_ACCELERATE}'"
    )


def read_hpu(backend: Backend) -> HpuReadings:
    versions = installed_versions(backend)
    if not hpu_installed():
        return HpuReadings(installed=False, versions=versions)
    accelerate = package_version("accelerate")
    if accelerate_block(accelerate) is not None:
        return HpuReadings(accelerate_version=accelerate, versions=versions)
    env_set = apply_env_defaults(backend, "import")
    requires = requirement_on(backend.package, "torch")  # the plugin pins the torch it was built for
    try:
        import habana_frameworks.torch  # noqa: F401 - registers torch.hpu (and patches torch)
    except Exception as exc:
        return HpuReadings(
            import_error=import_failure(exc),
            env_set=env_set,
            accelerate_version=accelerate,
            versions=versions,
            requires_torch=requires,
        )
    import torch

    hpu: Any = getattr(torch, "hpu")  # noqa: B009 - registered at run time by the import above
    available = bool(hpu.is_available())
    count = int(hpu.device_count()) if available else 0
    return HpuReadings(
        env_set=env_set,
        env=read_env(ENV_VARIABLES),
        available=available,
        devices=read_module_devices(hpu, count),
        versions=versions,
        accelerate_version=accelerate,
        requires_torch=requires,
    )


def gaudi_generation(name: str | None) -> str | None:
    """ "gaudi3" for "GAUDI3" or "Intel Gaudi 3"; a Gaudi without a number is the first one."""
    text = name or ""
    gen = re.search(r"gaudi\s*(\d)", text, re.IGNORECASE)
    return f"gaudi{gen.group(1)}" if gen else ("gaudi1" if "gaudi" in text.lower() else None)


def interpret_hpu(backend: Backend, readings: HpuReadings) -> ProbeResult:
    """Every Gaudi computes bf16; its generation comes from the device name."""
    if not readings.installed:
        return not_installed(backend, versions=readings.versions)
    blocked = accelerate_block(readings.accelerate_version)
    if blocked is not None:
        return finish(backend, [], unavailable_reason=blocked, versions=readings.versions)
    raise_import_error(readings, backend)
    vis = visible_devices("hpu", readings.env)
    devices = [
        replace(d, generation=gaudi_generation(d.name), bf16=True) for d in module_devices(readings.devices, vis)
    ]
    result = finish_runtime(backend, readings, vis, devices, hpu_group_warnings(vis))
    return replace(result, features=result.features | {execution_mode(readings.env)})


def execution_mode(env: Mapping[str, str]) -> str:
    """ "execution-mode:lazy", ":eager" or ":default" (PT_HPU_LAZY_MODE unset: the Gaudi software's own)."""
    modes = {"1": "lazy", "0": "eager"}
    return "execution-mode:" + modes.get(env.get(LAZY_MODE_VARIABLE, "").strip(), "default")


def hpu_group_warnings(vis: Visibility) -> list[str]:
    """Intel supports partial-server distributed work only in groups of 2 or 4 Gaudis, of the module ids
    GAUDI_MODULE_GROUPS lists."""
    if vis.ids is None or not vis.ids:
        return []
    n = len(vis.ids)
    if n == 1 or n >= 8:
        return []
    if n not in GAUDI_GROUP_SIZES:
        return [
            f"{vis.variable}={vis.raw!r} selects {n} Gaudi devices; on a partial server Intel supports "
            "distributed work only in groups of 2 or 4 (hl-smi -Q index,module_id -f csv maps indices "
            "to module ids)"
        ]
    modules = tuple(sorted(int(i) for i in vis.ids if i.isdigit()))
    if vis.variable != MODULES_VARIABLE or len(modules) != n or modules in GAUDI_MODULE_GROUPS:
        return []
    groups = " or ".join(",".join(map(str, g)) for g in GAUDI_MODULE_GROUPS if len(g) == n)
    return [
        f"{vis.variable}={vis.raw!r} selects modules {','.join(map(str, modules))}, a group of {n} Intel does not "
        f"list as supported for a partial server; use {groups} (Intel Gaudi documentation, Multiple Workloads "
        "on a Single Docker)"
    ]


def probe_hpu(backend: Backend) -> ProbeResult:
    return interpret_hpu(backend, read_hpu(backend))
