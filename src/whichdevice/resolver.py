"""The resolver: device, device_map, dtype, attention and distributed settings, with the reasons.

``resolve_device()`` reads probe results (never hardware directly), so everything here runs the
same on real and simulated machines. Precedence: the ``device`` argument, then the
``WHICHDEVICE_DEVICE`` variable, then detection in the registry's declared order; each step that
mattered is kept in the trace that :meth:`Resolution.explain` prints.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from whichdevice import packages, probing
from whichdevice.attention import choose_attention
from whichdevice.decode_attention import ATTENTION_NAME, ensure_registered
from whichdevice.distributed import LAUNCHER_VARIABLES, DistributedContext, detect_distributed, process_group_backend
from whichdevice.envhooks import EnvAction, apply_env_defaults
from whichdevice.errors import (
    ConfigConflictError,
    DeviceError,
    DeviceUnavailableError,
    UnknownDeviceError,
    closest_match,
)
from whichdevice.precision import choose_dtype, parse_dtype, supports
from whichdevice.records import TraceStep
from whichdevice.registry import _BUILTIN, Backend, backend_names, backends, get_backend, unknown_name_message

if TYPE_CHECKING:
    import torch

    from whichdevice.quantization import QuantizationPlan
    from whichdevice.records import ProbeResult

__all__ = ["ENV_DEVICE", "Resolution", "TraceStep", "parse_device", "resolve_device"]

ENV_DEVICE = "WHICHDEVICE_DEVICE"
TASKS = ("inference", "training")


@dataclass(frozen=True)
class Resolution:
    """The answer: pass ``model_kwargs()`` to from_pretrained, ``training_kwargs()`` to TrainingArguments."""

    device: str
    backend: Backend
    task: str
    device_count: int
    device_map: str | dict[str, Any]
    dtype_name: str | None
    attn_implementation: str
    probe: ProbeResult = field(repr=False)
    max_memory: dict[int | str, str] | None = None
    distributed: DistributedContext | None = None
    env_set: tuple[EnvAction, ...] = ()
    trace: tuple[TraceStep, ...] = field(default=(), repr=False)
    source: str = "detection"
    quantization: QuantizationPlan | None = None
    use_kernels: bool = False
    kernels_key: str | None = None
    torch_compile: bool = False

    def __str__(self) -> str:
        return self.device

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype chosen for this hardware (None: leave it to transformers)."""
        if self.dtype_name is None:
            return None
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype

    @property
    def simulated(self) -> bool:
        return self.probe.simulated

    @property
    def index(self) -> int | None:
        _, _, idx = self.device.partition(":")
        return int(idx) if idx else None

    # ------------------------------------------------------------------------------ adapters

    def model_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``AutoModel*.from_pretrained`` on the installed transformers.

        ``overrides`` replace what whichdevice chose (validated: ``device_map="auto"`` on neuron
        or tpu raises, since Accelerate's "auto" does not cover them).
        """
        kwargs: dict[str, Any] = {"device_map": self.device_map}
        if self.dtype_name is not None:
            kwargs[_dtype_keyword()] = self.dtype
        kwargs["attn_implementation"] = self.attn_implementation
        if self.attn_implementation == ATTENTION_NAME:
            ensure_registered()
        if self.max_memory:
            kwargs["max_memory"] = dict(self.max_memory)
        if self.quantization is not None:
            kwargs["quantization_config"] = self.quantization.config()
        if self.use_kernels:
            kwargs["use_kernels"] = True
        for key in ("dtype", "torch_dtype"):
            if key in overrides:
                kwargs.pop("dtype", None)
                kwargs.pop("torch_dtype", None)
        if "device_map" in overrides:
            _check_device_map(self.backend, overrides["device_map"])
        kwargs.update(overrides)
        return kwargs

    def pipeline_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``transformers.pipeline``."""
        model_kwargs = self.model_kwargs()
        kwargs: dict[str, Any] = {"device_map": model_kwargs.pop("device_map")}
        key = _dtype_keyword()
        if key in model_kwargs:
            kwargs[key] = model_kwargs.pop(key)
        kwargs["model_kwargs"] = model_kwargs
        if "device_map" in overrides:
            _check_device_map(self.backend, overrides["device_map"])
        kwargs.update(overrides)
        return kwargs

    def training_kwargs(self, *, torch_compile: bool | None = None) -> dict[str, Any]:
        """Keyword arguments for ``TrainingArguments``: device, precision, ddp and compile settings."""
        from whichdevice.training_settings import training_kwargs_for

        compile_ = self.torch_compile if torch_compile is None else torch_compile
        return training_kwargs_for(self.backend, self.probe, self.dtype_name, self.distributed, torch_compile=compile_)

    # --------------------------------------------------------------------------- explanation

    def explain(self) -> str:
        """The decision trace as text a person reads top to bottom."""
        header = f"whichdevice chose {self.device} for {self.task}"
        if self.simulated:
            header += " (SIMULATED hardware)"
        width = max((len(s.topic) for s in self.trace), default=8)
        lines = [header]
        for step in self.trace:
            mark = {True: "+", False: "-", None: " "}[step.chosen]
            lines.append(f"  {mark} {step.topic.ljust(width)}  {step.message}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (``whichdevice --json`` embeds it)."""
        return {
            "device": self.device,
            "backend": self.backend.name,
            "variant": self.probe.variant,
            "task": self.task,
            "source": self.source,
            "device_count": self.device_count,
            "device_map": self.device_map,
            "dtype": self.dtype_name,
            "attn_implementation": self.attn_implementation,
            "max_memory": {str(k): v for k, v in self.max_memory.items()} if self.max_memory else None,
            "distributed": self.distributed.to_dict() if self.distributed else None,
            "distributed_backend": process_group_backend(self.backend, self.distributed),
            "env_set": [a.to_dict() for a in self.env_set],
            "quantization": self.quantization.to_dict() if self.quantization else None,
            "use_kernels": self.use_kernels,
            "kernels_key": self.kernels_key,
            "training_kwargs": _json_safe(self.training_kwargs()) if self.task == "training" else None,
            "simulated": self.simulated,
            "trace": [s.to_dict() for s in self.trace],
        }


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _dtype_keyword() -> str:
    # transformers 4.56 renamed from_pretrained's torch_dtype to dtype; read the installed
    # version from metadata so transformers itself is not imported here.
    version = packages.package_version("transformers")
    return "dtype" if version is None or packages.version_at_least(version, "4.56") else "torch_dtype"


def _check_device_map(backend: Backend, device_map: Any) -> None:
    if device_map in ("auto", "balanced", "balanced_low_0", "sequential") and not backend.device_map_auto:
        raise ConfigConflictError(
            f"device_map={device_map!r} does not work on {backend.name}: Accelerate's automatic "
            f"placement does not cover {backend.hardware}; use device_map={backend.name!r}"
        )


# ----------------------------------------------------------------------------- device strings

_DEVICE_RE = re.compile(r"([a-z_][a-z0-9_]*)(?::(.*))?", re.DOTALL)


def parse_device(value: Any, source: str = "device") -> tuple[str, int | None]:
    """Split a device request ("cuda:1", "hpu", torch.device) into (backend name, index or None).

    ``source`` names where the value came from ("device", "WHICHDEVICE_DEVICE") so the error
    points at the thing to fix.
    """
    names = backend_names()
    valid = ", ".join(names)
    if type(value).__name__ == "device" and hasattr(value, "type") and hasattr(value, "index"):
        value = str(value)
    if isinstance(value, bool) or not isinstance(value, str):
        hint = ""
        if isinstance(value, int) and not isinstance(value, bool):
            hint = f" A bare index is ambiguous: write 'cuda:{value}' (or 'npu:{value}', 'xpu:{value}', ...)."
        raise UnknownDeviceError(
            f"{source}={value!r}: a device is a string such as 'cuda', 'cuda:1', 'hpu' or 'cpu', or a "
            f"torch.device, not {type(value).__name__}.{hint} Valid device names: {valid}."
        )
    text = value
    if not text.strip():
        raise UnknownDeviceError(
            f"{source}={value!r} is empty; pass a device such as 'cuda:0' or 'cpu', or leave it out "
            f"to detect one. Valid device names: {valid}."
        )
    if text != text.strip():
        # What is inside must be right too, so that the suggested fix parses.
        parse_device(text.strip(), source)
        raise UnknownDeviceError(f"{source}={value!r} has surrounding spaces; write {text.strip()!r}")
    match = _DEVICE_RE.fullmatch(text)
    name = match.group(1) if match else text.split(":", 1)[0]
    if name not in names:
        lowered = text.lower()
        if lowered != text and lowered.split(":", 1)[0] in names:
            try:
                parse_device(lowered, source)
                fixed = lowered
            except DeviceError:
                fixed = lowered.split(":", 1)[0]
            raise UnknownDeviceError(f"{source}={value!r}: device strings are lower case; write {fixed!r}")
        guess = closest_match(name, names)
        suggestion = f" Did you mean {guess!r}?" if guess else ""
        raise UnknownDeviceError(
            f"{source}={value!r}: unknown device {name!r}.{suggestion} Valid device names: {valid}."
        )
    if match is None or match.group(2) is None:
        if ":" in text:
            raise UnknownDeviceError(f"{source}={value!r}: unexpected text; write {name!r} or '{name}:0'")
        return name, None
    index_text = match.group(2)
    if index_text == "":
        raise UnknownDeviceError(
            f"{source}={value!r}: the index after ':' is missing; write '{name}:0' or just {name!r}"
        )
    if not _is_index(index_text):
        if ":" in index_text:
            first = index_text.split(":")[0]
            raise UnknownDeviceError(
                f"{source}={value!r}: a device has one index; write '{name}:{first if _is_index(first) else 0}'"
            )
        if index_text.startswith("-") and _is_index(index_text[1:]):
            raise UnknownDeviceError(
                f"{source}={value!r}: device indices start at 0; write '{name}:0' or just {name!r}"
            )
        raise UnknownDeviceError(f"{source}={value!r}: {index_text!r} is not a device index; write e.g. '{name}:0'")
    if len(index_text.lstrip("0")) > 7:
        # No machine numbers this many devices; also keeps int() away from its 4300-digit limit.
        raise UnknownDeviceError(
            f"{source}={value!r}: index {index_text[:20]}... is too large to be a device; write e.g. '{name}:0'"
        )
    return name, int(index_text)


def _is_index(text: str) -> bool:
    # ASCII digits only: str.isdigit() also accepts "١" or "²", which int() or torch reject.
    return text.isascii() and text.isdigit()


# ---------------------------------------------------------------------------------- resolving


def _names(values: Any, what: str) -> list[str]:
    if values is None:
        return []
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        # One device ("cuda", a torch.device), or a wrong type that parse_device then names.
        values = [values]
    out = []
    for v in values:
        name, _ = parse_device(v, what)
        out.append(name)
    return out


def _order(prefer: Any, exclude: Any, trace: list[TraceStep]) -> list[Backend]:
    preferred = _names(prefer, "prefer")
    excluded = set(_names(exclude, "exclude"))
    order = [b for b in backends() if b.name not in excluded]
    if preferred:
        rank = {name: i for i, name in enumerate(preferred)}
        order.sort(key=lambda b: rank.get(b.name, len(rank)))
        trace.append(TraceStep("order", f"prefer={preferred} moves them to the front"))
    if excluded:
        trace.append(TraceStep("order", f"exclude={sorted(excluded)} removes them"))
    return order


def _machine_has() -> str:
    found = [
        f"{r.backend} ({r.device_count} device{'s' if r.device_count != 1 else ''})"
        for r in probing.probe_all()
        if r.available
    ]
    return ", ".join(found) or "nothing usable"


def _unavailable(asked: str, backend: Backend, result: ProbeResult, source: str) -> DeviceError:
    where = f"{source}={asked!r}" if source != "device" else f"device {asked!r}"
    fix = "" if source == "device" else f" Fix or unset {source}."
    setting = _visibility_error(backend, result)
    if setting is not None:
        # A visible-devices variable no runtime accepts is a wrong request (exit 2), not missing hardware.
        return DeviceError(f"{where} cannot be used: {setting}")
    reason = result.reason or f"{backend.name} is not available"
    vis = result.visible
    if vis is not None and vis.variable and vis.ids is not None and vis.variable not in reason:
        # The variable chose which devices this process sees: say so, or the user looks elsewhere.
        said = [w for w in result.warnings if vis.variable in w]
        reason += "; " + ("; ".join(said) if said else f"{vis.variable}={vis.raw!r} selects the visible devices")
        reason += f": fix or unset {vis.variable}"
    return DeviceUnavailableError(f"{where} is not usable here: {reason}. This machine has: {_machine_has()}.{fix}")


def _visibility_error(backend: Backend, result: ProbeResult) -> DeviceError | None:
    """The error of a malformed visible-devices variable when that is what stopped the probe."""
    if not result.installed or result.available or result.visible is not None:
        return None
    from whichdevice.visible import visible_devices

    try:
        visible_devices(backend.name, variant=result.variant)
    except DeviceError as exc:
        return exc
    return None


def _index_error(asked: str, backend: Backend, result: ProbeResult, index: int, source: str, why: str) -> DeviceError:
    count = result.device_count
    vis = result.visible
    valid = f"{backend.name}:0..{backend.name}:{count - 1}" if count > 1 else f"{backend.name}:0"
    because = ""
    if vis is not None and vis.variable:
        because = f" because {vis.variable}={vis.raw!r}"
    fix = f" Fix or unset {source}." if source != "device" else ""
    return DeviceUnavailableError(
        f"{why} {asked!r} asks for {backend.name} index {index}, but {count} "
        f"{'is' if count == 1 else 'are'} visible{because}; use {valid}"
        + (f" or change {vis.variable}" if because and vis is not None else "")
        + f".{fix}"
    )


def resolve_device(
    device: Any = None,
    *,
    task: str = "inference",
    model: Any = None,
    prefer: Any = None,
    exclude: Any = None,
    dtype: Any = "auto",
    attn_implementation: str = "auto",
    device_map: Any = None,
    max_memory: Mapping[int | str, Any] | None = None,
    quantize: str | None = "auto",
    use_kernels: Any = "auto",
    torch_compile: bool = False,
    refresh: bool = False,
) -> Resolution:
    """Resolve the device and settings for ``task`` ("inference" or "training") on this machine.

    ``device`` (a string or ``torch.device``) beats ``WHICHDEVICE_DEVICE``, which beats detection.
    ``model`` (a local path, a cached model id or a config) lets placement and quantization know
    the model's size; ``max_memory`` (from_pretrained's form) states the memory budget.
    A repeated call with the same arguments and environment returns the same Resolution.
    """
    if refresh:
        probing.clear_cache()
    args = (
        device,
        task,
        model,
        prefer,
        exclude,
        dtype,
        attn_implementation,
        device_map,
        max_memory,
        quantize,
        use_kernels,
        torch_compile,
    )
    key = _memo_key(*args)
    store = probing.current_store()
    if key is not None:
        cached = store.resolutions.get(key)
        if cached is not None:
            return _attention_registered(cast(Resolution, cached))
    res = _resolve(*args)
    if key is not None:
        store.resolutions[key] = res
    return _attention_registered(res)


def _attention_registered(res: Resolution) -> Resolution:
    # whichdevice's decode attention must be registered with transformers before a model is built
    # with it. model_kwargs() does that; this covers a caller who passes res.attn_implementation
    # themselves, as long as transformers is already imported (importing it here would cost every
    # resolve_device() call the time of importing transformers).
    if res.attn_implementation == ATTENTION_NAME and "transformers" in sys.modules:
        ensure_registered()
    return res


# Every variable a resolution reads besides the probes' own (which are cached with the probes):
# a change to any of them must give a fresh answer.
_MEMO_VARIABLES = (
    ENV_DEVICE,
    *(name for launcher in LAUNCHER_VARIABLES for name in launcher[1:]),
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "LOCAL_KERNELS",
    "KERNELS_CACHE",
    "HF_HUB_CACHE",
    "HF_HOME",
    "XDG_CACHE_HOME",
    *(default.name for backend in _BUILTIN for default in backend.env_defaults),
)
# os.environ.get costs about 0.7 us a name (str -> bytes, Mapping.get); the backing dict of bytes
# answers in a tenth of that, which keeps a repeated resolve_device() well under 20 us.
_RAW_ENV: Any = getattr(os.environ, "_data", None) if os.name == "posix" else None
_MEMO_RAW_KEYS = tuple(os.fsencode(name) for name in _MEMO_VARIABLES)


def _environment_key() -> tuple[Any, ...]:
    if _RAW_ENV is not None:
        return tuple(map(_RAW_ENV.get, _MEMO_RAW_KEYS))
    return tuple(map(os.environ.get, _MEMO_VARIABLES))


def _memo_key(*args: Any) -> Any:
    """A hashable key for these arguments, or None when an answer must not be reused.

    A model or memory budget is never memoised: the files behind a path can change.
    """
    device, task, model, prefer, exclude, dtype, attn, device_map, max_memory, quantize, kernels, compile_ = args
    if model is not None or max_memory is not None:
        return None
    parts = [str(device) if device is not None and type(device).__name__ == "device" else device]
    for value in (prefer, exclude):
        parts.append(tuple(value) if isinstance(value, list) else value)
    parts += [task, dtype, attn, device_map, quantize, kernels, compile_]
    key = (tuple(parts), _environment_key(), packages.generation())
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _resolve(
    device: Any,
    task: str,
    model: Any,
    prefer: Any,
    exclude: Any,
    dtype: Any,
    attn_implementation: str,
    device_map: Any,
    max_memory: Mapping[int | str, Any] | None,
    quantize: str | None,
    use_kernels: Any,
    torch_compile: bool,
) -> Resolution:
    if task not in TASKS:
        raise DeviceError(f"task={task!r}: use 'inference' or 'training'")
    from whichdevice.quantization import check_quantize, finish_quantization

    check_quantize(quantize)
    trace: list[TraceStep] = []
    dist = detect_distributed()
    source = "detection"
    asked: str | None = None
    index: int | None = None
    if device is not None:
        name, index = parse_device(device, "device")
        source, asked = "device", str(device)
        trace.append(TraceStep("request", f"device={asked!r} given as an argument (beats {ENV_DEVICE} and detection)"))
        if os.environ.get(ENV_DEVICE):
            trace.append(TraceStep("request", f"{ENV_DEVICE}={os.environ[ENV_DEVICE]!r} ignored: the argument wins"))
    elif os.environ.get(ENV_DEVICE, "").strip():
        asked = os.environ[ENV_DEVICE]
        name, index = parse_device(asked, ENV_DEVICE)
        source = ENV_DEVICE
        trace.append(TraceStep("request", f"{ENV_DEVICE}={asked!r} set in the environment (beats detection)"))
    else:
        name = ""
    if source == "detection":
        order = _order(prefer, exclude, trace)
        trace.append(
            TraceStep(
                "request",
                f"no device given and {ENV_DEVICE} unset: first available in the order "
                + ", ".join(b.name for b in order),
            )
        )
        chosen_backend, result = _detect(order, trace)
    else:
        chosen_backend = get_backend(name)
        result = probing.probe(name)
        assert asked is not None
        if not result.available:
            raise _unavailable(asked, chosen_backend, result, source)
        if index is not None and index >= result.device_count:
            raise _index_error(asked, chosen_backend, result, index, source, "device" if source == "device" else source)
        for other in backends():
            if other.name != name:
                trace.append(TraceStep(other.name, f"not considered: {source} asked for {asked!r}", False))
        trace.append(TraceStep(name, f"chosen: {_describe(chosen_backend, result)}", True))

    backend = chosen_backend
    device_str, count_used = _device_string(backend, result, index, dist, source, asked, trace)
    env_set = tuple(result.env_set) + apply_env_defaults(backend, "select")
    for action in env_set:
        trace.append(TraceStep("env", action.message))
    for warning in result.warnings:
        trace.append(TraceStep("warning", warning))
    from whichdevice.packages import transformers_problem

    problem = transformers_problem()
    if problem is not None:
        # Everything resolved here is handed to transformers: say so before it fails there.
        trace.append(TraceStep("warning", problem))

    # dtype
    if dtype is None:
        dtype_choice = None
        trace.append(TraceStep("dtype", "dtype=None: left to transformers (the checkpoint's own dtype)"))
    elif isinstance(dtype, str) and dtype == "auto":
        dtype_choice, why = choose_dtype(backend, result)
        trace.append(TraceStep("dtype", f"{dtype_choice}: {why}"))
    else:
        dtype_choice = parse_dtype(dtype)
        ok, why = supports(backend, result, dtype_choice)
        note = "" if ok else f" (slow or unsupported here: {why})"
        trace.append(TraceStep("dtype", f"{dtype_choice} as you asked{note}"))

    attn, why = choose_attention(backend, result, dtype_choice, attn_implementation, task=task, model=model)
    trace.append(TraceStep("attention", f"{attn}: {why}" if not why.startswith(attn) else why))

    # placement
    placement_map: str | dict[str, Any] = device_str
    max_mem: dict[int | str, str] | None = None
    quant_plan = None
    if device_map is not None:
        _check_device_map(backend, device_map)
        placement_map = device_map
        trace.append(TraceStep("placement", f"device_map={device_map!r} as you asked"))
        if max_memory is not None:
            from whichdevice.sizing import parse_size

            max_mem = {k: f"{parse_size(v, f'max_memory[{k!r}]') // 1024**2}MiB" for k, v in max_memory.items()}
    elif model is not None or max_memory is not None:
        from whichdevice.placement import place_model

        placement_map, max_mem, quant_plan = place_model(
            model,
            backend,
            result,
            device_str,
            dist,
            dtype_choice or "float32",
            max_memory,
            quantize,
            trace,
        )
    else:
        trace.append(
            TraceStep(
                "placement",
                f"device_map={device_str!r}: the whole model on the chosen device (pass model= to check that it fits)",
            )
        )

    quant_plan = finish_quantization(quant_plan, backend, result, dtype_choice or "float32", quantize, task, trace)

    from whichdevice.kernels_support import decide_kernels

    kernels_on, kernels_key = decide_kernels(backend, result, use_kernels, trace)

    if dist is not None:
        trace.append(
            TraceStep(
                "distributed",
                f"{dist.launcher}: rank {dist.rank} of {dist.world_size}, local rank {dist.local_rank}; "
                f"process group backend {process_group_backend(backend, dist)!r}",
            )
        )
    return Resolution(
        device=device_str,
        backend=backend,
        task=task,
        device_count=count_used,
        device_map=placement_map,
        dtype_name=dtype_choice,
        attn_implementation=attn,
        probe=result,
        max_memory=max_mem,
        distributed=dist,
        env_set=env_set,
        trace=tuple(trace),
        source=source,
        quantization=quant_plan,
        use_kernels=kernels_on,
        kernels_key=kernels_key,
        torch_compile=torch_compile,
    )


def _describe(backend: Backend, result: ProbeResult) -> str:
    names = sorted({d.name for d in result.devices if d.name})
    what = (
        backend.hardware if backend.name != "cuda" else ("AMD GPU (ROCm)" if result.variant == "rocm" else "NVIDIA GPU")
    )
    detail = f"; {', '.join(names)}" if names else ""
    return f"{what}, {result.device_count} device{'s' if result.device_count != 1 else ''}{detail}"


def _detect(order: Iterable[Backend], trace: list[TraceStep]) -> tuple[Backend, ProbeResult]:
    order = list(order)
    for position, backend in enumerate(order):
        result = probing.probe(backend.name)
        if result.available:
            trace.append(TraceStep(backend.name, f"chosen: {_describe(backend, result)}", True))
            for later in order[position + 1 :]:
                trace.append(TraceStep(later.name, f"not probed: {backend.name} comes first in the order", False))
            return backend, result
        trace.append(TraceStep(backend.name, f"not chosen: {result.reason}", False))
    raise DeviceUnavailableError(
        "no usable device: every backend in "
        + ", ".join(b.name for b in order)
        + " is unavailable (see the reasons in `whichdevice`); leave 'cpu' out of exclude= to fall back to it"
    )


def _device_string(
    backend: Backend,
    result: ProbeResult,
    index: int | None,
    dist: DistributedContext | None,
    source: str,
    asked: str | None,
    trace: list[TraceStep],
) -> tuple[str, int]:
    """The device string and how many devices this process uses."""
    if dist is not None and backend.name != "cpu":
        if backend.distributed_backend is None:
            raise DeviceError(
                f"{dist.launcher} started {dist.world_size} processes, but {backend.name} has no "
                f"distributed backend ({backend.hardware} runs one process); run a single process or "
                "use device='cpu' (gloo)"
            )
        if index is None:
            index = dist.local_rank
            if index >= result.device_count:
                vis = result.visible
                because = f" ({vis.variable}={vis.raw!r})" if vis is not None and vis.variable else ""
                raise DeviceUnavailableError(
                    f"{dist.local_rank_variable}={dist.local_rank} but only {result.device_count} "
                    f"{backend.name} device(s) are visible{because}; start at most "
                    f"{result.device_count} processes per node (--nproc_per_node={result.device_count}) "
                    "or make more devices visible"
                )
            trace.append(
                TraceStep(
                    "device",
                    f"{backend.name}:{index}: local rank {dist.local_rank} ({dist.local_rank_variable}) "
                    "picks its own device",
                )
            )
        return f"{backend.name}:{index}", 1
    if backend.name == "cpu":
        return "cpu", 1
    if index is not None:
        return f"{backend.name}:{index}", 1
    if backend.indexed:
        return f"{backend.name}:0", result.device_count
    return backend.name, result.device_count


def _validate_names(values: Iterable[str]) -> None:
    names = backend_names()
    for v in values:
        if v not in names:
            raise UnknownDeviceError(unknown_name_message(v))
