"""The resolver: device, device_map, dtype, attention and distributed settings, with the reasons.

``resolve_device()`` reads probe results (never hardware directly), so it runs the same on real and
simulated machines. ``_resolve`` is the pipeline, one step per line; each step returns its value and
its trace lines, and its rules live in the folders below this one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal, cast

from whichdevice.attention.choose import choose_attention
from whichdevice.attention.decode_forward import ensure_registered
from whichdevice.attention.kernels import decide_kernels
from whichdevice.attention.record import Attention
from whichdevice.attention.serving import decide_serving
from whichdevice.core.envview import import_side_effects_undone, pinned
from whichdevice.core.errors import DeviceError
from whichdevice.core.frozen import NamedTuple
from whichdevice.core.records import EnvAction, Trace, TraceStep
from whichdevice.device.request import ENV_DEVICE, TASKS, Task, parse_device
from whichdevice.device.selection import DevicesAsked, parse_devices
from whichdevice.device.target import Target
from whichdevice.device.targets import candidate, narrowed_target
from whichdevice.hardware import probing
from whichdevice.hardware.store import current_store
from whichdevice.launch.accelerate_settings import settings_steps
from whichdevice.launch.launch_strategy import ZERO3_LOADING, partitioned_on_load
from whichdevice.launch.record import Launch
from whichdevice.launch.steps import launch_of, launch_steps
from whichdevice.measure.estimate import CpuJob
from whichdevice.memory.quantization import finish_quantization
from whichdevice.memory.record import Placement
from whichdevice.precision.decide import decide_precision
from whichdevice.precision.record import Precision
from whichdevice.precision.tf32 import decide_tf32
from whichdevice.resolve.arguments import Arguments, check_flag, check_memory_devices, placement_as_asked
from whichdevice.resolve.busy_devices import idle_devices, passed_over_step
from whichdevice.resolve.memo import environment_mapping, memo_key, read_environment
from whichdevice.resolve.opening import Request, calibration_step, environment_step, request_stage
from whichdevice.resolve.resolution import Resolution
from whichdevice.tuning.decide import decide_tuning
from whichdevice.tuning.record import Tuning

if TYPE_CHECKING:
    from whichdevice.model.quantized import CheckpointQuantization
    from whichdevice.resolve.arguments import DeviceLike, DtypeLike, ModelLike, Quantize

__all__ = ["ENV_DEVICE", "TASKS", "Resolution", "TraceStep", "parse_device", "resolve_device"]


def resolve_device(
    device: DeviceLike | None = None,
    *,
    task: Task = "inference",
    model: ModelLike | None = None,
    prefer: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    dtype: DtypeLike | None = "auto",
    attn_implementation: str = "auto",
    device_map: str | Mapping[str, int | str] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    quantize: Quantize | None = "auto",
    use_kernels: bool | Literal["auto"] = False,
    torch_compile: bool = False,
    batch_size: int | None = None,
    max_length: int | None = None,
    max_new_tokens: int | None = None,
    offload: Literal["cpu", "disk"] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    serving: bool = False,
    devices: int | str | Sequence[int] | None = None,
    gradient_checkpointing: bool | None = None,
    refresh: bool = False,
) -> Resolution:
    """Resolve the device and settings for ``task`` ("inference" or "training") on this machine.

    ``device`` beats ``WHICHDEVICE_DEVICE``, which beats detection. ``model`` (a local path, a Hub id:
    its config and safetensors headers fetched, never its weights, at ``revision``; or a config) sizes
    the job and checks attention against its classes. ``batch_size``, ``max_length`` (prompt included)
    and ``max_new_tokens`` describe the job where known; ``offload`` lets a model that fits no device
    spill to the CPU (then disk); ``devices`` (a count, indices, -1 or "0,2") limits it to those devices;
    ``serving=True`` is many requests through continuous batching;
    ``use_kernels="auto"`` turns Hub kernels on where they can work; ``gradient_checkpointing`` (training:
    None decides, on where the job fits only with it). Every argument: docs/api.md.
    A repeated call with the same arguments and environment returns the same Resolution.
    """
    if refresh is not False:
        check_flag(refresh, "refresh")
        probing.clear_cache()
    args = Arguments(
        device=device,
        task=task,
        model=model,
        prefer=prefer,
        exclude=exclude,
        dtype=dtype,
        attn_implementation=attn_implementation,
        device_map=device_map,
        max_memory=max_memory,
        quantize=quantize,
        use_kernels=use_kernels,
        torch_compile=torch_compile,
        batch_size=batch_size,
        max_length=max_length,
        max_new_tokens=max_new_tokens,
        offload=offload,
        offload_folder=offload_folder,
        revision=revision,
        serving=serving,
        devices=devices,
        gradient_checkpointing=gradient_checkpointing,
    )
    environment = read_environment()
    key = memo_key(args, environment)
    store = current_store()
    if key is not None:
        cached = store.resolutions.get(key)
        if cached is not None:
            return _attention_registered(cast(Resolution, cached))
    # Resolved under the reading the key was made from: another thread's change lands in the next key.
    # Reading model= may import the architecture's module, which sets TORCHINDUCTOR_CACHE_DIR: undone.
    with pinned(environment_mapping(environment)), import_side_effects_undone():
        res = _resolve(args)
    if key is not None:
        store.resolutions[key] = res
    return _attention_registered(res)


def _attention_registered(res: Resolution) -> Resolution:
    # The keywords name sdpa and prepare() installs the decode attention, registering it. Registered here
    # as well, so that a script that passes the name "whichdevice_sdpa" to from_pretrained by hand (what
    # res.attn_implementation said before schema 1.9) still loads in this process. It costs nothing extra:
    # it is only chosen for a model= whose classes were read (transformers imported already), or when asked.
    if res.tuning is not None and res.tuning.decode_attention:
        ensure_registered()
    return res


def _resolve(args: Arguments) -> Resolution:
    trace = Trace()
    # 1. The request: the arguments checked, model= read once, the job, the device asked for.
    asked = trace.take(request_stage(args))
    # 2. The backend: asked for or detected, moved on where a pre-quantized checkpoint's method runs only later.
    chosen = trace.take(_backend(asked))
    # 3-6. The target (devices, device), then precision, attention and placement on it.
    fit = _fit(asked, chosen, asked.devices)
    # Busy devices: training that fits no strategy on every device, since other processes fill some, is
    # fitted again (3-6) on the idle ones; the line that says so leads the trace.
    fit, passed_over = _on_idle_devices(asked, chosen, fit)
    trace.extend(fit.trace)
    # 7. Kernels and serving on the placed model, then what prepare() installs.
    attention = trace.take(_kernels(asked, fit))
    tuning = trace.take(_tuning(asked, chosen, fit, attention))
    # 8. The launch this process belongs to, and accelerate's settings.
    launch = trace.take(_launch(asked, fit))
    # The answer, built from the stage records.
    hub = asked.model.hub if asked.model is not None else None
    revision = hub.commit if hub is not None else None
    steps = (*passed_over, *trace)
    return Resolution(args.task, fit.target, fit.precision, attention, fit.placement, tuning, launch, steps, revision)


class Chosen(NamedTuple):
    """The backend chosen, on its first device (``target``, narrowed in ``_fit``), and a
    pre-quantized checkpoint's method with whether transformers loads it dequantized there."""

    target: Target
    quantization: CheckpointQuantization | None = None
    dequantize: bool = False


