"""Placement for a known model: which devices, how much memory each, and quantization when needed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DoesNotFitError
from whichdevice.core.job import Job
from whichdevice.core.records import TraceStep
from whichdevice.core.sizes import format_bytes
from whichdevice.hardware import probing
from whichdevice.memory.capacity import can_split, capacities, cpu_memory, memory_step
from whichdevice.memory.fit import FIT_FRACTION, SPLIT_FRACTION, JobFit, Placement
from whichdevice.memory.job import JobMemory, job_memory
from whichdevice.memory.largest import LargestFit, largest_fit, say_limits, whole_job_plan
from whichdevice.memory.load_peak import LoadPeak
from whichdevice.memory.offload import offload_placement, with_ways_out
from whichdevice.memory.room import fitted_load, whole_job_device
from whichdevice.model.facts import estimate_model_size, model_shape
from whichdevice.model.size import ModelSize

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, ProbeResult
    from whichdevice.launch.distributed import DistributedContext
    from whichdevice.memory.quantization import QuantizationPlan
    from whichdevice.memory.training_job import TrainingSetup

__all__ = [
    "capacities",
    "checked_split",
    "cpu_available",
    "estimate_job",
    "loaded",
    "offload",
    "place_model",
    "place_quantized",
]


Placed = tuple[str | dict[str, Any], dict[int | str, str] | None, "QuantizationPlan | None", str | None]


def estimate_job(model: Any, job: Job, dtype: str) -> tuple[ModelSize, JobMemory]:
    """The size of ``model`` and what an inference ``job`` needs besides its weights in ``dtype`` (a
    training job: memory/training_fit.py)."""
    size = estimate_model_size(model)
    memory = job_memory(model_shape(model), dtype, job.batch_size, job.max_length, eager=job.attention == "eager")
    return size, memory


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
    job: Job | None = None,
    limits: list[LargestFit] | None = None,
    movable: bool = False,
    loads: list[LoadPeak] | None = None,
) -> Placed:
    """(device_map, max_memory, quantization plan, offload folder) for ``model`` on ``device`` for an
    inference job (a training job: memory/training_fit.py); never splits a model that fits. ``limits``
    gets the largest job that fits, ``loads`` the load's peak (memory/room.py); ``movable``: ``device``
    was detected, so another device the whole job fits on alone is taken where ``device`` would need a
    split. The fit counts the whole job (memory/job.py) against each device's free memory; bitsandbytes
    quantizes where ``quantize`` allows and the model does not fit (or is asked to); offload only where asked."""
    job = job or Job()  # quantize= and job= come checked (resolve_device's argument checks)
    caps = capacities(backend, result, device, dist, max_memory)
    if model is None:
        return _budget_only(device, caps, trace)
    size, memory = _sized(model, job, dtype, trace)
    weights = size.bytes_in(dtype)
    if max_memory is None and caps is not None:
        trace.append(memory_step(backend, result, device, dist))
    quantize = None if size.quantized is not None else quantize  # pre-quantized: checked already, never again
    if caps is None:
        return _unchecked(size, backend, result, device, dtype, quantize, trace)
    fit = JobFit(device, caps, max_memory is not None, can_split(backend, dist), backend.name, memory.bytes, job)
    if size.quantized is not None:
        return _place_prequantized(size, fit, weights, memory.bytes, backend, job, trace)
    explicit, does_not_fit = quantize in ("4bit", "8bit"), None
    fit = _moved(fit, weights, backend, trace) if movable and not explicit else fit
    # The whole job's limits are said only where it is the plan chosen.
    largest = None if explicit else _largest(model, fit, job, dtype, weights, None, plan=whole_job_plan(job, dtype))
    if not explicit:
        placement = checked_split(model, dtype, fit.plan(weights), fit, memory, weights)
        if placement.fits:
            say_limits(largest, trace, limits)
            return loaded(placement, (model, size, dtype, memory, weights), fit, (backend, result), trace, loads)
        does_not_fit = f"in {dtype}, {placement.note}"
        say_limits(largest, trace, limits)
        if job.offload is not None and quantize is None:
            return offload(weights, memory.bytes, backend, fit, job, trace)
    try:
        return place_quantized(
            model, size, (backend, result), fit, None, does_not_fit, job, trace, loads, quantize, dtype
        )
    except DoesNotFitError as err:
        if job.offload is not None and not explicit:
            return offload(weights, memory.bytes, backend, fit, job, trace)
        raise with_ways_out(err, (model_shape(model), size, memory, backend), fit.caps, dtype, job, largest) from None


def _moved(fit: JobFit, weights: int, backend: Backend, trace: list[TraceStep]) -> JobFit:
    """``fit`` on another device the whole job fits on alone, where its own would need a split."""
    fraction = 1.0 if fit.budget_given else FIT_FRACTION
    found, steps = whole_job_device(fit.caps, fit.device, weights + fit.extra, fraction, backend.name)
    if found is None:
        return fit
    trace.extend(steps)
    caps = {found: fit.caps[found], **{k: v for k, v in fit.caps.items() if k != found}}
    return replace(fit, device=f"{backend.name}:{found}", caps=caps)


def loaded(
    placement: Placement,
    sized: tuple[Any, ModelSize, str, JobMemory, int],
    fit: JobFit,
    on: tuple[Backend, ProbeResult],
    trace: list[TraceStep],
    loads: list[LoadPeak] | None,
) -> Placed:
    """The placement that fits at rest, kept or changed so that its load fits too (memory/room.py)."""
    model, size, dtype, memory, weights = sized

    def spread(overhead: int) -> tuple[Any, dict[int | str, str] | None] | None:
        if not fit.can_split or len(fit.caps) < 2:
            return None
        low = replace(fit, caps={k: max(0, v - overhead) for k, v in fit.caps.items()})
        placed = checked_split(model, dtype, low.plan(weights), low, memory, weights)
        return (placed.device_map, placed.max_memory) if placed.fits else None

    trace.extend(_placed_steps(model, placement, fit, weights, memory, on))
    device_map, max_memory = fitted_load(
        (placement.device_map, placement.max_memory), size, dtype, on[1], None, cpu_available, spread, trace, loads
    )
    return device_map, max_memory, None, None


def _placed_steps(
    model: Any, placement: Placement, fit: JobFit, weights: int, memory: JobMemory, on: tuple[Backend, ProbeResult]
) -> list[TraceStep]:
    """The placement's line; for an inference split, tensor parallelism beside it."""
    steps = [TraceStep("placement", f"device_map={placement.device_map!r}: {placement.note}")]
    if fit.job.task == "inference" and placement.device_map in (*_SPLITS, "sequential"):
        from whichdevice.memory.tensor_parallel import tensor_parallel_steps
        from whichdevice.model.facts import model_config

        budget = int(min(fit.caps.values()) * (1.0 if fit.budget_given else FIT_FRACTION))
        steps += tensor_parallel_steps(model_config(model), len(fit.caps), budget, weights, memory, *on)
    return steps


