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
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DoesNotFitError
from whichdevice.core.job import Job
from whichdevice.core.records import Trace, TraceStep
from whichdevice.launch.launch_strategy import ZERO3_LOADING, fsdp_plugin_steps
from whichdevice.memory import placement as place
from whichdevice.memory.fit import JobFit, Placement, priced_margin
from whichdevice.memory.placement import capacities, place_model
from whichdevice.memory.strategy import FULL
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
from whichdevice.memory.training_job import TrainingAsk, adapter_parameters
from whichdevice.memory.training_plan import plan_steps, plan_training
from whichdevice.memory.training_records import TrainingPlan, TrainingSetup
from whichdevice.model.facts import estimate_model_size
from whichdevice.model.layers import layer_classes

if TYPE_CHECKING:
    from whichdevice.device.target import Target
    from whichdevice.launch.strategy_record import LaunchStrategy

__all__ = ["place_training", "place_training_job", "plan_training"]


def _device_count(target: Target) -> int:
    if target.distributed is not None:
        return target.distributed.world_size
    if target.backend.shared_device or target.distributed_backend in (None, "xla"):
        return 1
    return target.probe.device_count


def place_training(
    model: Any,
    target: Target,
    dtype: str,
    compute_dtype: str,
    max_memory: Mapping[int | str, Any] | None,
    quantize: str | None,
    job: Job,
    launched: LaunchStrategy | None = None,
    ask: TrainingAsk | None = None,
) -> tuple[Placement, list[TraceStep]]:
    """Placement for a training ``job`` of ``model``: on several devices a plan (``launched``: the
    launch's own strategy, kept) and what this rank loads for it; on one device the first way to train
    that fits (memory/training_fit.py). The placement carries the plan, the way the job trains and the
    dtype its weights load in."""
    trace = Trace()
    ask = ask or TrainingAsk(compute=compute_dtype if compute_dtype != dtype else None)
    devices = _device_count(target)
    caps = capacities(target, max_memory) if devices > 1 else None
    plan = None
    launched = trace.take(_runs(launched, target))
    if caps and quantize not in ("4bit", "8bit"):
        from whichdevice.memory.placement import cpu_available

        # A device's budget for every strategy's job at once: the margin's share of the job priced on the
        # device itself (the job can be no larger), so one budget serves all rows.
        margin = priced_margin(target.name, target.variant, "training")
        smallest = min(caps.values())
        budget = smallest if max_memory is not None else margin.usable(smallest, smallest)
        local = target.distributed.local_world_size if target.distributed is not None else None
        layers = layer_classes(model).names
        plan = plan_training(
            model, job, dtype, compute_dtype, devices, budget, cpu_available(), target.name, quantize, launched, local,
            ask, layers,
        )  # fmt: skip
        trace.extend(plan_steps(plan))
    chosen = plan.chosen.key if plan and plan.chosen else None
    if target.distributed is not None and chosen in FULL and chosen != "ddp":
        # This rank loads the whole model where the strategy wants it; Trainer then shards it.
        where = target.device if chosen == "zero2" else "cpu"
        note = loading(chosen, where, target.distributed.world_size)
        trace.append(TraceStep("placement", note))
        setup = _planned(plan, dtype, compute_dtype)
        return Placement(where, note=note, weights=dtype, plan=plan, setup=setup), trace
    try:
        placed, steps = _one_process(model, target, dtype, max_memory, quantize, job, ask)
    except DoesNotFitError as err:
        if plan is None:
            raise
        raise DoesNotFitError(f"{err}. {plan.totals()}") from None
    return replace(placed, plan=plan), [*trace, *steps]


def _one_process(
    model: Any,
    target: Target,
    dtype: str,
    max_memory: Mapping[int | str, Any] | None,
    quantize: str | None,
    job: Job,
    ask: TrainingAsk,
) -> tuple[Placement, list[TraceStep]]:
    """What this process loads for training: the first way that fits its device (or devices, split)."""
    from whichdevice.memory.capacity import can_split, memory_step

    caps = capacities(target, max_memory)
    if caps is None:
        placed, steps = place_model(model, target, dtype, max_memory, quantize, job)
        return replace(placed, weights=dtype), steps
    trace = Trace()
    if max_memory is None:
        trace.append(memory_step(target))
    margin = priced_margin(target.name, target.variant, job.task)
    fit = JobFit(target.device, caps, max_memory is not None, can_split(target), target.name, 0, job, margin)
    placed = trace.take(place_training_job(model, target, fit, dtype, quantize, job, ask))
    setup = placed.setup
    assert setup is not None  # place_training_job says how the job trains, or raises
    loads_in = setup.weights if setup.train != "full" else dtype
    if setup.train == "lora" and setup.weights != dtype:
        why = "it computes in it already; peft keeps the adapters in float32"
        trace.append(
            TraceStep("dtype", f"{setup.weights} weights for the frozen base under LoRA ({why}), instead of {dtype}")
        )
    return replace(placed, weights=loads_in), trace


