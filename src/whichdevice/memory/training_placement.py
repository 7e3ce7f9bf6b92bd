"""Placement for training on several devices: the strategy with its numbers, and what this process loads.

With a model and two or more devices (a launch's ranks, or the devices one process sees) every
strategy of :mod:`whichdevice.memory.strategy` is sized and the first that fits is chosen. Under a
launch, this rank loads what the strategy wants (its own device for DDP, the CPU for FSDP, which
shards the weights onto the devices in Trainer) and ``training_kwargs()`` carries its settings. In
one process the trace says what Trainer will do with what ``device_map`` placed (DataParallel over a
model on one device, or the split's layers one device at a time, never both) and what to launch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

from whichdevice.core.errors import DoesNotFitError
from whichdevice.core.job import Job
from whichdevice.core.records import TraceStep
from whichdevice.launch.launch_strategy import ZERO3_LOADING, fsdp_plugin_steps
from whichdevice.memory import placement as place
from whichdevice.memory.fit import JobFit, priced_margin
from whichdevice.memory.placement import Placed, capacities, place_model
from whichdevice.memory.strategy import FULL, TrainingPlan
from whichdevice.memory.training_fit import (
    Tried,
    first_need,
    ladder,
    lora_step,
    passed_over,
    priced_lines,
    sized_training,
    training_limits,
    ways_out,
)
from whichdevice.memory.training_job import TrainingAsk, TrainingSetup, adapter_parameters
from whichdevice.memory.training_plan import plan_steps, plan_training
from whichdevice.model.facts import estimate_model_size
from whichdevice.model.layers import layer_classes

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, ProbeResult
    from whichdevice.launch.distributed import DistributedContext
    from whichdevice.launch.launch_strategy import LaunchStrategy
    from whichdevice.memory.largest import LargestFit
    from whichdevice.memory.load_peak import LoadPeak

__all__ = ["TrainingPlaced", "place_training", "place_training_job", "plan_training"]


class TrainingPlaced(NamedTuple):
    """Placement's answer: where the weights go, the multi-device plan, the dtype the weights load in,
    the largest job that fits, the load's peak, and the way the job trains (None for inference)."""

    placed: Placed
    plan: TrainingPlan | None
    loads: str
    limits: LargestFit | None
    load: LoadPeak | None
    setup: TrainingSetup | None = None


def _device_count(backend: Backend, result: ProbeResult, dist: DistributedContext | None) -> int:
    if dist is not None:
        return dist.world_size
    if backend.shared_device or backend.distributed_backend in (None, "xla"):
        return 1
    return result.device_count


def place_training(
    model: Any,
    backend: Backend,
    result: ProbeResult,
    device: str,
    dist: DistributedContext | None,
    dtype: str,
    compute_dtype: str,
    max_memory: Mapping[int | str, Any] | None,
    quantize: str | None,
    trace: list[TraceStep],
    job: Job,
    launched: LaunchStrategy | None = None,
    movable: bool = False,
    ask: TrainingAsk | None = None,
) -> TrainingPlaced:
    """Placement for ``job``: a training job on several devices gets a plan (``launched``: the launch's own
    strategy, kept); a training job on one device the first way to train that fits (memory/training_fit.py);
    any other job place_model's answer (``movable``: the device was detected, an inference job may move)."""
    training = job.task == "training" and model is not None
    ask = ask or TrainingAsk(compute=compute_dtype if compute_dtype != dtype else None)
    devices = _device_count(backend, result, dist) if training else 1
    caps = capacities(backend, result, device, dist, max_memory) if devices > 1 else None
    plan = None
    launched = _runs(launched, backend, dist, trace) if training else None
    if caps and quantize not in ("4bit", "8bit"):
        from whichdevice.memory.placement import cpu_available

        # A device's budget for every strategy's job at once: the margin's share of the job priced on the
        # device itself (the job can be no larger), so one budget serves all rows.
        margin = priced_margin(backend.name, result.variant, "training")
        smallest = min(caps.values())
        budget = smallest if max_memory is not None else margin.usable(smallest, smallest)
        local = dist.local_world_size if dist is not None else None
        layers = layer_classes(model).names
        plan = plan_training(
            model, job, dtype, compute_dtype, devices, budget, cpu_available(), backend.name, quantize, launched, local,
            ask, layers,
        )  # fmt: skip
        trace.extend(plan_steps(plan))
    chosen = plan.chosen.key if plan and plan.chosen else None
    if dist is not None and chosen in FULL and chosen != "ddp":
        # This rank loads the whole model where the strategy wants it; Trainer then shards it.
        where = device if chosen == "zero2" else "cpu"
        trace.append(TraceStep("placement", loading(chosen, where, dist.world_size)))
        return TrainingPlaced((where, None, None, None), plan, dtype, None, None, _planned(plan, dtype, compute_dtype))
    if not training:
        limits: list[LargestFit] = []
        loads: list[LoadPeak] = []
        placed = place_model(
            model, backend, result, device, dist, dtype, max_memory, quantize, trace, job, limits=limits, loads=loads,
            movable=movable and dist is None and job.task == "inference",
        )  # fmt: skip
        return TrainingPlaced(placed, None, dtype, limits[0] if limits else None, loads[0] if loads else None)
    return _one_process(model, (backend, result), device, dist, dtype, max_memory, quantize, trace, job, ask, plan)


