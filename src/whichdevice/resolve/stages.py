"""The resolver's stages, in the order ``_resolve`` runs them: each takes the records of the stages before
it and returns its own record with the trace lines that say why (none is handed a list to fill).

1. ``request_stage``: the arguments checked, ``model=`` read once, the job, the device asked for.
2. ``backend_stage``: the backend asked for or detected, moved on where a pre-quantized checkpoint's
   method runs only on a later one.
3-6. ``fit_stages``: the target (the devices narrowed, the device), then precision, attention and
   placement on it (resolve/placing.py); run again on the idle devices by the busy-device rule.
7. ``kernels_stage`` and ``tuning_stage``: Hub kernels and serving on the placed model; what prepare()
   installs.
8. ``launch_stage``: what this process runs under, said.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from whichdevice.attention.choose import Attention, choose_attention
from whichdevice.attention.kernel_layers import kernel_layer_steps
from whichdevice.attention.kernels import decide_kernels
from whichdevice.attention.serving import decide_serving
from whichdevice.core.errors import DeviceError
from whichdevice.core.records import Trace, TraceStep
from whichdevice.device.launch_command import trainer_device_steps
from whichdevice.device.request import read_request
from whichdevice.device.selection import DevicesAsked, parse_devices
from whichdevice.device.target import Target
from whichdevice.device.targets import candidate, narrowed_target
from whichdevice.launch.accelerate_settings import read_accelerate_settings, settings_steps
from whichdevice.launch.record import Launch
from whichdevice.launch.steps import launch_steps
from whichdevice.measure.estimate import CpuJob
from whichdevice.precision.decide import Precision, decide_precision
from whichdevice.precision.tf32 import decide_tf32
from whichdevice.resolve.arguments import Arguments, check_arguments, check_shapes
from whichdevice.resolve.busy_devices import idle_devices, passed_over_step
from whichdevice.resolve.opening import calibration_step, environment_step, training_request
from whichdevice.resolve.placing import placement_stage
from whichdevice.resolve.records import Chosen, Fitted, Request
from whichdevice.tuning.decide import decide_tuning
from whichdevice.tuning.record import Tuning

if TYPE_CHECKING:
    from whichdevice.model.facts import ModelFacts

__all__ = [
    "backend_stage",
    "fit_stages",
    "kernels_stage",
    "launch_stage",
    "on_idle_devices",
    "request_stage",
    "tuning_stage",
]


def request_stage(args: Arguments) -> tuple[Request, list[TraceStep]]:
    """The arguments checked (their values, then model= read once and checked for damage, then their
    shapes), and the device the request names or leaves to detection."""
    check_arguments(args)
    devices = parse_devices(args.devices)  # its form, before anything is probed
    model = _read_model(args.model, args.revision)
    check_shapes(args)
    trace = Trace()
    if model is not None and model.hub is not None:
        trace.append(TraceStep("model", model.hub.describe()))
    accelerate = read_accelerate_settings()
    device = trace.take(training_request(trace.take(read_request(args.device)), args.task, accelerate))
    return Request(args, model, args.job(), device, accelerate, devices), trace


def _read_model(model: Any, revision: str | None) -> ModelFacts | None:
    if model is None:
        return None
    from whichdevice.model.facts import read_model_facts  # no model=, no model module loaded

    return read_model_facts(model, revision=revision)


def backend_stage(asked: Request) -> tuple[Chosen, list[TraceStep]]:
    """The backend asked for or detected; the checkpoint's own quantization decides too: a device that
    runs it, or transformers' dequantizing load (memory/prequantized.py, imported only for a model=)."""
    trace = Trace()
    first = trace.take(candidate(asked.device, asked.args.prefer, asked.args.exclude))
    if asked.model is None:
        return Chosen(first), trace
    from whichdevice.memory.prequantized import prequantized_device

    args = asked.args
    found = prequantized_device(asked.model, args.quantize, first, asked.device.detect, args.prefer, args.exclude)
    quant, target, dequantize = trace.take(found)
    return Chosen(target, quant, dequantize), trace


def fit_stages(asked: Request, chosen: Chosen, devices: DevicesAsked | None) -> Fitted:
    """The target on ``devices`` (3), its environment, then precision (4), attention (5) and placement (6)."""
    task = asked.args.task
    target, targeted = narrowed_target(chosen.target, devices, task, asked.device)
    parallel = trainer_device_steps(target, asked.device.index) if task == "training" else []
    env_set, env_lines = environment_step(target)
    precision, priced = precision_stage(asked, target, chosen)
    attention, chose = attention_stage(asked, target, precision)
    placement, placed = placement_stage(asked, target, precision, attention, chosen)
    if placement.index is not None:
        target = target.moved(placement.index)  # a device the whole job fits on alone (memory/placement.py)
    if parallel or placement.plan is not None:
        from whichdevice.memory.training_plan import trainer_parallel_steps

        parallel = trainer_parallel_steps(parallel, placement.device_map, placement.plan, target.distributed, target)
    trace = (*targeted, *parallel, *env_lines, *priced, *chose, *placed)
    return Fitted(target, env_set, precision, attention, placement, trace)


