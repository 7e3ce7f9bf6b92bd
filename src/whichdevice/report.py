"""The data behind the ``whichdevice`` command: gathered as JSON-safe dicts, rendered as text.

:func:`gather` builds the report (registry rows, the environment that steers device choice,
warnings, the resolutions, package versions) in the shape that ``report_schema.json`` documents;
:func:`render_text` turns it into the text a person reads or pastes into an issue. Gathering is
fast on purpose: versions come from package metadata, so transformers, accelerate and peft are
never imported; only the probes import torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from typing import Any, ClassVar

from whichdevice import probing
from whichdevice.distributed import detect_distributed
from whichdevice.errors import DeviceError, DeviceUnavailableError, DoesNotFitError
from whichdevice.packages import package_version, version_before
from whichdevice.records import Backend, ProbeResult
from whichdevice.registry import backends
from whichdevice.resolver import ENV_DEVICE, TASKS, parse_device, resolve_device
from whichdevice.visible import Visibility, parse_cuda, parse_habana, visible_devices

__all__ = [
    "SCHEMA_VERSION",
    "VERSION_PACKAGES",
    "exit_code_for",
    "gather",
    "load_schema",
    "package_versions",
    "render_text",
    "simulation",
    "use_color",
]

# Major: a field removed or changed meaning (consumers must adapt); minor: fields added.
SCHEMA_VERSION = "1.0"

# The packages whose versions decide how a Transformers program picks its device.
VERSION_PACKAGES = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "kernels")

# Gaudi needs accelerate 1.5.0: before it, transformers and accelerate ignore HPUs.
ACCELERATE_MIN_FOR_GAUDI = "1.5.0"

SIMULATED_NOTICE = "SIMULATED hardware: this report describes the machine given by --simulate, not this one"

_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")

# Variables read by the ROCm build of torch only (CUDA builds ignore them).
_ROCM_ONLY = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")

_DISTRIBUTED_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE")


# ------------------------------------------------------------------------------------ helpers


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


def _error_dict(exc: BaseException) -> dict[str, Any]:
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


def _truth(value: str) -> bool | None:
    # accelerate's str_to_bool: these words only; anything else makes accelerate raise.
    low = value.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    return None


def _memory(nbytes: int | None) -> str | None:
    if not nbytes:
        return None
    gib = nbytes / 1024**3
    if gib >= 1024:
        return f"{gib / 1024:.1f} TiB"
    return f"{gib:.0f} GiB" if gib >= 10 else f"{gib:.1f} GiB"


# ---------------------------------------------------------------------------------- gathering


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
    rows = [_backend_row(b, r) for b, r in zip(backends(), results, strict=True)]
    by_name = {r.backend: r for r in results}
    versions = package_versions()
    environment, env_warnings = _environment(env, by_name, resolutions, device)
    warnings = env_warnings + _other_warnings(env, results, resolutions, versions)
    simulated = bool(simulate)
    return {
        "kind": "report",
        "schema_version": SCHEMA_VERSION,
        "simulated": simulated,
        "simulation": {"specs": list(simulate), "notice": SIMULATED_NOTICE} if simulated else None,
        "request": {"tasks": list(tasks), "device": device},
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        },
        "versions": versions,
        "backends": rows,
        "environment": environment,
        "warnings": warnings,
        "resolutions": resolutions,
        "exit_code": max((r["error"]["exit_code"] for r in resolutions if r["error"]), default=0),
    }


def _resolve(task: str, device: str | None) -> dict[str, Any]:
    try:
        res = resolve_device(device, task=task)
    except DeviceError as exc:
        return {"task": task, "ok": False, "resolution": None, "explanation": None, "error": _error_dict(exc)}
    return {
        "task": task,
        "ok": True,
        "resolution": res.to_dict(),
        "explanation": res.explain(),
        "error": None,
    }


def _backend_row(backend: Backend, result: ProbeResult) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": backend.name,
        "hardware": backend.hardware,
        "package": backend.package,
        "install_command": backend.install_command,
        "visible_devices_env": list(backend.visible_devices_env),
        "distributed_backend": backend.distributed_backend,
        "status": "available" if result.available else ("unavailable" if result.installed else "not installed"),
        "version": result.versions.get(backend.package),
        "summary": _device_summary(backend, result),
    }
    probe = result.to_dict()
    probe.pop("backend")
    row.update(probe)
    return row


def _device_summary(backend: Backend, result: ProbeResult) -> str:
    """ "8 x GAUDI2 (96 GiB)"-style text for the devices a probe found ("" when none)."""
    if not result.available:
        return ""
    groups: dict[tuple[Any, ...], int] = {}
    for d in result.devices:
        key = (d.name, d.total_memory, d.capability)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for (name, memory, capability), n in groups.items():
        details = [x for x in (_memory(memory), f"cc {capability[0]}.{capability[1]}" if capability else None) if x]
        what = name or "model unknown"
        if backend.name == "cpu" and memory:
            details = [f"{_memory(memory)} RAM"]
        text = f"{n} x {what}" if n > 1 else what
        parts.append(text + (f" ({', '.join(details)})" if details else ""))
    count = result.device_count
    head = f"{count} device{'s' if count != 1 else ''}"
    summary = f"{head}: {'; '.join(parts)}" if parts else head
    if len(groups) == 1 and count > 1:
        summary = parts[0]  # "8 x GAUDI2 (96 GiB)" already says how many
    if backend.name == "cpu":
        flags = sorted(result.features)
        native = bool(result.devices and result.devices[0].bf16)
        if flags:
            summary += (
                f", {'native' if native else 'emulated'} bf16 ({', '.join(flags)}{'' if native else ' turned off'})"
            )
        else:
            summary += ", no native bf16"
    if result.variant and backend.name == "cuda":
        summary += f", {'ROCm' if result.variant == 'rocm' else 'CUDA'} build"
    return summary


# -------------------------------------------------------------------------------- environment


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


def _warning(source: str, message: str) -> dict[str, str]:
    return {"source": source, "message": message}


def _environment(
    env: Mapping[str, str],
    results: Mapping[str, ProbeResult],
    resolutions: Sequence[dict[str, Any]],
    device: str | None,
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """One entry per variable that steers device choice, with what it does here; and its warnings."""
    entries: list[dict[str, Any]] = []
    warnings: list[dict[str, str]] = []
    seen: set[str] = set()
    cuda = results.get("cuda")
    rocm = cuda is not None and cuda.variant == "rocm"
    cuda_build = cuda is not None and cuda.installed and cuda.variant == "cuda"
    for backend in backends():
        for var in backend.visible_devices_env:
            if var in seen:
                continue
            seen.add(var)
            effect, warns = _visible_effect(backend, var, env, rocm=rocm, cuda_build=cuda_build)
            entries.append(_entry(var, env, effect, "visible_devices", backend.name))
            warnings += [_warning("environment", w) for w in warns]

    order = env.get("CUDA_DEVICE_ORDER")
    if order is None:
        effect = (
            "unset: CUDA numbers GPUs fastest first, which can differ from nvidia-smi's PCI order "
            "(CUDA_DEVICE_ORDER=PCI_BUS_ID makes them match)"
        )
    elif order == "PCI_BUS_ID":
        effect = "CUDA numbers GPUs in PCI bus order, as nvidia-smi does"
    elif order == "FASTEST_FIRST":
        effect = "CUDA numbers GPUs fastest first (the default); nvidia-smi's numbering may differ"
    else:
        effect = f"invalid: CUDA accepts FASTEST_FIRST or PCI_BUS_ID, not {order!r}"
        warnings.append(_warning("environment", f"CUDA_DEVICE_ORDER={order!r} is not FASTEST_FIRST or PCI_BUS_ID"))
    entries.append(_entry("CUDA_DEVICE_ORDER", env, effect))

    entries.append(_entry(ENV_DEVICE, env, _whichdevice_effect(env, device, warnings)))
    entries += _accelerate_entries(env, resolutions, warnings)
    entries += _hook_entries(env, resolutions)

    offline = env.get("HF_HUB_OFFLINE")
    if offline is None:
        effect = "unset: from_pretrained and Hub kernels may download from the Hugging Face Hub"
    elif _truth(offline):
        effect = "offline: from_pretrained and Hub kernels use only the local cache"
    else:
        effect = "online: from_pretrained and Hub kernels may download from the Hugging Face Hub"
    entries.append(_entry("HF_HUB_OFFLINE", env, effect))

    entries += _distributed_entries(env, warnings)
    return entries, warnings


def _visibility_alone(backend: Backend, var: str, value: str) -> Visibility | None:
    """How the runtime reads ``var=value`` on its own (None: whichdevice has no parser for it)."""
    alone = {var: value}
    if var == "CUDA_VISIBLE_DEVICES":
        return parse_cuda(alone)
    if var in _ROCM_ONLY:
        return parse_cuda(alone, rocm=True)
    if var.startswith("HABANA_VISIBLE_"):
        return parse_habana(alone)
    if backend.visible_devices_env and var == backend.visible_devices_env[0]:
        return visible_devices(backend.name, alone)
    return None


def _visible_effect(
    backend: Backend, var: str, env: Mapping[str, str], *, rocm: bool, cuda_build: bool
) -> tuple[str, list[str]]:
    value = env.get(var)
    what = "GPU" if backend.name == "cuda" else f"{backend.name} device"
    ignored = var in _ROCM_ONLY and cuda_build
    if value is None:
        if var in _ROCM_ONLY:
            return "unset (read only by the ROCm build of torch)", []
        return f"unset: every {what} is visible", []
    try:
        vis = _visibility_alone(backend, var, value)
    except DeviceError as exc:
        return f"invalid: {exc}", [str(exc)]
    if vis is None:
        return f"read by the {backend.name} runtime to choose its visible devices", []
    warnings = list(vis.warnings)
    if vis.ids is None:
        effect = f"every {what} is visible"
    elif not vis.ids:
        effect = f"hides every {what}: {backend.name} sees none"
        # The parser's own "hides every GPU" notes say less than the warning below.
        warnings = [w for w in warnings if "hides every" not in w]
        # Said here, from the variable alone: a probe may stop before reading it (a CPU-only
        # torch reports "CPU-only build" first), and a forgotten export is the usual cause.
        warnings.append(
            f"{var}={value!r} is exported and hides every {what}; unset it (unset {var}) "
            f"or list the devices to use (export {var}=0,1)"
        )
    else:
        n = len(vis.ids)
        visible = f"{backend.name}:0" if n == 1 else f"{backend.name}:0..{backend.name}:{n - 1}"
        effect = f"shows physical {what}{'s' if n > 1 else ''} {', '.join(vis.ids)} as {visible}"
    if var in _ROCM_ONLY:
        if ignored:
            return effect + " (ignored: this torch is a CUDA build, not ROCm)", []
        if not rocm:
            effect += " (read only by the ROCm build of torch)"
    return effect, warnings


def _whichdevice_effect(env: Mapping[str, str], device: str | None, warnings: list[dict[str, str]]) -> str:
    value = env.get(ENV_DEVICE)
    if value is None:
        return f"unset: whichdevice detects the device (set it to force one, e.g. {ENV_DEVICE}=cuda:1)"
    if not value.strip():
        return "set but empty: ignored, whichdevice detects the device"
    try:
        parse_device(value, ENV_DEVICE)
    except DeviceError as exc:
        warnings.append(_warning("environment", str(exc)))
        return f"invalid: {exc}"
    if device is not None:
        return f"ignored here: --device {device} wins (an explicit device beats {ENV_DEVICE})"
    return f"whichdevice uses {value} unless the program passes device= (beats detection)"


def _resolved_backends(resolutions: Sequence[dict[str, Any]]) -> set[str]:
    return {r["resolution"]["backend"] for r in resolutions if r["ok"]}


def _accelerate_entries(
    env: Mapping[str, str], resolutions: Sequence[dict[str, Any]], warnings: list[dict[str, str]]
) -> list[dict[str, Any]]:
    out = []
    use_cpu = env.get("ACCELERATE_USE_CPU")
    if use_cpu is None:
        effect = "unset: accelerate and Trainer use the accelerator they find"
    else:
        truth = _truth(use_cpu)
        if truth is None:
            effect = f"invalid: accelerate and TrainingArguments raise ValueError on {use_cpu!r} (use 1 or 0)"
            warnings.append(_warning("environment", f"ACCELERATE_USE_CPU={use_cpu!r} is not a truth value; {effect}"))
        elif truth:
            effect = "accelerate and Trainer run on the CPU whatever accelerator is present"
            others = sorted(_resolved_backends(resolutions) - {"cpu"})
            if others:
                warnings.append(
                    _warning(
                        "environment",
                        f"ACCELERATE_USE_CPU={use_cpu!r} makes accelerate and Trainer use the CPU, while whichdevice "
                        f"resolved {', '.join(others)}; unset ACCELERATE_USE_CPU to train on the accelerator",
                    )
                )
        else:
            effect = "false: no effect"
    out.append(_entry("ACCELERATE_USE_CPU", env, effect))

    torch_device = env.get("ACCELERATE_TORCH_DEVICE")
    if torch_device is None:
        effect = "unset: accelerate picks the device itself"
    else:
        effect = (
            f"accelerate's PartialState and TrainingArguments use {torch_device!r} in a single process "
            "when they find no other accelerator"
        )
        try:
            parse_device(torch_device, "ACCELERATE_TORCH_DEVICE")
        except DeviceError as exc:
            effect = f"invalid: {exc}"
            warnings.append(_warning("environment", f"{exc} (accelerate passes it to torch.device())"))
    out.append(_entry("ACCELERATE_TORCH_DEVICE", env, effect))
    return out


# What each env-setup hook variable (the registry's EnvDefault records) does here: unset, "1",
# any other value, and unset but set by whichdevice during this run.
_HOOK_EFFECTS = {
    "PT_ENABLE_INT64_SUPPORT": (
        "unset: Gaudi (hpu) lacks int64 support; whichdevice sets it to 1 when it probes hpu",
        "Gaudi (hpu) supports int64 tensors (token ids)",
        "Gaudi (hpu) runs without int64 support: token ids may fail or be truncated",
        "unset: whichdevice set it to 1 for this run because it found hpu",
    ),
    "PYTORCH_ENABLE_MPS_FALLBACK": (
        "unset: an operator MPS lacks raises; whichdevice sets it to 1 when it picks mps",
        "operators MPS lacks run on the CPU instead of raising",
        "operators MPS lacks raise an error",
        "unset: whichdevice set it to 1 for this run because it picked mps",
    ),
}


def _hook_entries(env: Mapping[str, str], resolutions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Variables that env-setup hooks set; say when whichdevice set one in this run."""
    set_here = {
        action["name"]: action["value"]
        for r in resolutions
        if r["ok"]
        for action in r["resolution"]["env_set"]
        if action["action"] == "set"
    }
    out = []
    for name, (unset, on, off, set_by_us) in _HOOK_EFFECTS.items():
        value = env.get(name)
        if value is not None:
            out.append(_entry(name, env, on if value.strip() == "1" else off))
        else:
            out.append(_entry(name, env, set_by_us if name in set_here else unset))
    return out