def _one_process(
    model: Any,
    on: tuple[Backend, ProbeResult],
    device: str,
    dist: DistributedContext | None,
    dtype: str,
    max_memory: Mapping[int | str, Any] | None,
    quantize: str | None,
    trace: list[TraceStep],
    job: Job,
    ask: TrainingAsk,
    plan: TrainingPlan | None,
) -> TrainingPlaced:
    """What this process loads for training: the first way that fits its device (or devices, split)."""
    from whichdevice.memory.capacity import can_split, memory_step

    backend, result = on
    caps = capacities(backend, result, device, dist, max_memory)
    if caps is None:
        placed = place_model(model, backend, result, device, dist, dtype, max_memory, quantize, trace, job)
        return TrainingPlaced(placed, plan, dtype, None, None, None)
    if max_memory is None:
        trace.append(memory_step(backend, result, device, dist))
    margin = priced_margin(backend.name, result.variant, job.task)
    fit = JobFit(device, caps, max_memory is not None, can_split(backend, dist), backend.name, 0, job, margin)
    limits: list[LargestFit] = []
    loads: list[LoadPeak] = []
    try:
        placed, setup = place_training_job(model, on, fit, dtype, quantize, job, ask, trace, (limits, loads))
    except DoesNotFitError as err:
        if plan is None:
            raise
        raise DoesNotFitError(f"{err}. {plan.totals()}") from None
    loads_in = setup.weights if setup.train != "full" else dtype
    if setup.train == "lora" and setup.weights != dtype:
        why = "it computes in it already; peft keeps the adapters in float32"
        trace.append(
            TraceStep("dtype", f"{setup.weights} weights for the frozen base under LoRA ({why}), instead of {dtype}")
        )
    return TrainingPlaced(placed, plan, loads_in, limits[0] if limits else None, loads[0] if loads else None, setup)


def _planned(plan: TrainingPlan | None, dtype: str, compute: str | None) -> TrainingSetup | None:
    """The way a multi-device plan trains, as one rank holds it."""
    if plan is None or plan.chosen is None:
        return None
    key = plan.chosen.key
    train = "lora" if key == "lora" else "qlora" if key == "qlora" else "full"
    return TrainingSetup(train, dtype if train == "full" else plan.compute_dtype, compute, plan.checkpointing)


