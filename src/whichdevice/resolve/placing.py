"""The placement stage: where the weights go, as asked, sized to the model, or whole on the device.

One entrance a job: a training job of a known model is placed by memory/training_placement.py (the
multi-device plan, the first way to train that fits), any other job with a model or a budget by
memory/placement.py, and a job without either goes whole on the target's device. The answer is one
:class:`~whichdevice.memory.fit.Placement`, with the dtype the weights load in and bitsandbytes'
last word (an explicit request placement did not see; how quantized weights train).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from whichdevice.core.records import Trace, TraceStep
from whichdevice.launch.launch_strategy import ZERO3_LOADING, partitioned_on_load
from whichdevice.memory.fit import Placement
from whichdevice.memory.quantization import finish_quantization
from whichdevice.model.context import context_steps
from whichdevice.resolve.arguments import check_device_map, check_map_devices, check_memory_devices

if TYPE_CHECKING:
    from whichdevice.attention.choose import Attention
    from whichdevice.device.target import Target
    from whichdevice.precision.decide import Precision
    from whichdevice.resolve.records import Chosen, Request

__all__ = ["placement_stage"]


def placement_stage(
    asked: Request, target: Target, precision: Precision, attention: Attention, chosen: Chosen
) -> tuple[Placement, list[TraceStep]]:
    """The placement, with the dtype its weights load in (placement's own where it chose one: LoRA's
    16-bit base; else precision's) and its quantization settled."""
    model, job, args = asked.model, asked.job, asked.args
    trace = Trace()
    trace.extend(context_steps(model.shape.context if model is not None and model.shape else None, job.max_length))
    placed = trace.take(_placed(asked, target, precision, attention, chosen))
    weights = placed.weights or precision.weights
    quantization = placed.quantization
    if chosen.quantization is not None:
        from whichdevice.memory.prequantized import training_note

        trace.extend(training_note(chosen.quantization, args.task))  # the checkpoint keeps its own method
        quantization = None
    else:
        found = finish_quantization(quantization, target, weights or "float32", args.quantize, args.task)
        quantization = trace.take(found)
    return replace(placed, weights=weights, quantization=quantization), trace


def _placed(
    asked: Request, target: Target, precision: Precision, attention: Attention, chosen: Chosen
) -> tuple[Placement, list[TraceStep]]:
    """device_map and max_memory: as asked, sized to the model, or the whole model on the device
    (a training launch's FSDP/DeepSpeed strategy sized as launched)."""
    args, model, job = asked.args, asked.model, asked.job
    if args.max_memory is not None:
        check_memory_devices(args.max_memory, target)
    if args.device_map is not None:
        return _as_asked(asked, target)
    dtype = precision.weights or "float32"
    computes = precision.computes_in(args.task) or dtype
    if args.task == "training" and model is not None:
        from whichdevice.memory.training_fit import training_ask
        from whichdevice.memory.training_placement import place_training

        ask = training_ask(args.gradient_checkpointing, target, model, dtype, computes)
        ask = ask._replace(attention=attention.name)
        launched = asked.accelerate.strategy
        placed, steps = place_training(
            model, target, dtype, computes, args.max_memory, args.quantize, job, launched, ask
        )
        # The weights' dtype is placement's only where it differs from the one it was sized in.
        return replace(placed, weights=placed.weights if placed.weights != dtype else None), steps
    if model is not None or args.max_memory is not None:
        from whichdevice.memory.placement import place_model

        movable = asked.device.index is None and not target.launched and args.task == "inference"
        return place_model(
            model, target, dtype, args.max_memory, args.quantize, job,
            attention=attention.name, dequantize=chosen.dequantize, movable=movable,
        )  # fmt: skip
    if args.task == "training" and partitioned_on_load(None, asked.accelerate.strategy, target.launched):
        return Placement(target.device, note=ZERO3_LOADING), [TraceStep("placement", ZERO3_LOADING)]
    note = "the whole model on the chosen device (pass model= to check that it fits)"
    return Placement(target.device, note=note), [TraceStep("placement", f"device_map={target.device!r}: {note}")]


def _as_asked(asked: Request, target: Target) -> tuple[Placement, list[TraceStep]]:
    """The caller's device_map (and max_memory), checked against the devices here."""
    args = asked.args
    check_device_map(target.backend, args.device_map)
    check_map_devices(args.device_map, target)
    steps = [TraceStep("placement", f"device_map={args.device_map!r} as you asked")]
    if args.max_memory is None:
        return Placement(args.device_map, note="as you asked"), steps
    from whichdevice.core.sizes import parse_size

    budget: dict[int | str, str] = {
        k: f"{parse_size(v, f'max_memory[{k!r}]') // 1024**2}MiB" for k, v in args.max_memory.items()
    }
    return Placement(args.device_map, budget, "as you asked"), steps