class Fitted(NamedTuple):
    """The records of the stages that the busy-device rule runs again: the target, the environment its
    backend's hooks set, its precision, attention and placement, and their trace lines."""

    target: Target
    env_set: tuple[EnvAction, ...]
    precision: Precision
    attention: Attention
    placement: Placement
    trace: tuple[TraceStep, ...]


def _backend(asked: Request) -> tuple[Chosen, list[TraceStep]]:
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


def _fit(asked: Request, chosen: Chosen, devices: DevicesAsked | None) -> Fitted:
    """The target on ``devices`` (3), its environment, then precision (4), attention (5) and placement (6)."""
    task = asked.args.task
    dist = launch_of(chosen.target.backend, task)
    target, targeted = narrowed_target(chosen.target, devices, dist, task, asked.device)
    parallel = []
    if task == "training":  # device/launch_command.py: imported only for training, as fit.py for a model
        from whichdevice.device.launch_command import trainer_device_steps

        parallel = trainer_device_steps(target, asked.device.index)
    env_set, env_lines = environment_step(target)
    precision, priced = _precision(asked, target, chosen)
    attention, chose = _attention(asked, target, precision)
    placement, placed = _placement(asked, target, precision, attention, chosen)
    if placement.index is not None:
        target = target.moved(placement.index)  # a device the whole job fits on alone (memory/placement.py)
    if parallel or placement.plan is not None:
        from whichdevice.memory.training_plan import trainer_parallel_steps

        parallel = trainer_parallel_steps(parallel, placement.device_map, placement.plan, target.distributed, target)
    trace = (*targeted, *parallel, *env_lines, *priced, *chose, *placed)
    return Fitted(target, env_set, precision, attention, placement, trace)


