"""Placement for a known model: which devices, how much memory each, and quantization when needed.

Every function here returns its answer, a :class:`~whichdevice.memory.fit.Placement`, with the trace
lines that say why; none is handed a list to fill.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DoesNotFitError
from whichdevice.core.job import Job
from whichdevice.core.records import Trace, TraceStep
from whichdevice.core.sizes import format_bytes
from whichdevice.hardware import probing
from whichdevice.memory.capacity import can_split, capacities, cpu_memory, memory_step
from whichdevice.memory.fit import (
    FIT_FRACTION,
    SPLIT_FRACTION,
    JobFit,
    LargestFit,
    Placement,
)
from whichdevice.memory.job import JobMemory, job_memory
from whichdevice.memory.largest import largest_fit, limits_steps, whole_job_plan
from whichdevice.memory.offload import offload_placement, with_ways_out
from whichdevice.memory.room import fitted_load, whole_job_device
from whichdevice.model.facts import estimate_model_size, model_shape
from whichdevice.model.size import ModelSize

if TYPE_CHECKING:
    from whichdevice.core.records import Backend
    from whichdevice.device.target import Target
    from whichdevice.memory.training_records import TrainingSetup

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

Step = tuple[Placement, list[TraceStep]]


def estimate_job(model: Any, job: Job, dtype: str, *, eager: bool = False) -> tuple[ModelSize, JobMemory]:
    """The size of ``model`` and what an inference ``job`` needs besides its weights in ``dtype`` (a
    training job: memory/training_fit.py); ``eager``: the model runs eager attention (its T x T scores)."""
    size = estimate_model_size(model)
    memory = job_memory(model_shape(model), dtype, job.batch_size, job.max_length, eager=eager)
    return size, memory


def place_model(
    model: Any,
    target: Target,
    dtype: str,
    max_memory: Mapping[int | str, Any] | None,
    quantize: str | None,
    job: Job | None = None,
    *,
    attention: str | None = None,
    dequantize: bool = False,
    movable: bool = False,
) -> Step:
    """Where ``model`` goes on ``target`` for an inference job (a training job: memory/training_fit.py);
    never splits a model that fits. The placement carries the largest job that fits and the load's
    peak (memory/room.py). ``attention``: what the model runs (eager's scores are counted);
    ``dequantize``: transformers loads a pre-quantized checkpoint dequantized here; ``movable``: the
    target's device was detected, so another device the whole job fits on alone is taken where it
    would need a split. The fit counts the whole job
    (memory/job.py) against each device's free memory; bitsandbytes quantizes where ``quantize`` allows
    and the model does not fit (or is asked to); offload only where asked."""
    job = job or Job()  # quantize= and job= come checked (resolve_device's argument checks)
    caps = capacities(target, max_memory)
    if model is None:
        return _budget_only(target.device, caps)
    trace = Trace()
    eager = attention == "eager"
    size, memory = trace.take(_sized(model, job, dtype, eager, dequantize))
    weights = size.bytes_in(dtype)
    if max_memory is None and caps is not None:
        trace.append(memory_step(target))
    quantize = None if size.quantized is not None else quantize  # pre-quantized: checked already, never again
    if caps is None:
        return _then(trace, _unchecked(size, target, dtype, quantize))
    fit = JobFit(target.device, caps, max_memory is not None, can_split(target), target.name, memory.bytes, job)
    if size.quantized is not None:
        return _then(trace, _place_prequantized(size, fit, weights, memory.bytes, target.backend, job))
    explicit, moved = quantize in ("4bit", "8bit"), None
    if movable and not explicit:
        moved = trace.take(_moved(fit, weights, target))
        if moved is not None:
            target, fit = (
                target.moved(moved),
                replace(fit, device=f"{target.name}:{moved}", caps=_first(fit.caps, moved)),
            )
    if explicit:
        return _then(trace, _quantized(model, size, memory, target, fit, None, job, quantize, dtype, None))
    # The whole job's limits are said only where it is the plan chosen.
    largest = _largest(model, fit, job, dtype, weights, eager, plan=whole_job_plan(job, dtype))
    placement = checked_split(model, dtype, fit.plan(weights), fit, memory, weights)
    trace.extend(limits_steps(largest))
    if placement.fits:
        done = trace.take(loaded(placement, (model, size, dtype, memory, weights), fit, target))
        return replace(done, limits=largest, index=moved), trace
    if job.offload is not None and quantize is None:
        return _then(trace, offload(weights, memory.bytes, target.backend, fit, job), limits=largest)
    does_not_fit = f"in {dtype}, {placement.note}"
    return _then(trace, _quantized(model, size, memory, target, fit, does_not_fit, job, quantize, dtype, largest))


def _quantized(
    model: Any,
    size: ModelSize,
    memory: JobMemory,
    target: Target,
    fit: JobFit,
    does_not_fit: str | None,
    job: Job,
    quantize: str | None,
    dtype: str,
    largest: LargestFit | None,
) -> Step:
    """bitsandbytes' placement, or offload where asked and even that does not fit, or the error with the
    ways out (``largest``: the whole job's limits, which the placement carries)."""
    try:
        placed, steps = place_quantized(model, size, target, fit, None, does_not_fit, job, quantize, dtype)
    except DoesNotFitError as err:
        if job.offload is not None and does_not_fit is not None:
            weights = size.bytes_in(dtype)
            placed, steps = offload(weights, memory.bytes, target.backend, fit, job)
            return replace(placed, limits=largest), steps
        raise with_ways_out(
            err, (model_shape(model), size, memory, target.backend), fit.caps, dtype, job, largest
        ) from None
    return replace(placed, limits=largest), steps


def _then(trace: Trace, step: Step, **also: Any) -> Step:
    """A placement step's answer after the lines said before it (``also``: fields the caller adds)."""
    placement, steps = step
    return (replace(placement, **also) if also else placement), [*trace, *steps]


def _first(caps: dict[int | str, int], index: int | None) -> dict[int | str, int]:
    """The capacities with ``index``'s device first (the one-device check is against the first)."""
    if index is None or index not in caps:
        return caps
    return {index: caps[index], **{k: v for k, v in caps.items() if k != index}}


def _moved(fit: JobFit, weights: int, target: Target) -> tuple[int | None, list[TraceStep]]:
    """Another device the whole job fits on alone, where the target's own would need a split (None: none)."""
    fraction = 1.0 if fit.budget_given else FIT_FRACTION
    return whole_job_device(fit.caps, fit.device, weights + fit.extra, fraction, target.name)


def loaded(
    placement: Placement, sized: tuple[Any, ModelSize, str, JobMemory, int], fit: JobFit, target: Target
) -> Step:
    """The placement that fits at rest, kept or changed so that its load fits too (memory/room.py)."""
    model, size, dtype, memory, weights = sized

    def spread(overhead: int) -> Placement | None:
        if not fit.can_split or len(fit.caps) < 2:
            return None
        low = replace(fit, caps={k: max(0, v - overhead) for k, v in fit.caps.items()})
        placed = checked_split(model, dtype, low.plan(weights), low, memory, weights)
        return placed if placed.fits else None

    steps = _placed_steps(model, placement, fit, weights, memory, target)
    done, more = fitted_load(placement, size, dtype, target, None, cpu_available, spread)
    return done, [*steps, *more]


def _placed_steps(
    model: Any, placement: Placement, fit: JobFit, weights: int, memory: JobMemory, target: Target
) -> list[TraceStep]:
    """The placement's line; for an inference split, tensor parallelism beside it."""
    steps = [TraceStep("placement", f"device_map={placement.device_map!r}: {placement.note}")]
    if fit.job.task == "inference" and placement.device_map in (*_SPLITS, "sequential"):
        from whichdevice.memory.tensor_parallel import tensor_parallel_steps
        from whichdevice.model.facts import model_config

        budget = int(min(fit.caps.values()) * (1.0 if fit.budget_given else FIT_FRACTION))
        steps += tensor_parallel_steps(model_config(model), len(fit.caps), budget, weights, memory, target)
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
    model: Any, fit: JobFit, job: Job, dtype: str, weights: int, eager: bool, *, plan: str = ""
) -> LargestFit | None:
    """The longest length and largest batch whose inference job fits like this one would (a sized job only)."""
    shape = model_shape(model)
    if shape is None or (job.batch_size is None and job.max_length is None):
        return None

    def need(batch: int, tokens: int) -> int:
        return job_memory(shape, dtype, batch, tokens, eager=eager).bytes

    def fits(extra: int) -> bool:
        return replace(fit, extra=extra).plan(weights).fits

    return largest_fit(shape, job, need, fits, plan=plan)


def _sized(
    model: Any, job: Job, dtype: str, eager: bool, dequantize: bool
) -> tuple[tuple[ModelSize, JobMemory], list[TraceStep]]:
    """The model's size and the job's other memory, with the lines that say them."""
    trace: list[TraceStep] = []
    size, memory = estimate_job(model, job, dtype, eager=eager)
    if size.quantized is not None and dequantize:
        size = size.dequantized()
    weights = size.bytes_in(dtype)
    if size.quantized is not None:
        trace.append(TraceStep("model", f"pre-quantized: {size.quantized.describe()}"))
    stored = " (the quantized weights as stored)" if size.quantized is not None and not dequantize else ""
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
    return (size, memory), trace


def _unchecked(size: ModelSize, target: Target, dtype: str, quantize: str | None) -> Step:
    from whichdevice.memory.quantization import plan_quantization

    plan, steps = None, []
    if quantize in ("4bit", "8bit"):
        plan = plan_quantization(size, target, dtype, quantize, None, None)
        steps.append(TraceStep("quantization", plan.explanation))
    device = target.device
    note = f"{target.name} does not report its memory, so fit is unchecked"
    steps.append(TraceStep("placement", f"device_map={device!r}: {note}"))
    return Placement(device, note=note, quantization=plan), steps


_SPLITS = ("auto", "balanced_low_0")


def place_quantized(
    model: Any,
    size: ModelSize,
    target: Target,
    fit: JobFit,
    setup: TrainingSetup | None,
    does_not_fit: str | None,
    job: Job,
    quantize: str | None = None,
    dtype: str | None = None,
) -> Step:
    """Quantized: on one device when the quantized weights fit there, else split like any model,
    minus the share of max_memory that bitsandbytes keeps for its buffers. An inference job quantizes
    as ``quantize`` says, computing in ``dtype``; a training job (``setup``: QLoRA) as its way to train
    says, ``fit.extra`` holding its adapters, gradients, optimizer state and activations."""
    from whichdevice.memory.quantization import BNB_MAX_MEMORY_FACTOR, plan_quantization

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
    plan = plan_quantization(size, target, compute, quantize, does_not_fit, usable, still_too_big=still_too_big)
    note = _quantized_note(fit, bits, quantized, usable, target.name, qplace.device_map if split else None)
    steps = [TraceStep("quantization", plan.explanation), TraceStep("placement", note)]
    placed = replace(qplace, note=note, quantization=plan)
    done, more = fitted_load(placed, size, compute, target, bits, cpu_available, None)
    return done, [*steps, *more]


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


def _place_prequantized(size: ModelSize, fit: JobFit, weights: int, extra: int, backend: Backend, job: Job) -> Step:
    """A quantized checkpoint fits as stored, or is offloaded when asked; quantizing is no way out."""
    placement = fit.plan(weights)
    if placement.fits:
        return placement, [TraceStep("placement", f"device_map={placement.device_map!r}: {placement.note}")]
    if job.offload is not None:
        return offload(weights, extra, backend, fit, job)
    what = size.quantized.describe() if size.quantized is not None else "quantized"
    raise DoesNotFitError(
        f"The model does not fit: {placement.note}; it is already quantized ({what}), so quantizing is no "
        "way out: give more memory (max_memory), use more devices, or pass offload='cpu'"
    )


def cpu_available() -> int | None:
    """The CPU memory a process can take now (psutil's available), else the total; None if unknown."""
    return cpu_memory(probing.probe("cpu"))


def offload(weights: int, extra: int, backend: Backend, fit: JobFit, job: Job) -> Step:
    """offload_placement's answer for the CPU memory here, with its reasons."""
    return offload_placement(weights, extra, backend, fit.caps, fit.budget_given, job, cpu_available() or 0)


def _budget_only(device: str, caps: dict[int | str, int] | None) -> Step:
    """max_memory without a model: nothing to size, but the budget is the user's, so it is passed on."""
    assert caps is not None
    budget: dict[int | str, str] = {k: f"{v // 1024**2}MiB" for k, v in caps.items()}
    note = f"with your max_memory {budget}"
    return Placement(device, budget, note), [TraceStep("placement", f"device_map={device!r} {note}")]