def _distributed_entries(env: Mapping[str, str], warnings: list[dict[str, str]]) -> list[dict[str, Any]]:
    try:
        dist = detect_distributed(env)
        problem = None
    except DeviceError as exc:
        dist, problem = None, str(exc)
        warnings.append(_warning("environment", problem))
    out = []
    for var in _DISTRIBUTED_VARS:
        value = env.get(var)
        if problem is not None and value is not None:
            effect = f"invalid: {problem}"
        elif value is None and dist is not None:
            effect = (
                f"unset: taken as {dist.rank} (LOCAL_RANK)" if var == "RANK" else f"unset: taken as {dist.world_size}"
            )
        elif value is None:
            effect = "unset: a single process (torchrun and accelerate launch set it)"
        elif var == "LOCAL_RANK":
            effect = f"local rank {value}: this process uses device index {value} of its backend"
        elif var == "RANK":
            effect = f"global rank {value}"
        else:
            effect = f"{value} process{'es' if value.strip() != '1' else ''} in the run"
        if dist is None and problem is None and value is not None and var != "LOCAL_RANK":
            effect += " (no effect without LOCAL_RANK)"
        out.append(_entry(var, env, effect, "distributed"))
    return out


# ----------------------------------------------------------------------------------- warnings


def _other_warnings(
    env: Mapping[str, str],
    results: Sequence[ProbeResult],
    resolutions: Sequence[dict[str, Any]],
    versions: Mapping[str, str | None],
) -> list[dict[str, str]]:
    warnings: list[dict[str, str]] = []
    hidden = {var for var, value in env.items() if var.endswith(_VISIBLE_SUFFIXES) and _hides_all(var, value)}
    for result in results:
        for w in result.warnings:
            # The environment section already said that this variable hides every device.
            if any(w.startswith(var) and "hides every" in w for var in hidden):
                continue
            warnings.append(_warning(f"probe:{result.backend}", w))

    cuda = next((r for r in results if r.backend == "cuda"), None)
    if cuda is not None and cuda.available and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        names = sorted({d.name for d in cuda.devices if d.name})
        already = any("CUDA_DEVICE_ORDER" in w for w in cuda.warnings)
        if len(names) > 1 and not already:
            warnings.append(
                _warning(
                    "environment",
                    f"the GPUs are different models ({', '.join(names)}) and CUDA_DEVICE_ORDER is not "
                    "PCI_BUS_ID: CUDA numbers them fastest first, nvidia-smi by PCI bus, so cuda:N may "
                    "not be nvidia-smi's GPU N; export CUDA_DEVICE_ORDER=PCI_BUS_ID",
                )
            )

    from whichdevice.kernels_support import kernels_compatibility

    if versions.get("kernels") is not None:
        ok, why = kernels_compatibility()
        if not ok:
            warnings.append(_warning("kernels", why))

    accelerate = versions.get("accelerate")
    if accelerate is not None and version_before(accelerate, ACCELERATE_MIN_FOR_GAUDI):
        warnings.append(
            _warning(
                "accelerate",
                f"accelerate {accelerate} is older than 1.5.0: transformers and accelerate ignore Gaudi (hpu) "
                "devices before it, and whichdevice needs it: pip install 'accelerate>=1.5.0'",
            )
        )
    # Warnings the resolver added that no probe made (a resolution's own findings).
    seen = {w["message"] for w in warnings}
    for r in resolutions:
        if not r["ok"]:
            continue
        for step in r["resolution"]["trace"]:
            if step["topic"] == "warning" and step["message"] not in seen:
                seen.add(step["message"])
                warnings.append(_warning(f"resolution:{r['task']}", step["message"]))
    return _dedupe(warnings)