def checked_split(
    model: Any, dtype: str, placement: Placement, fit: JobFit, memory: JobMemory, weights: int
) -> Placement:
    """A split as transformers' own placement makes it on a meta build (memory/split_check.py)."""
    if not (placement.fits and placement.device_map in _SPLITS):
        return placement
    from whichdevice.memory.split_check import check_split

    limits = {k: int(c * (1.0 if fit.budget_given else SPLIT_FRACTION)) for k, c in fit.caps.items()}
    try:
        checked = check_split(model, dtype, str(placement.device_map), limits, memory, weights)
    except DoesNotFitError as err:
        return replace(placement, fits=False, note=str(err))
    note = placement.note
    if checked.device_map != placement.device_map:
        note = (
            f"{note.split(';')[0].replace(repr(placement.device_map), repr(checked.device_map))}; "
            f"{checked.passed_over or f'{placement.device_map!r} would not keep every layer on the devices'}"
        )
    return replace(
        placement, device_map=checked.device_map, max_memory=checked.max_memory, note=f"{note}; {checked.note}"
    )


def _largest(
    model: Any, fit: JobFit, job: Job, dtype: str, weights: int, found: list[LargestFit] | None, *, plan: str = ""
) -> LargestFit | None:
    """The longest length and largest batch whose inference job fits like this one would (a sized job only)."""
    shape = model_shape(model)
    if shape is None or (job.batch_size is None and job.max_length is None):
        return None
    eager = job.attention == "eager"

    def need(batch: int, tokens: int) -> int:
        return job_memory(shape, dtype, batch, tokens, eager=eager).bytes

    def fits(extra: int) -> bool:
        return replace(fit, extra=extra).plan(weights).fits

    largest = largest_fit(shape, job, need, fits, plan=plan)
    if found is not None:
        found.append(largest)
    return largest


