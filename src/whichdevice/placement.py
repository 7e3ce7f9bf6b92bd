"""Placement for a known model: which devices, how much memory each, and quantization when needed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from whichdevice.errors import DeviceError
from whichdevice.records import TraceStep
from whichdevice.sizing import (
    FIT_FRACTION,
    SPLIT_FRACTION,
    ModelSize,
    Placement,
    estimate_model_size,
    format_bytes,
    parse_size,
    plan_placement,
)

if TYPE_CHECKING:
    from whichdevice.distributed import DistributedContext
    from whichdevice.quantization import QuantizationPlan
    from whichdevice.records import Backend, ProbeResult

__all__ = ["capacities", "place_model"]


def capacities(
    backend: Backend,
    result: ProbeResult,
    device: str,
    dist: DistributedContext | None,
    max_memory: Mapping[int | str, Any] | None,
) -> dict[int | str, int] | None:
    """Memory per usable device (max_memory key -> bytes); None when the hardware does not say."""
    _, _, idx = device.partition(":")
    if max_memory is not None:
        wanted: dict[int | str, int] = {}
        for key, value in max_memory.items():
            if key == backend.name or (isinstance(key, int) and not backend.shared_device):
                wanted[key] = parse_size(value, f"max_memory[{key!r}]")
        if not wanted:
            keys = f"{backend.name!r}" if backend.shared_device else f"device indices (0, 1, ...) for {backend.name}"
            raise DeviceError(
                f"max_memory={dict(max_memory)!r} has no entry for the resolved device {device}; give {keys}"
            )
        if idx and int(idx) in wanted:
            # The chosen device first, so the one-device check is against it.
            wanted = {int(idx): wanted[int(idx)], **wanted}
        return wanted
    if backend.memory_by_name:
        memory = result.devices[0].total_memory if result.devices else None
        return {backend.name: memory} if memory else None
    devices = list(result.devices)
    if idx:
        devices = [d for d in devices if d.index == int(idx)] + [d for d in devices if d.index != int(idx)]
    if dist is not None:
        devices = devices[:1]
    if not devices or any(d.total_memory is None for d in devices):
        return None
    return {d.index: int(d.total_memory or 0) for d in devices}


def place_model(
    model: Any,
    backend: Backend,
    result: ProbeResult,
    device: str,
    dist: DistributedContext | None,
    dtype: str,
    max_memory: Mapping[int | str, Any] | None,
    quantize: str | None,
    trace: list[TraceStep],
) -> tuple[str | dict[str, Any], dict[int | str, str] | None, QuantizationPlan | None]:
    """(device_map, max_memory, quantization plan) for ``model`` on ``device``; never splits a model that fits.

    A model that does not fit in ``dtype`` is quantized with bitsandbytes when ``quantize`` allows
    it (one device when the quantized weights fit there, else split like an unquantized model);
    ``quantize="4bit"``/``"8bit"`` quantizes even a model that fits.
    """
    from whichdevice.quantization import check_quantize, plan_quantization

    check_quantize(quantize)
    caps = capacities(backend, result, device, dist, max_memory)
    if model is None:
        assert caps is not None
        budget = {k: f"{v // 1024**2}MiB" for k, v in caps.items()}
        trace.append(TraceStep("placement", f"device_map={device!r} with your max_memory {budget}"))
        # Without a model there is nothing to size, but the budget is the user's: pass it on.
        return device, budget, None
    size = estimate_model_size(model)
    weights = size.bytes_in(dtype)
    trace.append(
        TraceStep(
            "model",
            f"{size.parameters / 1e6:.1f}M parameters = {format_bytes(weights)} in {dtype} (from {size.source})",
        )
    )
    explicit = quantize in ("4bit", "8bit")
    if caps is None:
        plan = None
        if explicit:
            plan = plan_quantization(size, backend, result, dtype, quantize, None, None)
            trace.append(TraceStep("quantization", plan.explanation))
        trace.append(
            TraceStep(
                "placement", f"device_map={device!r}: {backend.name} does not report its memory, so fit is unchecked"
            )
        )
        return device, None, plan
    fit = _Fit(device, caps, max_memory is not None, _can_split(backend, dist), backend.name)
    does_not_fit: str | None = None
    if not explicit:
        placement = fit.plan(weights)
        if placement.fits:
            trace.append(TraceStep("placement", f"device_map={placement.device_map!r}: {placement.note}"))
            return placement.device_map, placement.max_memory, None
        does_not_fit = f"in {dtype}, {placement.note}"
    return _place_quantized(size, backend, result, fit, dtype, quantize, does_not_fit, trace)


def _can_split(backend: Backend, dist: DistributedContext | None) -> bool:
    """Whether Accelerate may split a model over several of ``backend``'s devices in this process."""
    return backend.device_map_auto and dist is None and not backend.memory_by_name


@dataclass(frozen=True)
class _Fit:
    """The devices a model goes on, and how plan_placement is to fit weights into them."""

    device: str
    caps: dict[int | str, int]
    budget_given: bool
    can_split: bool
    backend: str

    def plan(self, weights: int) -> Placement:
        return plan_placement(
            weights,
            self.device,
            self.caps,
            budget_given=self.budget_given,
            can_split=self.can_split,
            backend=self.backend,
        )


def _place_quantized(
    size: ModelSize,
    backend: Backend,
    result: ProbeResult,
    fit: _Fit,
    dtype: str,
    quantize: str | None,
    does_not_fit: str | None,
    trace: list[TraceStep],
) -> tuple[str | dict[str, Any], dict[int | str, str] | None, QuantizationPlan]:
    """Quantized: on one device when the quantized weights fit there, else split like any model,
    minus the share of max_memory that bitsandbytes keeps for its buffers."""
    from whichdevice.quantization import BNB_MAX_MEMORY_FACTOR, plan_quantization

    bits = 8 if quantize == "8bit" else 4
    quantized = size.bytes_quantized(bits, dtype)
    qplace = fit.plan(quantized)
    split = qplace.fits and qplace.device_map == "auto"
    if split:
        qplace = fit.plan(int(quantized / BNB_MAX_MEMORY_FACTOR))
    first = next(iter(fit.caps.values()))
    if split:
        usable = int(sum(fit.caps.values()) * (1.0 if fit.budget_given else SPLIT_FRACTION) * BNB_MAX_MEMORY_FACTOR)
    else:
        usable = int(first * (1.0 if fit.budget_given else FIT_FRACTION))
    still_too_big = None if qplace.fits else f"in {bits}-bit, {qplace.note}"
    plan = plan_quantization(size, backend, result, dtype, quantize, does_not_fit, usable, still_too_big=still_too_big)
    trace.append(TraceStep("quantization", plan.explanation))
    if split:
        note = (
            f"device_map='auto': even the {bits}-bit weights ({format_bytes(quantized)}) need more than one "
            f"{backend.name} device; split over {len(fit.caps)} devices (bitsandbytes keeps "
            f"{100 - int(BNB_MAX_MEMORY_FACTOR * 100)}% of max_memory for its buffers)"
        )
    else:
        room = (
            f"({format_bytes(usable)} budget)"
            if fit.budget_given
            else f"({format_bytes(usable)} usable: {int(FIT_FRACTION * 100)}% of {format_bytes(first)})"
        )
        note = f"device_map={fit.device!r}: the {bits}-bit weights ({format_bytes(quantized)}) fit there {room}"
    trace.append(TraceStep("placement", note))
    return qplace.device_map, qplace.max_memory, plan