_VISIBLE_SUFFIXES = ("_VISIBLE_DEVICES", "_VISIBLE_MODULES", "_VISIBLE_CORES", "_VISIBLE_CHIPS", "ZE_AFFINITY_MASK")


def _hides_all(var: str, value: str) -> bool:
    return value.strip() in ("", "-1")


def _dedupe(warnings: list[dict[str, str]]) -> list[dict[str, str]]:
    seen: set[str] = set()
    out = []
    for w in warnings:
        if w["message"] not in seen:
            seen.add(w["message"])
            out.append(w)
    return out


# ------------------------------------------------------------------------------------- output


def use_color(stream: Any, environ: Mapping[str, str] | None = None) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (no-color.org) or TERM=dumb."""
    env = os.environ if environ is None else environ
    if env.get("NO_COLOR"):
        return False
    if env.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):
        return False


class Style:
    """ANSI styling that turns into plain text when colour is off."""

    _CODES: ClassVar[dict[str, str]] = {
        "bold": "1",
        "dim": "2",
        "red": "31",
        "green": "32",
        "yellow": "33",
        "cyan": "36",
        "banner": "1;97;45",
    }

    def __init__(self, color: bool) -> None:
        self.color = color

    def __call__(self, text: str, *styles: str) -> str:
        if not self.color or not styles:
            return text
        codes = ";".join(self._CODES[s] for s in styles)
        return f"\033[{codes}m{text}\033[0m"


_ANSI = re.compile(r"\033\[[0-9;]*m")


def _visible_len(text: str) -> int:
    return len(_ANSI.sub("", text))


class _Writer:
    """Lines with a hanging indent, wrapped to the terminal only when there is one."""

    def __init__(self, style: Style, width: int | None) -> None:
        self.style = style
        self.width = width
        self.lines: list[str] = []

    def line(self, text: str = "", indent: int = 0) -> None:
        # Wrap only plain segments: a styled line is short (headings, labels) or wrapped by
        # the caller through ``pair``.
        if self.width is None or _visible_len(text) <= self.width or "\033" in text:
            self.lines.append(text)
            return
        wrapped = textwrap.wrap(
            text, width=self.width, subsequent_indent=" " * indent, break_on_hyphens=False, break_long_words=False
        )
        self.lines.extend(wrapped or [text])

    def pair(self, label: str, text: str, label_width: int, indent: int = 2, label_style: tuple[str, ...] = ()) -> None:
        """``label`` padded to a column, then ``text`` wrapped under itself."""
        pad = " " * indent
        head = pad + label.ljust(label_width) + "  "
        styled_head = pad + self.style(label.ljust(label_width), *label_style) + "  "
        if self.width is None or len(head) + len(text) <= self.width:
            self.lines.append(styled_head + text)
            return
        room = max(self.width - len(head), 30)
        wrapped = textwrap.wrap(text, width=room, break_on_hyphens=False, break_long_words=False) or [""]
        self.lines.append(styled_head + wrapped[0])
        self.lines.extend(" " * len(head) + w for w in wrapped[1:])

    def heading(self, text: str) -> None:
        if self.lines:
            self.lines.append("")
        self.lines.append(self.style(text, "bold", "cyan") if self.style.color else text.upper())


def terminal_width(stream: Any) -> int | None:
    """The terminal's width when ``stream`` is one (for wrapping), else None (no wrapping)."""
    isatty = getattr(stream, "isatty", None)
    try:
        if isatty and isatty():
            return max(shutil.get_terminal_size((100, 24)).columns, 60)
    except (ValueError, OSError):
        pass
    return None


