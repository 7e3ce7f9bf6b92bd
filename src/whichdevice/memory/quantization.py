"""bitsandbytes quantization: when a model does not fit, or when asked, on the backends bitsandbytes supports.

``quantize="auto"`` (the default) loads in 4-bit NF4 only when the weights do not fit the chosen
devices in the resolved dtype; ``"4bit"`` and ``"8bit"`` always quantize (and refuse hardware
bitsandbytes does not run on); ``None`` never quantizes and raises the fit error instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import ConfigConflictError, DeviceError, DoesNotFitError
from whichdevice.core.packages import package_version
from whichdevice.core.sizes import format_bytes
from whichdevice.hardware.registry import _BUILTIN, backends

if TYPE_CHECKING:
    from whichdevice.core.records import TraceStep
    from whichdevice.device.target import Target
    from whichdevice.memory.quantization_plan import QuantizationPlan
    from whichdevice.model.size import ModelSize

__all__ = [
    "BNB_DEVICES",
    "bitsandbytes_supports",
    "finish_quantization",
    "plan_quantization",
    "requested_quantization",
]


# bitsandbytes' own ``supported_torch_devices`` (bitsandbytes/__init__.py, 0.50; "cuda" covers
# ROCm) as the built-in rows' ``Backend.bitsandbytes`` record it; tests compare it with bitsandbytes.
BNB_DEVICES = frozenset(b.name for b in _BUILTIN if b.bitsandbytes)

# transformers' bitsandbytes quantizers scale a device_map="auto" max_memory by 0.9
# (``adjust_max_memory``: room for buffers created while quantizing), so a split plan must leave it.
BNB_MAX_MEMORY_FACTOR = 0.9


def bitsandbytes_supports(target: Target) -> tuple[bool, str]:
    """Whether bitsandbytes runs on this backend (its own device list; Gaudi 2 and 3 only)."""
    if not target.backend.bitsandbytes:
        supported = ", ".join(b.name for b in backends() if b.bitsandbytes)
        return (
            False,
            f"bitsandbytes does not support {target.name} ({target.backend.hardware}); it supports {supported}",
        )
    # Gaudi 1 is the one generation of a supported backend that bitsandbytes does not run on.
    if target.name == "hpu" and any(d.generation == "gaudi1" for d in target.probe.devices):
        return False, "bitsandbytes 4-bit and 8-bit need Gaudi 2 or newer; this is Gaudi 1"
    where = "AMD GPUs through its ROCm build" if target.name == "cuda" and target.variant == "rocm" else target.name
    return True, f"bitsandbytes supports {where}"


def _bits(quantize: str | None) -> int:
    return 8 if quantize == "8bit" else 4


def _name(bits: int) -> str:
    return "NF4" if bits == 4 else "int8"


def _require_bitsandbytes(target: Target, what: str, error: type[DeviceError]) -> None:
    ok, why = bitsandbytes_supports(target)
    if not ok:
        raise error(f"{what}: {why}")
    if package_version("bitsandbytes") is None:
        raise error(
            f"{what}, but bitsandbytes is not installed: pip install bitsandbytes "
            "(or pip install 'whichdevice[quantization]')"
        )


def plan_quantization(
    size: ModelSize,
    target: Target,
    dtype: str,
    quantize: str | None,
    does_not_fit: str | None,
    usable: int | None,
    *,
    still_too_big: str | None = None,
) -> QuantizationPlan:
    """The bitsandbytes plan for a model of ``size``, or a DeviceError that says why there is none.

    ``does_not_fit`` is the placement's note when the weights do not fit in ``dtype`` (None: they
    fit, so only an explicit "4bit"/"8bit" gets here). ``usable`` is the memory the quantized
    weights go into (None: unknown); ``still_too_big`` the placement's note when even the
    quantized weights do not fit it. ``quantize`` comes checked (resolve_device's argument checks).
    """
    full = size.bytes_in(dtype)
    bits = _bits(quantize)
    quantized = size.bytes_quantized(bits, dtype)
    if does_not_fit is not None and quantize is None:
        ok, why = bitsandbytes_supports(target)
        remedy = (
            f"Pass quantize='auto' to load it in 4-bit with bitsandbytes (about "
            f"{format_bytes(size.bytes_quantized(4, dtype))}), give more memory (max_memory)"
            if ok
            else f"Quantizing is no way out here ({why}): give more memory (max_memory)"
        )
        raise DoesNotFitError(
            f"The model does not fit: {does_not_fit}, and quantize=None. {remedy}, or use more devices"
        )
    if does_not_fit is not None:
        what = f"The model does not fit: {does_not_fit}, and quantizing it is not possible"
        _require_bitsandbytes(target, what, DoesNotFitError)
    else:
        _require_bitsandbytes(target, f"quantize={quantize!r} cannot work here", ConfigConflictError)
    if still_too_big is not None:
        raise DoesNotFitError(
            "The model does not fit: "
            + (f"{does_not_fit}; " if does_not_fit else "")
            + f"{still_too_big}. Give more memory (max_memory) or use more devices"
        )
    from whichdevice.memory.quantization_plan import QuantizationPlan  # a plan is the rare answer: made here

    saves = f"saves {format_bytes(full - quantized)}"
    if does_not_fit is None:
        explanation = (
            f"{bits}-bit {_name(bits)} with bitsandbytes as you asked (quantize={quantize!r}), computing in "
            f"{dtype}: about {format_bytes(quantized)} instead of {format_bytes(full)} in {dtype} ({saves})"
        )
    else:
        explanation = (
            f"{bits}-bit {_name(bits)} with bitsandbytes, computing in {dtype}: {does_not_fit}; in {bits}-bit "
            f"they need about {format_bytes(quantized)} ({saves})"
        )
    return QuantizationPlan(bits, dtype, full, quantized, usable, explanation, requested=does_not_fit is None)


def requested_quantization(target: Target, dtype: str, quantize: Any) -> QuantizationPlan | None:
    """The plan for an explicit ``quantize="4bit"/"8bit"`` when the model's size is not known.

    None for "auto" and None (nothing to decide without a size). Raises for hardware bitsandbytes
    does not support. ``quantize`` comes checked (resolve_device's argument checks).
    """
    if quantize not in ("4bit", "8bit"):
        return None
    _require_bitsandbytes(target, f"quantize={quantize!r} cannot work here", ConfigConflictError)
    from whichdevice.memory.quantization_plan import QuantizationPlan  # a plan is the rare answer: made here

    bits = _bits(quantize)
    return QuantizationPlan(
        bits,
        dtype,
        None,
        None,
        None,
        f"{bits}-bit {_name(bits)} with bitsandbytes as you asked (quantize={quantize!r}), computing in "
        f"{dtype} (pass model= to see the memory it saves)",
        requested=True,
    )


def finish_quantization(
    plan: QuantizationPlan | None,
    target: Target,
    dtype: str,
    quantize: Any,
    task: str,
) -> tuple[QuantizationPlan | None, list[TraceStep]]:
    """The resolver's last word on quantization: an explicit request placement did not see, and
    for training the way a quantized model trains (adapters); with the trace lines that say so."""
    from whichdevice.core.records import TraceStep

    steps: list[TraceStep] = []
    if plan is None:
        plan = requested_quantization(target, dtype, quantize)
        if plan is not None:
            steps.append(TraceStep("quantization", plan.explanation))
    if plan is not None and task == "training":
        steps.append(
            TraceStep(
                "quantization",
                f"{plan.bits}-bit weights do not train themselves: train LoRA adapters on them with "
                "whichdevice.lora_training(model, resolution)",
            )
        )
    return plan, steps