def precision_stage(asked: Request, target: Target, chosen: Chosen) -> tuple[Precision, list[TraceStep]]:
    """The weights' dtype, the mixed precision and TF32: from the CPU's calibration where measured, and
    as a pre-quantized checkpoint really loads."""
    args, model = asked.args, asked.model
    trace = Trace()
    calibration = trace.take(calibration_step(target, args))
    weights = model.stored.step_weights() if model is not None and model.stored is not None else None
    measured = CpuJob(calibration, asked.job, weights) if calibration is not None else None
    # A checkpoint from_pretrained loads as stored whatever dtype= says (bitsandbytes) is decided as
    # dtype=None, "left to transformers", which is what runs; follow_compute_dtype says what that is.
    quant = chosen.quantization if not chosen.dequantize else None
    dtype = None if quant is not None and quant.loads_as_stored else args.dtype
    checkpoint = model.checkpoint if model is not None else None
    precision = trace.take(decide_precision(target, dtype, args.task, checkpoint, measured))
    if quant is not None:
        from whichdevice.memory.prequantized import follow_compute_dtype

        stored = checkpoint.dtype if checkpoint is not None else None
        followed = trace.take(follow_compute_dtype(quant, target, precision.weights, args.dtype, stored))
        precision = precision._replace(weights=followed)
    tf32 = trace.take(decide_tf32(target, precision.computes_in(args.task), args.task, model))
    return precision._replace(tf32=tf32, measured=measured), trace


def attention_stage(asked: Request, target: Target, precision: Precision) -> tuple[Attention, list[TraceStep]]:
    """The attention the model runs, in the dtype its layers compute in."""
    args = asked.args
    calibration = precision.measured.calibration if precision.measured is not None else None
    return choose_attention(
        target,
        precision.computes_in(args.task),
        args.attn_implementation,
        task=args.task,
        model=asked.model,
        measured=calibration,
        serving=asked.job.serving,
    )


def on_idle_devices(asked: Request, chosen: Chosen, fit: Fitted) -> tuple[Fitted, list[TraceStep]]:
    """Training that fits no strategy on every device because other processes fill some: fitted again on
    the idle ones, as ``devices=`` naming them would, where a strategy fits there (resolve/busy_devices.py).
    A device the caller named (device="cuda:0", WHICHDEVICE_DEVICE) conflicts with a list: kept as asked."""
    target = fit.target
    idle = idle_devices(asked.args.task, asked.args.devices, target.launched, fit.placement.plan, target.probe)
    if idle is None:
        return fit, []
    try:
        again = fit_stages(asked, chosen, parse_devices(list(idle)))
    except DeviceError:
        return fit, []
    if again.placement.plan is None or again.placement.plan.chosen is None:
        return fit, []
    return again, [passed_over_step(target.probe, idle)]


def kernels_stage(asked: Request, fit: Fitted) -> tuple[Attention, list[TraceStep]]:
    """Hub kernels (where asked, or "auto" and they can work) and continuous batching, on the placed model."""
    target, task = fit.target, asked.args.task
    trace = Trace()
    use_kernels, key = trace.take(decide_kernels(target, asked.args.use_kernels))
    if use_kernels:
        trace.extend(kernel_layer_steps(asked.model, key, target.probe, task))
    attention = fit.attention
    weights = fit.placement.weights
    serving = trace.take(
        decide_serving(target, asked.job, attention=attention.name, dtype=weights, use_kernels=use_kernels)
    )
    return attention._replace(use_kernels=use_kernels, kernels_key=key, serving=serving), trace


def tuning_stage(
    asked: Request, chosen: Chosen, fit: Fitted, attention: Attention
) -> tuple[Tuning | None, list[TraceStep]]:
    """What prepare() installs: the CPU's measured settings, generate's static cache, the decode attention."""
    quantized = fit.placement.quantization is not None or (chosen.quantization is not None and not chosen.dequantize)
    return decide_tuning(
        fit.target, asked.args.task, fit.precision.measured, asked.model, asked.job, fit.placement, attention, quantized
    )


def launch_stage(asked: Request, fit: Fitted) -> tuple[Launch, list[TraceStep]]:
    """The launch this process belongs to and accelerate's settings, said."""
    target, task = fit.target, asked.args.task
    dist = target.distributed
    mixed = fit.precision.mixed if task == "training" else None
    steps = launch_steps(target.backend, dist)
    steps += settings_steps(asked.accelerate, task, target.backend, mixed, dist.launcher if dist else None)
    return Launch(fit.env_set, asked.accelerate, asked.args.torch_compile), steps