def _runs(
    launched: LaunchStrategy | None, backend: Backend, dist: DistributedContext | None, trace: list[TraceStep]
) -> LaunchStrategy | None:
    """The launch's strategy where Trainer will run it: in a launched run, DeepSpeed anywhere but under
    ACCELERATE_USE_CPU, FSDP off the CPU (AcceleratorState, state.py); elsewhere the trace says why it is
    not sized."""
    if launched is None:
        if dist is not None and dist.launcher.startswith("accelerate launch"):
            trace.append(
                TraceStep(
                    "strategy",
                    "the launch carries no FSDP or DeepSpeed setting (ACCELERATE_USE_FSDP/ACCELERATE_USE_DEEPSPEED "
                    "unset: accelerate runs DDP unless a keyword says otherwise), so whichdevice plans the strategy",
                )
            )
        return None
    where = None
    if launched.cpu_forced:
        where = (
            f"{launched.cpu_forced} makes accelerate's AcceleratorState a CPU run (cpu=True), which takes neither "
            "DeepSpeed nor FSDP (state.py): it trains with DDP"
        )
    elif backend.name == "cpu" and launched.kind == "fsdp":
        where = (
            "accelerate runs CPU processes with DDP and ignores it (AcceleratorState takes FSDP only for "
            "accelerator types, state.py)"
        )
        trace.extend(fsdp_plugin_steps())
    elif dist is None:
        where = "this is one process, not a launched rank: start it with `accelerate launch` to run it"
    if where is None:
        return launched
    trace.append(TraceStep("strategy", f"the launch's variables carry {launched.name} ({launched.said}), but {where}"))
    return None


def loading(key: str, where: str, ranks: int) -> str:
    """The placement line of a rank that loads for a sharding strategy."""
    if key == "zero2":
        return f"device_map={where!r}: ZeRO-2 keeps the whole weights on each rank's device"
    if key == "zero3":
        return ZERO3_LOADING
    return (
        f"device_map={where!r}: each of the {ranks} ranks loads the weights into CPU memory and Trainer's "
        f"{'DeepSpeed ZeRO-3' if key == 'zero3' else 'FSDP'} wrapper moves its shard to the device "
        "(fsdp_config cpu_ram_efficient_loading=True loads them on rank 0 only, where CPU memory is short)"
    )


def place_training_job(
    model: Any,
    on: tuple[Backend, ProbeResult],
    fit: JobFit,
    dtype: str,
    quantize: str | None,
    job: Job,
    ask: TrainingAsk,
    trace: list[TraceStep],
    found: tuple[list[LargestFit] | None, list[LoadPeak] | None],
) -> tuple[Placed, TrainingSetup]:
    """The first way to train ``model`` that fits ``fit``'s devices (its placement, and the way), else the
    fit error with every way priced and the ways out. ``found`` gets the chosen way's largest job and
    its load's peak. Offload (where asked) takes the first way's job when nothing fits."""
    limits, loads = found
    setups = ladder(dtype, ask, quantize)
    if job.batch_size is None and job.max_length is None:
        # Activations are not counted without the job's sequences: checkpointing would price the same,
        # so it is not decided (None), unless the caller pinned it.
        firsts = {(s.train, s.bits): s for s in reversed(setups)}
        setups = [replace(s, checkpointing=ask.checkpointing) for s in setups if firsts[(s.train, s.bits)] is s]
    if ask.no_checkpointing is not None:
        trace.append(TraceStep("training", f"gradient checkpointing not priced: {ask.no_checkpointing}"))
    tried: list[Tried] = []
    for setup in setups:
        size, weights, memory = sized_training(model, job, setup, ask)
        sized = replace(fit, extra=memory.bytes)
        steps: list[TraceStep] = []
        if setup.train == "qlora":
            note = first_need(tried)
            try:
                placed = place.place_quantized(model, size, on, sized, setup, note, job, steps, loads)
            except DoesNotFitError:
                tried.append((setup, weights, memory))
                continue
        else:
            placement = place.checked_split(model, setup.weights, sized.plan(weights), sized, memory, weights)
            if not placement.fits:
                tried.append((setup, weights, memory))
                continue
            training_limits(model, size, job, setup, ask, sized, weights, steps, limits)
            if setup.train == "lora":
                steps.append(lora_step(setup))
            placed = place.loaded(placement, (model, size, setup.weights, memory, weights), sized, on, steps, loads)
        trace.extend([*priced_lines(size, setup, weights, memory), *passed_over(tried, fit, setup), *steps])
        adapters = adapter_parameters(size, setup.lora_r)[0] if setup.train != "full" else None
        return placed, replace(setup, adapters=adapters, passed_over=first_need(tried, fit))
    first = tried[0] if tried else None
    if job.offload is not None and first is not None:
        setup, weights, memory = first
        trace.extend(priced_lines(estimate_model_size(model), setup, weights, memory))
        return place.offload(weights, memory.bytes, on[0], fit, job, trace), setup
    raise ways_out(model, job, ask, on, fit, tried)