def _sized(model: Any, job: Job, dtype: str, trace: list[TraceStep]) -> tuple[ModelSize, JobMemory]:
    """The model's size and the job's other memory, each said in the trace."""
    size, memory = estimate_job(model, job, dtype)
    if size.quantized is not None and job.dequantize:
        size = size.dequantized()
    weights = size.bytes_in(dtype)
    if size.quantized is not None:
        trace.append(TraceStep("model", f"pre-quantized: {size.quantized.describe()}"))
    stored = " (the quantized weights as stored)" if size.quantized is not None and not job.dequantize else ""
    trace.append(
        TraceStep(
            "model",
            f"{size.parameters / 1e6:.1f}M parameters = {format_bytes(weights)} in {dtype}{stored} "
            f"(from {size.source})",
        )
    )
    if memory.terms:
        trace.append(TraceStep("memory", f"{job.task} needs {memory.describe(weights)}"))
    trace.extend(TraceStep("memory", note) for note in memory.assumed)
    return size, memory


def _unchecked(
    size: ModelSize,
    backend: Backend,
    result: ProbeResult,
    device: str,
    dtype: str,
    quantize: str | None,
    trace: list[TraceStep],
) -> Placed:
    from whichdevice.memory.quantization import plan_quantization

    plan = None
    if quantize in ("4bit", "8bit"):
        plan = plan_quantization(size, backend, result, dtype, quantize, None, None)
        trace.append(TraceStep("quantization", plan.explanation))
    trace.append(
        TraceStep("placement", f"device_map={device!r}: {backend.name} does not report its memory, so fit is unchecked")
    )
    return device, None, plan, None


_SPLITS = ("auto", "balanced_low_0")


def place_quantized(
    model: Any,
    size: ModelSize,
    on: tuple[Backend, ProbeResult],
    fit: JobFit,
    setup: TrainingSetup | None,
    does_not_fit: str | None,
    job: Job,
    trace: list[TraceStep],
    loads: list[LoadPeak] | None = None,
    quantize: str | None = None,
    dtype: str | None = None,
) -> Placed:
    """Quantized: on one device when the quantized weights fit there, else split like any model,
    minus the share of max_memory that bitsandbytes keeps for its buffers. An inference job quantizes
    as ``quantize`` says, computing in ``dtype``; a training job (``setup``: QLoRA) as its way to train
    says, ``fit.extra`` holding its adapters, gradients, optimizer state and activations."""
    from whichdevice.memory.quantization import BNB_MAX_MEMORY_FACTOR, plan_quantization

    backend, result = on
    bits = setup.bits if setup is not None else (8 if quantize == "8bit" else 4)
    compute = setup.weights if setup is not None else (dtype or "float32")
    quantize = quantize if setup is None else f"{bits}bit" if does_not_fit is None else "auto"
    # Weights as a step holds them: a training job's other weights upcast to float32 by peft's k-bit preparation.
    quantized = size.bytes_quantized(bits, "float32" if setup is not None else compute)
    qplace = fit.plan(quantized)
    split = qplace.fits and qplace.device_map in _SPLITS
    if split:
        qplace = fit.plan(int(quantized / BNB_MAX_MEMORY_FACTOR))
    if split:
        usable = int(sum(fit.caps.values()) * (1.0 if fit.budget_given else SPLIT_FRACTION) * BNB_MAX_MEMORY_FACTOR)
    else:
        usable = fit.usable()
    still_too_big = None if qplace.fits else f"in {bits}-bit, {qplace.note}"
    plan = plan_quantization(
        size, backend, result, compute, quantize, does_not_fit, usable, still_too_big=still_too_big
    )
    trace.append(TraceStep("quantization", plan.explanation))
    note = _quantized_note(fit, bits, quantized, usable, backend.name, qplace.device_map if split else None)
    trace.append(TraceStep("placement", note))
    placed = (qplace.device_map, qplace.max_memory)
    device_map, max_memory = fitted_load(placed, size, compute, result, bits, cpu_available, None, trace, loads)
    return device_map, max_memory, plan, None