def _precision(asked: Request, target: Target, chosen: Chosen) -> tuple[Precision, list[TraceStep]]:
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


def _attention(asked: Request, target: Target, precision: Precision) -> tuple[Attention, list[TraceStep]]:
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


def _on_idle_devices(asked: Request, chosen: Chosen, fit: Fitted) -> tuple[Fitted, list[TraceStep]]:
    """Training that fits no strategy on every device because other processes fill some: fitted again on
    the idle ones, as ``devices=`` naming them would, where a strategy fits there (resolve/busy_devices.py).
    A device the caller named (device="cuda:0", WHICHDEVICE_DEVICE) conflicts with a list: kept as asked."""
    target = fit.target
    idle = idle_devices(asked.args.task, asked.args.devices, target.launched, fit.placement.plan, target.probe)
    if idle is None:
        return fit, []
    try:
        again = _fit(asked, chosen, parse_devices(list(idle)))
    except DeviceError:
        return fit, []
    if again.placement.plan is None or again.placement.plan.chosen is None:
        return fit, []
    return again, [passed_over_step(target.probe, idle)]


def _kernels(asked: Request, fit: Fitted) -> tuple[Attention, list[TraceStep]]:
    """Hub kernels (where asked, or "auto" and they can work) and continuous batching, on the placed model."""
    target, task = fit.target, asked.args.task
    trace = Trace()
    use_kernels, key = trace.take(decide_kernels(target, asked.args.use_kernels))
    if use_kernels:
        from whichdevice.attention.kernel_layers import kernel_layer_steps

        trace.extend(kernel_layer_steps(asked.model, key, target.probe, task))
    attention = fit.attention
    weights = fit.placement.weights
    serving = trace.take(
        decide_serving(target, asked.job, attention=attention.name, dtype=weights, use_kernels=use_kernels)
    )
    return attention._replace(use_kernels=use_kernels, kernels_key=key, serving=serving), trace


def _tuning(asked: Request, chosen: Chosen, fit: Fitted, attention: Attention) -> tuple[Tuning | None, list[TraceStep]]:
    """What prepare() installs: the CPU's measured settings, generate's static cache, the decode attention."""
    quantized = fit.placement.quantization is not None or (chosen.quantization is not None and not chosen.dequantize)
    return decide_tuning(
        fit.target, asked.args.task, fit.precision.measured, asked.model, asked.job, fit.placement, attention, quantized
    )


def _launch(asked: Request, fit: Fitted) -> tuple[Launch, list[TraceStep]]:
    """The launch this process belongs to and accelerate's settings, said."""
    target, task = fit.target, asked.args.task
    dist = target.distributed
    mixed = fit.precision.mixed if task == "training" else None
    steps = launch_steps(target.backend, dist)
    steps += settings_steps(asked.accelerate, task, target.backend, mixed, dist.launcher if dist else None)
    return Launch(fit.env_set, asked.accelerate, asked.args.torch_compile), steps


def _placement(
    asked: Request, target: Target, precision: Precision, attention: Attention, chosen: Chosen
) -> tuple[Placement, list[TraceStep]]:
    """The placement, with the dtype its weights load in (placement's own where it chose one: LoRA's
    16-bit base; else precision's) and its quantization settled."""
    model, job, args = asked.model, asked.job, asked.args
    trace = Trace()
    if model is not None and model.shape:
        # Only a model's shape has a context to warn about (model/context.py is imported with it).
        from whichdevice.model.context import context_steps

        trace.extend(context_steps(model.shape.context, job.max_length))
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
        return placement_as_asked(args.device_map, args.max_memory, target)
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


def __getattr__(name: str) -> object:
    """``DeviceLike`` and the other argument aliases (resolve/arguments.py), made when first read."""
    from whichdevice.resolve.arguments import argument_alias

    return argument_alias(name, globals())
