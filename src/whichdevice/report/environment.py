"""The ENVIRONMENT section: each variable that steers device choice, what it does here, its warnings.

The per-backend rows come from the registry: every backend's visible-devices variables
(``Backend.visible_devices_env``) and the variables its env-setup hooks set
(``Backend.env_defaults``), so a backend a plugin registers gets its rows without a line here.
Which build of a runtime reads a visible-devices variable is asked of the parsers in
``whichdevice.hardware.visible``, not listed again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from whichdevice.core.errors import DeviceError
from whichdevice.core.records import Backend, EnvDefault, ProbeResult, Visibility
from whichdevice.device.request import ENV_DEVICE, parse_device
from whichdevice.hardware.registry import backends
from whichdevice.hardware.visible import visible_devices
from whichdevice.launch.accelerate_settings import (
    ENV_MIXED_PRECISION,
    ENV_USE_CPU,
    AccelerateSettings,
    read_accelerate_settings,
)
from whichdevice.launch.distributed import detect_distributed
from whichdevice.report.findings import warning
from whichdevice.report.rows import BUILDS

__all__ = ["environment"]

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")

_DISTRIBUTED_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE")

# What a hook does and did at its stage (``EnvDefault.stage``): "when it probes hpu", "because it found hpu".
_STAGE_VERBS = {"import": ("probes", "found"), "select": ("picks", "picked")}

Warnings = list[dict[str, str]]


def environment(
    env: Mapping[str, str],
    results: Mapping[str, ProbeResult],
    resolutions: Sequence[dict[str, Any]],
    device: str | None,
) -> tuple[list[dict[str, Any]], Warnings]:
    """One entry per variable that steers device choice, with what it does here; and its warnings."""
    warnings: Warnings = []
    entries = _visible_entries(env, results, warnings)
    entries.append(_entry("CUDA_DEVICE_ORDER", env, _device_order_effect(env, warnings)))
    entries.append(_entry(ENV_DEVICE, env, _whichdevice_effect(env, device, warnings)))
    entries += _accelerate_entries(env, resolutions, warnings)
    entries += _hook_entries(env, resolutions)
    entries.append(_entry("HF_HUB_OFFLINE", env, _offline_effect(env)))
    entries += _distributed_entries(env, warnings)
    return entries, warnings


def _entry(
    name: str,
    env: Mapping[str, str],
    effect: str,
    group: str | None = None,
    backend: str | None = None,
) -> dict[str, Any]:
    value = env.get(name)
    return {
        "name": name,
        "value": value,
        "set": value is not None,
        "effect": effect,
        "group": group,
        "backend": backend,
    }


def _truth(value: str) -> bool | None:
    # accelerate's str_to_bool: these words only; anything else makes accelerate raise.
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    return None


# ------------------------------------------------------------------------- visible devices


def _visible_entries(env: Mapping[str, str], results: Mapping[str, ProbeResult], warnings: Warnings) -> list[Any]:
    out = []
    seen: set[str] = set()
    for backend in backends():
        for var in backend.visible_devices_env:
            if var in seen:
                continue
            seen.add(var)
            effect, found = _visible_effect(backend, results.get(backend.name), var, env)
            out.append(_entry(var, env, effect, "visible_devices", backend.name))
            warnings += [warning("environment", w) for w in found]
    return out


def _device_noun(backend: Backend) -> str:
    # "GPU" where the registry's hardware says it is one ("NVIDIA GPU, or AMD GPU ...", "Intel GPU").
    return "GPU" if re.search(r"\bGPU\b", backend.hardware) else f"{backend.name} device"


def _reads(backend: Backend, var: str, build: str | None) -> bool:
    try:
        return visible_devices(backend.name, {var: "0"}, variant=build).variable == var
    except DeviceError:
        return True  # it read the variable, and refused the value


def _reading_builds(backend: Backend, var: str) -> tuple[str | None, ...]:
    """The builds whose runtime reads ``var``: (None,) every build, ("rocm",) that one, () none we parse."""
    if _reads(backend, var, None):
        return (None,)
    return tuple(build for build in BUILDS if _reads(backend, var, build))


def _visible_effect(
    backend: Backend, result: ProbeResult | None, var: str, env: Mapping[str, str]
) -> tuple[str, list[str]]:
    builds = _reading_builds(backend, var)
    only = [b for b in builds if b is not None]  # read by these builds and no other
    only_text = " or ".join(BUILDS.get(b, b) for b in only)
    value = env.get(var)
    if value is None:
        if only:
            return f"unset (read only by the {only_text} build of {backend.package})", []
        return f"unset: every {_device_noun(backend)} is visible", []
    if not builds:
        return f"read by the {backend.name} runtime to choose its visible devices", []
    try:
        vis = visible_devices(backend.name, {var: value}, variant=builds[0])
    except DeviceError as exc:
        return f"invalid: {exc}", [str(exc)]
    effect, found = _visible_restriction(backend, var, value, vis)
    this_build = result.variant if result is not None and result.installed else None
    if only and this_build not in only:
        if this_build is not None:
            build = BUILDS.get(this_build, this_build)
            return effect + f" (ignored: this {backend.package} is a {build} build, not {only_text})", []
        effect += f" (read only by the {only_text} build of {backend.package})"
    return effect, found


def _visible_restriction(backend: Backend, var: str, value: str, vis: Visibility) -> tuple[str, list[str]]:
    """What ``var=value`` alone shows of ``backend``'s devices, and what to warn about."""
    what = _device_noun(backend)
    found = list(vis.warnings)
    if vis.ids is None:
        return f"every {what} is visible", found
    if not vis.ids:
        # The parser's own "hides every GPU" notes say less than the warning below. Said here,
        # from the variable alone: a probe may stop before reading it (a CPU-only torch reports
        # "CPU-only build" first), and a forgotten export is the usual cause.
        found = [w for w in found if "hides every" not in w]
        found.append(
            f"{var}={value!r} is exported and hides every {what}; unset it (unset {var}) "
            f"or list the devices to use (export {var}=0,1)"
        )
        return f"hides every {what}: {backend.name} sees none", found
    n = len(vis.ids)
    visible = f"{backend.name}:0" if n == 1 else f"{backend.name}:0..{backend.name}:{n - 1}"
    return f"shows physical {what}{'s' if n > 1 else ''} {', '.join(vis.ids)} as {visible}", found