def _planned(plan: TrainingPlan | None, dtype: str, compute: str | None) -> TrainingSetup | None:
    """The way a multi-device plan trains, as one rank holds it."""
    if plan is None or plan.chosen is None:
        return None
    key = plan.chosen.key
    train = "lora" if key == "lora" else "qlora" if key == "qlora" else "full"
    return TrainingSetup(train, dtype if train == "full" else plan.compute_dtype, compute, plan.checkpointing)


def _runs(launched: LaunchStrategy | None, target: Target) -> tuple[LaunchStrategy | None, list[TraceStep]]:
    """The launch's strategy where Trainer will run it: in a launched run, DeepSpeed anywhere but under
    ACCELERATE_USE_CPU, FSDP off the CPU (AcceleratorState, state.py); elsewhere the lines say why it is
    not sized."""
    dist = target.distributed
    if launched is None:
        if dist is not None and dist.launcher.startswith("accelerate launch"):
            return None, [
                TraceStep(
                    "strategy",
                    "the launch carries no FSDP or DeepSpeed setting (ACCELERATE_USE_FSDP/ACCELERATE_USE_DEEPSPEED "
                    "unset: accelerate runs DDP unless a keyword says otherwise), so whichdevice plans the strategy",
                )
            ]
        return None, []
    where, steps = None, []
    if launched.cpu_forced:
        where = (
            f"{launched.cpu_forced} makes accelerate's AcceleratorState a CPU run (cpu=True), which takes neither "
            "DeepSpeed nor FSDP (state.py): it trains with DDP"
        )
    elif target.name == "cpu" and launched.kind == "fsdp":
        where = (
            "accelerate runs CPU processes with DDP and ignores it (AcceleratorState takes FSDP only for "
            "accelerator types, state.py)"
        )
        steps = fsdp_plugin_steps()
    elif dist is None:
        where = "this is one process, not a launched rank: start it with `accelerate launch` to run it"
    if where is None:
        return launched, []
    said = TraceStep("strategy", f"the launch's variables carry {launched.name} ({launched.said}), but {where}")
    return None, [*steps, said]


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
    target: Target,
    fit: JobFit,
    dtype: str,
    quantize: str | None,
    job: Job,
    ask: TrainingAsk,
) -> tuple[Placement, list[TraceStep]]:
    """The first way to train ``model`` that fits ``fit``'s devices: its placement, carrying the way
    (``setup``), its largest job and its load's peak; else the fit error with every way priced and the
    ways out. Offload (where asked) takes the first way's job when nothing fits."""
    setups = ladder(dtype, ask, quantize)
    if job.batch_size is None and job.max_length is None:
        # Activations are not counted without the job's sequences: checkpointing would price the same,
        # so it is not decided (None), unless the caller pinned it.
        firsts = {(s.train, s.bits): s for s in reversed(setups)}
        setups = [replace(s, checkpointing=ask.checkpointing) for s in setups if firsts[(s.train, s.bits)] is s]
    trace = Trace()
    if ask.no_checkpointing is not None:
        trace.append(TraceStep("training", f"gradient checkpointing not priced: {ask.no_checkpointing}"))
    tried: list[Tried] = []
    for setup in setups:
        size, weights, memory = sized_training(model, job, setup, ask)
        sized = replace(fit, extra=memory.bytes)
        if setup.train == "qlora":
            note = first_need(tried)
            try:
                placed, steps = place.place_quantized(model, size, target, sized, setup, note, job)
            except DoesNotFitError:
                tried.append((setup, weights, memory))
                continue
        else:
            placement = place.checked_split(model, setup.weights, sized.plan(weights), sized, memory, weights)
            if not placement.fits:
                tried.append((setup, weights, memory))
                continue
            limits = training_limits(model, size, job, setup, ask, sized, weights)
            said = [TraceStep("limits", limits.text())] if limits is not None else []
            if setup.train == "lora":
                said.append(lora_step(setup))
            placed, steps = place.loaded(placement, (model, size, setup.weights, memory, weights), sized, target)
            placed, steps = replace(placed, limits=limits), [*said, *steps]
        trace.extend([*priced_lines(size, setup, weights, memory), *passed_over(tried, fit, setup), *steps])
        adapters = adapter_parameters(size, setup.lora_r)[0] if setup.train != "full" else None
        return replace(placed, setup=replace(setup, adapters=adapters, passed_over=first_need(tried, fit))), trace
    first = tried[0] if tried else None
    if job.offload is not None and first is not None:
        setup, weights, memory = first
        trace.extend(priced_lines(estimate_model_size(model), setup, weights, memory))
        placed, steps = place.offload(weights, memory.bytes, target.backend, fit, job)
        return replace(placed, setup=setup), [*trace, *steps]
    raise ways_out(model, job, ask, target, fit, tried)
