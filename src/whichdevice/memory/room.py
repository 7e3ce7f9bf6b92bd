"""Room on one device: the device a whole job fits on alone, and whether its load fits there too.

Placement (memory/placement.py) sizes the steady state: the weights and the job's memory against each
device's usable share. Two questions about the one device a model goes on are answered here. Which
device: where the device was detected rather than asked for, and the chosen one would need a split,
another device the whole job fits on alone is taken (one device computes without passing
activations between devices). And the load: transformers' allocator warm-up and torch's allocator
make the load peak above the weights (memory/load_peak.py); where only the load does not fit the
device's free memory, what avoids it is handed over: the model loaded on the CPU and moved (a move
allocates tensor by tensor, so it peaks at the weights), or a lower max_memory that spreads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DoesNotFitError
from whichdevice.core.records import TraceStep
from whichdevice.core.sizes import format_bytes
from whichdevice.memory.load_peak import ROUND_LARGE, LoadPeak, Weights, load_peak
from whichdevice.memory.record import FIT_FRACTION, Placement

if TYPE_CHECKING:
    from whichdevice.device.target import Target

__all__ = ["check_load", "fitted_load", "whole_job_device"]

# device_map values that are no one accelerator: the CPU itself (no warm-up there), and the splits.
_NOT_ONE_DEVICE = ("cpu", "auto", "balanced", "balanced_low_0", "sequential")


def whole_job_device(
    caps: Mapping[int | str, int], device: str, need: int, fraction: float, backend: str
) -> tuple[int | None, list[TraceStep]]:
    """The first other device (by index) ``need`` bytes fit on alone where ``device`` (the first of
    ``caps``) would need a split; None where ``device`` fits, or no device does."""
    first_key, first = next(iter(caps.items()))
    if need <= first * fraction:
        return None, []
    others = sorted((k for k in caps if isinstance(k, int) and k != first_key), key=int)
    found = next((k for k in others if need <= caps[k] * fraction), None)
    if found is None:
        return None, []
    usable = format_bytes(int(caps[found] * fraction))
    why = (
        f"{backend}:{found}: the whole job ({format_bytes(need)}) fits there alone ({usable} usable), where {device} "
        f"({format_bytes(int(first * fraction))} usable) would need a split"
    )
    return int(found), [TraceStep("device", why)]


def check_load(
    device: Any,
    size: Weights,
    dtype: str,
    target: Target,
    bits: int | None,
    cpu_free: Callable[[], int | None],
    spread: Callable[[int], Placement | None] | None,
) -> tuple[LoadPeak | None, Placement | None, list[TraceStep]]:
    """The load's peak on ``device`` (a device_map: one device, the target's, is checked; a split's
    devices each hold their share, under the split's own headroom), and what to hand over instead where
    only the load does not fit (None: keep the placement). ``bits``: bitsandbytes quantization on load.
    ``spread(overhead)`` places the model again with every device's budget lowered by ``overhead``
    bytes, what the load needs beyond the weights (None where that does not fit).
    Raises DoesNotFitError where nothing avoids the peak."""
    if not isinstance(device, str) or device in _NOT_ONE_DEVICE or size.quantized is not None:
        return None, None, []  # a pre-quantized checkpoint's load is left to its quantizer: not counted
    info = target.info()
    if info is None:
        return None, None, []
    peak = load_peak(size, dtype, device, info.free_memory, info.total_memory, bits, kind=target.name)
    if peak.fits:
        return peak, None, [TraceStep("load", peak.text())]
    free = peak.free or 0
    said = f"{peak.text()}: the weights fit {device} once loaded, the load does not"
    if peak.moved > free:
        # Only a budget (max_memory) above what the device has free gets here: the weights alone do not fit.
        raise DoesNotFitError(
            f"the weights ({format_bytes(peak.moved)} on {device} however they are loaded) are more than {device} "
            f"has free ({format_bytes(free)}; other processes hold {format_bytes((info.total_memory or 0) - free)}); "
            "max_memory cannot give a device memory it does not have: lower it, use more devices (devices=), "
            "or offload='cpu'"
        )
    room = cpu_free()
    if bits is None and room is not None and peak.weights <= room * FIT_FRACTION:
        how = (
            "load it on the CPU and move it: device_map='cpu' in model_kwargs(), then model.to(res.device) "
            f"(Trainer moves it itself; pipeline_kwargs() passes device={device!r}): a move allocates tensor by "
            f"tensor, so {device} peaks at {format_bytes(peak.moved)}"
        )
        done = replace(peak, remedy="cpu")
        return done, Placement("cpu", note=how), [TraceStep("warning", f"{said}; {how}")]
    overhead = peak.peak - peak.weights + ROUND_LARGE
    placed = spread(overhead) if spread is not None else None
    if placed is not None:
        how = (
            f"device_map={placed.device_map!r} with max_memory={placed.max_memory}: each device's budget lowered by "
            f"the load's own {format_bytes(overhead)} spreads the weights so that each device's load fits"
        )
        done = replace(peak, remedy="split")
        return done, placed, [TraceStep("warning", f"{said}; {how}")]
    cpu = "" if bits is not None else f"; the CPU has {format_bytes(room or 0)} available to load it on first"
    held = format_bytes((info.total_memory or 0) - free)
    raise DoesNotFitError(
        f"{said}{cpu}: free memory on {device} (other processes hold {held}), use more devices (devices=, "
        "max_memory=), or offload='cpu'"
    )


def fitted_load(
    placement: Placement,
    size: Weights,
    dtype: str,
    target: Target,
    bits: int | None,
    cpu_free: Callable[[], int | None],
    spread: Callable[[int], Placement | None] | None,
) -> tuple[Placement, list[TraceStep]]:
    """``placement`` with its load's peak, or what :func:`check_load` hands over instead (where the
    weights, quantization and the rest stay as placed), with the lines that say it."""
    peak, instead, steps = check_load(placement.device_map, size, dtype, target, bits, cpu_free, spread)
    if instead is not None:
        placement = replace(placement, device_map=instead.device_map, max_memory=instead.max_memory)
    return replace(placement, load=peak), steps