# ------------------------------------------------------------------------ one variable each


def _device_order_effect(env: Mapping[str, str], warnings: Warnings) -> str:
    order = env.get("CUDA_DEVICE_ORDER")
    if order is None:
        return (
            "unset: CUDA numbers GPUs fastest first, which can differ from nvidia-smi's PCI order "
            "(CUDA_DEVICE_ORDER=PCI_BUS_ID makes them match)"
        )
    if order == "PCI_BUS_ID":
        return "CUDA numbers GPUs in PCI bus order, as nvidia-smi does"
    if order == "FASTEST_FIRST":
        return "CUDA numbers GPUs fastest first (the default); nvidia-smi's numbering may differ"
    warnings.append(warning("environment", f"CUDA_DEVICE_ORDER={order!r} is not FASTEST_FIRST or PCI_BUS_ID"))
    return f"invalid: CUDA accepts FASTEST_FIRST or PCI_BUS_ID, not {order!r}"


def _whichdevice_effect(env: Mapping[str, str], device: str | None, warnings: Warnings) -> str:
    value = env.get(ENV_DEVICE)
    if value is None:
        return f"unset: whichdevice detects the device (set it to force one, e.g. {ENV_DEVICE}=cuda:1)"
    if not value.strip():
        return "set but empty: ignored, whichdevice detects the device"
    try:
        parse_device(value, ENV_DEVICE)
    except DeviceError as exc:
        warnings.append(warning("environment", str(exc)))
        return f"invalid: {exc}"
    if device is not None:
        return f"ignored here: --device {device} wins (an explicit device beats {ENV_DEVICE})"
    return f"whichdevice uses {value} unless the program passes device= (beats detection)"


def _offline_effect(env: Mapping[str, str]) -> str:
    offline = env.get("HF_HUB_OFFLINE")
    if offline is None:
        return "unset: from_pretrained and Hub kernels may download from the Hugging Face Hub"
    if _truth(offline):
        return "offline: from_pretrained and Hub kernels use only the local cache"
    return "online: from_pretrained and Hub kernels may download from the Hugging Face Hub"


def _accelerate_entries(
    env: Mapping[str, str], resolutions: Sequence[dict[str, Any]], warnings: Warnings
) -> list[dict[str, Any]]:
    settings = read_accelerate_settings(env)
    if settings.config_problem:
        warnings.append(warning("accelerate", settings.config_problem))
    return [
        _entry(ENV_USE_CPU, env, _use_cpu_effect(env, resolutions, warnings) + settings.launch_exports("use_cpu")),
        _entry(
            ENV_MIXED_PRECISION,
            env,
            _mixed_precision_effect(settings) + settings.launch_exports("mixed_precision"),
        ),
        _entry("ACCELERATE_TORCH_DEVICE", env, _torch_device_effect(env, warnings)),
    ]


def _mixed_precision_effect(settings: AccelerateSettings) -> str:
    raw = settings.mixed_precision
    if raw is None:
        return "unset: Trainer trains in the precision training_arguments() passes (bf16=/fp16=)"
    problems = [p for p in settings.problems() if p.startswith(ENV_MIXED_PRECISION)]
    if problems:  # the resolutions' traces carry the warning
        return f"invalid: {problems[0]}"
    asked = settings.precision
    if asked is None:
        return "no: accelerate's default; bf16=True or fp16=True passed to TrainingArguments overrides it"
    # A precision other than whichdevice's is a warning of the training resolution's trace.
    return f"Trainer trains in {asked} unless bf16=True or fp16=True is passed; training_arguments() follows it"