def render_text(report: Mapping[str, Any], *, color: bool = False, width: int | None = None) -> str:
    """The report as text: sections for backends, environment, warnings, resolution, versions."""
    s = Style(color)
    w = _Writer(s, width)
    simulated = bool(report["simulated"])
    if simulated:
        specs = " ".join(report["simulation"]["specs"])
        w.line(s(f" SIMULATED: --simulate {specs} ", "banner") if color else f"*** SIMULATED: --simulate {specs} ***")
        w.line(s(report["simulation"]["notice"], "bold"))
        w.line()

    resolutions = report["resolutions"]
    summary = []
    for r in resolutions:
        if r["ok"]:
            res = r["resolution"]
            summary.append(
                f"{r['task']}: {s(res['device'], 'bold')} ({res['dtype'] or 'checkpoint dtype'}, "
                f"{res['attn_implementation']})"
            )
        else:
            summary.append(f"{r['task']}: {s('no usable device', 'red', 'bold')}")
    version = report["versions"].get("whichdevice") or ""
    w.line(s(f"whichdevice {version}".strip(), "bold") + " - " + "; ".join(summary))

    w.heading("Backends (detection order)")
    name_width = max(len(row["name"]) for row in report["backends"])
    for row in report["backends"]:
        status = row["status"]
        mark = {"available": "+", "unavailable": "!", "not installed": "-"}[status]
        colour = {"available": ("green",), "unavailable": ("yellow",), "not installed": ("dim",)}[status]
        if status == "available":
            pkg = f"{row['package']} {row['version']}" if row["version"] else row["package"]
            detail = f"{row['summary']} [{pkg}]" + (" SIMULATED" if row["simulated"] else "")
        else:
            detail = row["reason"] or ""
            if row["install_command"] not in detail:
                # Every row that is not usable says how to get it, even when the reason is another.
                detail += f" (install: {row['install_command']})"
            if row["version"]:
                detail = f"[{row['package']} {row['version']}] {detail}"
        label = f"{mark} {row['name'].ljust(name_width)}  {status.ljust(13)}"
        w.pair(label, detail, len(label), label_style=colour)

    w.heading("Environment")
    entries = report["environment"]
    var_width = max(len(e["name"]) for e in entries)
    value_width = 12
    # Unset visible-devices variables share one line (each is independent: unset means all
    # visible); LOCAL_RANK/RANK/WORLD_SIZE share one only when none is set (they read together).
    partly_set = {e["group"] for e in entries if e["set"] and e["group"] == "distributed"}
    grouped: dict[str, list[str]] = {}
    for e in entries:
        if not e["set"] and e["group"] is not None and e["group"] not in partly_set:
            grouped.setdefault(e["group"], []).append(e["name"])
    done_groups: set[str] = set()
    for e in entries:
        group = e["group"]
        if not e["set"] and group in grouped:
            if group in done_groups:
                continue
            done_groups.add(group)
            names = grouped[group]
            if group == "visible_devices":
                title, what = "visible devices", "every device is visible"
            else:
                title, what = "/".join(names), "a single process (torchrun and accelerate launch set them)"
            label = title.ljust(var_width) + "  " + "(unset)".ljust(value_width)
            text = f"{what}: {', '.join(names)}" if group == "visible_devices" else what
            w.pair(label, text, len(label), label_style=("dim",))
            continue
        value = "(unset)" if e["value"] is None else repr(e["value"])
        label = e["name"].ljust(var_width) + "  " + value.ljust(value_width)
        bad = e["effect"].startswith(("invalid", "hides every"))
        # The value column already says "(unset)"; the JSON keeps the prefix for readers without it.
        effect = e["effect"] if e["set"] else e["effect"].removeprefix("unset: ")
        w.pair(label, effect, len(label), label_style=("yellow",) if bad else (() if e["set"] else ("dim",)))

    w.heading("Warnings")
    if not report["warnings"]:
        w.line("  none")
    for warning in report["warnings"]:
        w.pair(s("!", "yellow", "bold"), f"{warning['message']} [{warning['source']}]", 1)

    first_trace: list[str] | None = None
    for r in resolutions:
        w.heading(f"Resolution for {r['task']}")
        if not r["ok"]:
            err = r["error"]
            w.pair(s("error", "red", "bold"), f"{err['message']} ({err['type']})", 5)
            continue
        res = r["resolution"]
        settings = [
            f"device={res['device']!r}",
            f"device_map={res['device_map']!r}",
            f"dtype={res['dtype']}",
            f"attn_implementation={res['attn_implementation']!r}",
        ]
        w.pair("from_pretrained", ", ".join(settings), 17)
        if res["training_kwargs"] is not None:
            kwargs = ", ".join(f"{k}={v!r}" for k, v in res["training_kwargs"].items()) or "(nothing to add)"
            w.pair("TrainingArguments", kwargs, 17)
        if res["env_set"]:
            w.pair("environment", "; ".join(a["message"] for a in res["env_set"]), 17)
        trace = r["explanation"].splitlines()
        if first_trace is None:
            first_trace = trace[1:]
            for line in trace:
                w.line("  " + line, indent=17)
        else:
            different = [line for line in trace[1:] if line not in first_trace]
            w.line("  " + trace[0] + (": the same trace as above" if not different else ", where it differs:"))
            for line in different:
                w.line("  " + line, indent=17)

    w.heading("Versions")
    versions = report["versions"]
    w.line("  " + ", ".join(f"{k} {v or 'not installed'}" for k, v in versions.items()), indent=2)
    plat = report["platform"]
    w.line(f"  {plat['system']} {plat['release']} ({plat['machine']})")
    if simulated:
        w.line()
        w.line(
            s(" SIMULATED: the devices above are not this machine's ", "banner")
            if color
            else "*** SIMULATED: the devices above are not this machine's ***"
        )
    return "\n".join(w.lines) + "\n"