def _quantized_note(fit: JobFit, bits: int, quantized: int, usable: int, backend: str, split: Any) -> str:
    """The placement line of quantized weights: on one device with what it offers, or the split (``split``)."""
    from whichdevice.memory.quantization import BNB_MAX_MEMORY_FACTOR

    if split is not None:
        return (
            f"device_map={split!r}: even the {bits}-bit weights ({format_bytes(quantized)}) need more than one "
            f"{backend} device; split over {len(fit.caps)} devices (bitsandbytes keeps "
            f"{100 - int(BNB_MAX_MEMORY_FACTOR * 100)}% of max_memory for its buffers)"
        )
    first = next(iter(fit.caps.values()))
    room = (
        f"({format_bytes(usable)} budget)"
        if fit.budget_given
        else f"({fit.margin.note(first, fit.extra)})"
        if fit.margin.said
        else f"({format_bytes(usable)} usable: {int(FIT_FRACTION * 100)}% of {format_bytes(first)})"
    )
    what = f"the {bits}-bit weights ({format_bytes(quantized)})"
    if fit.extra:
        what = f"the {bits}-bit weights and the job's memory ({format_bytes(quantized + fit.extra)})"
    return f"device_map={fit.device!r}: {what} fit there {room}"


def _place_prequantized(
    size: ModelSize, fit: JobFit, weights: int, extra: int, backend: Backend, job: Job, trace: list[TraceStep]
) -> Placed:
    """A quantized checkpoint fits as stored, or is offloaded when asked; quantizing is no way out."""
    placement = fit.plan(weights)
    if placement.fits:
        trace.append(TraceStep("placement", f"device_map={placement.device_map!r}: {placement.note}"))
        return placement.device_map, placement.max_memory, None, None
    if job.offload is not None:
        return offload(weights, extra, backend, fit, job, trace)
    what = size.quantized.describe() if size.quantized is not None else "quantized"
    raise DoesNotFitError(
        f"The model does not fit: {placement.note}; it is already quantized ({what}), so quantizing is no "
        "way out: give more memory (max_memory), use more devices, or pass offload='cpu'"
    )


def cpu_available() -> int | None:
    """The CPU memory a process can take now (psutil's available), else the total; None if unknown."""
    return cpu_memory(probing.probe("cpu"))


def offload(weights: int, extra: int, backend: Backend, fit: JobFit, job: Job, trace: list[TraceStep]) -> Placed:
    """offload_placement's answer for the CPU memory here, its reasons added to ``trace``."""
    answer, steps = offload_placement(weights, extra, backend, fit.caps, fit.budget_given, job, cpu_available() or 0)
    trace.extend(steps)
    return answer


def _budget_only(device: str, caps: dict[int | str, int] | None, trace: list[TraceStep]) -> Placed:
    """max_memory without a model: nothing to size, but the budget is the user's, so it is passed on."""
    assert caps is not None
    budget = {k: f"{v // 1024**2}MiB" for k, v in caps.items()}
    trace.append(TraceStep("placement", f"device_map={device!r} with your max_memory {budget}"))
    return device, budget, None, None