def _use_cpu_effect(env: Mapping[str, str], resolutions: Sequence[dict[str, Any]], warnings: Warnings) -> str:
    use_cpu = env.get(ENV_USE_CPU)
    if use_cpu is None:
        return "unset: accelerate and Trainer use the accelerator they find"
    truth = _truth(use_cpu)
    if truth is None:
        # the resolutions' traces carry the warning
        return f"invalid: accelerate and TrainingArguments raise ValueError on {use_cpu!r} (use 1 or 0)"
    if not truth:
        return "false: no effect"
    others = sorted({r["resolution"]["backend"] for r in resolutions if r["ok"]} - {"cpu"})
    if others:
        warnings.append(
            warning(
                "environment",
                f"ACCELERATE_USE_CPU={use_cpu!r} makes accelerate and Trainer train on the CPU (whichdevice's "
                f"training resolution follows it) although this machine has {', '.join(others)}; unset "
                "ACCELERATE_USE_CPU to train on the accelerator",
            )
        )
    return "accelerate and Trainer run on the CPU whatever accelerator is present"


def _torch_device_effect(env: Mapping[str, str], warnings: Warnings) -> str:
    torch_device = env.get("ACCELERATE_TORCH_DEVICE")
    if torch_device is None:
        return "unset: accelerate picks the device itself"
    try:
        parse_device(torch_device, "ACCELERATE_TORCH_DEVICE")
    except DeviceError as exc:
        warnings.append(warning("environment", f"{exc} (accelerate passes it to torch.device())"))
        return f"invalid: {exc}"
    return (
        f"accelerate's PartialState and TrainingArguments use {torch_device!r} in a single process "
        "when they find no other accelerator"
    )


# ------------------------------------------------------------------------ env-setup hooks


def _hook_entries(env: Mapping[str, str], resolutions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each variable a backend's env-setup hook sets, and whether whichdevice set it in this run."""
    set_here = {
        action["name"]: action["value"]
        for r in resolutions
        if r["ok"]
        for action in r["resolution"]["env_set"]
        if action["action"] == "set"
    }
    out = []
    seen: set[str] = set()
    for backend in backends():
        for default in backend.env_defaults:
            if default.name in seen:
                continue
            seen.add(default.name)
            effect = _hook_effect(backend, default, env.get(default.name), set_here.get(default.name))
            out.append(_entry(default.name, env, effect, backend=backend.name))
    return out


def _hook_effect(backend: Backend, default: EnvDefault, value: str | None, set_to: str | None) -> str:
    will, did = _STAGE_VERBS.get(default.stage, ("uses", "used"))
    if value is not None:
        if value.strip() == default.value:
            return f"the value {backend.name} wants: {default.why}"
        return f"kept as you set it, though {backend.name} wants {default.name}={default.value} because {default.why}"
    if set_to is not None:
        return f"unset: whichdevice set it to {set_to} for this run because it {did} {backend.name}"
    return f"unset: whichdevice sets it to {default.value} when it {will} {backend.name}, because {default.why}"


# ---------------------------------------------------------------------------- distributed


def _distributed_entries(env: Mapping[str, str], warnings: Warnings) -> list[dict[str, Any]]:
    try:
        dist = detect_distributed(env)
        problem = None
    except DeviceError as exc:
        dist, problem = None, str(exc)
        warnings.append(warning("environment", problem))
    if dist is not None and not dist.seen:
        warnings.append(
            warning(
                "environment",
                f"{dist.launcher}: {dist.world_size} processes that transformers does not see; training is "
                f"refused until you export {' '.join(dist.missing)} (see docs/distributed.md)",
            )
        )
    out = []
    for var in _DISTRIBUTED_VARS:
        value = env.get(var)
        if problem is not None and value is not None:
            effect = f"invalid: {problem}"
        elif value is None and dist is not None and dist.seen:
            effect = (
                f"unset: taken as {dist.rank} (LOCAL_RANK)" if var == "RANK" else f"unset: taken as {dist.world_size}"
            )
        elif value is None:
            effect = "unset: a single process (torchrun and accelerate launch set it)"
        elif var == "LOCAL_RANK":
            launched = f" ({dist.launcher})" if dist is not None else ""
            effect = f"local rank {value}{launched}: this process uses device index {value} of its backend"
        elif var == "RANK":
            effect = f"global rank {value}"
        else:
            effect = f"{value} process{'es' if value.strip() != '1' else ''} in the run"
        if dist is not None and not dist.seen and value is not None:
            effect += " (accelerate does not see the run without LOCAL_RANK)"
        elif dist is None and problem is None and value is not None and var != "LOCAL_RANK":
            effect += " (no effect without LOCAL_RANK)"
        out.append(_entry(var, env, effect, "distributed"))
    return out
