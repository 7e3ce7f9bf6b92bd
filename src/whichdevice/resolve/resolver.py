"""The resolver: device, device_map, dtype, attention and distributed settings, with the reasons.

``resolve_device()`` reads probe results (never hardware directly), so it runs the same on real and
simulated machines. ``_resolve`` is the pipeline, one step per line; each step returns its value and
its trace lines, and its rules live in the folders below this one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from whichdevice.attention.choose import choose_attention
from whichdevice.attention.decode_forward import ensure_registered
from whichdevice.attention.kernel_layers import kernel_layer_steps
from whichdevice.attention.kernels import decide_kernels
from whichdevice.attention.serving import decide_serving
from whichdevice.core.dtypes import from_short
from whichdevice.core.envview import import_side_effects_undone, pinned
from whichdevice.core.errors import DeviceError
from whichdevice.core.job import Job
from whichdevice.core.records import Backend, ProbeResult, Trace, TraceStep
from whichdevice.device.detection import choose_backend, device_string
from whichdevice.device.request import ENV_DEVICE, TASKS, DeviceRequest, parse_device, read_request
from whichdevice.device.selection import parse_devices, select_devices
from whichdevice.hardware import probing
from whichdevice.hardware.store import current_store
from whichdevice.launch.accelerate_settings import (
    read_accelerate_settings,
    settings_steps,
    trainer_device_steps,
)
from whichdevice.launch.distributed import DistributedContext
from whichdevice.launch.launch_strategy import ZERO3_LOADING, partitioned_on_load
from whichdevice.launch.steps import launch_of, launch_steps
from whichdevice.memory.quantization import finish_quantization
from whichdevice.model.context import context_steps
from whichdevice.precision.decide import Precision, decide_precision
from whichdevice.precision.estimate import CpuJob
from whichdevice.precision.tf32 import decide_tf32
from whichdevice.resolve.arguments import (
    Arguments,
    check_arguments,
    check_flag,
    check_map_devices,
    check_memory_devices,
    check_shapes,
)
from whichdevice.resolve.busy_devices import idle_devices, passed_over_step
from whichdevice.resolve.memo import environment_mapping, memo_key, read_environment
from whichdevice.resolve.opening import calibration_step, environment_step, training_request
from whichdevice.resolve.resolution import Resolution, check_device_map
from whichdevice.tuning.decide import Loaded, decide_tuning

if TYPE_CHECKING:
    from whichdevice.launch.launch_strategy import LaunchStrategy
    from whichdevice.memory.largest import LargestFit
    from whichdevice.memory.load_peak import LoadPeak
    from whichdevice.memory.quantization import QuantizationPlan
    from whichdevice.memory.strategy import TrainingPlan
    from whichdevice.memory.training_job import TrainingSetup
    from whichdevice.model.facts import ModelFacts
    from whichdevice.model.quantized import CheckpointQuantization

__all__ = ["ENV_DEVICE", "TASKS", "Resolution", "TraceStep", "parse_device", "resolve_device"]


def resolve_device(
    device: Any = None,
    *,
    task: str = "inference",
    model: Any = None,
    prefer: Any = None,
    exclude: Any = None,
    dtype: Any = "auto",
    attn_implementation: str = "auto",
    device_map: Any = None,
    max_memory: Mapping[int | str, Any] | None = None,
    quantize: str | None = "auto",
    use_kernels: Any = False,
    torch_compile: bool = False,
    batch_size: int | None = None,
    max_length: int | None = None,
    max_new_tokens: int | None = None,
    offload: str | None = None,
    offload_folder: Any = None,
    revision: str | None = None,
    serving: bool = False,
    devices: Any = None,
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
        idle = idle_devices(args.task, args.devices, res.distributed is not None, res.training_plan, res.probe)
        if idle is not None:  # other processes fill some devices, and nothing fits all of them
            res = _on_idle_devices(args, res, idle)
    if key is not None:
        store.resolutions[key] = res
    return _attention_registered(res)


def _on_idle_devices(args: Arguments, res: Resolution, idle: tuple[int, ...]) -> Resolution:
    """The training planned again on ``idle`` devices only, where a strategy fits there; else ``res``.
    A device the caller named (device="cuda:0", WHICHDEVICE_DEVICE) conflicts with a list: kept as asked."""
    try:
        again = _resolve(args._replace(devices=list(idle)))
    except DeviceError:
        return res
    if again.training_plan is None or again.training_plan.chosen is None:
        return res
    return replace(again, trace=(passed_over_step(res.probe, idle), *again.trace))


def _attention_registered(res: Resolution) -> Resolution:
    # The keywords name sdpa and prepare() installs the decode attention, registering it. Registered here
    # as well, so that a script that passes the name "whichdevice_sdpa" to from_pretrained by hand (what
    # res.attn_implementation said before schema 1.9) still loads in this process. It costs nothing extra:
    # it is only chosen for a model= whose classes were read (transformers imported already), or when asked.
    if res.tuning is not None and res.tuning.decode_attention:
        ensure_registered()
    return res


def _resolve(args: Arguments) -> Resolution:
    check_arguments(args)
    asked = parse_devices(args.devices)  # its form, before anything is probed
    # model= is read here, once, and checked for damage before anything is decided from it.
    model = _read_model(args.model, args.revision)
    check_shapes(args)
    job = args.job()
    trace = Trace()
    if model is not None and model.hub is not None:
        trace.append(TraceStep("model", model.hub.describe()))
    accelerate = read_accelerate_settings()
    request = trace.take(training_request(trace.take(read_request(args.device)), args.task, accelerate))
    backend, result = trace.take(choose_backend(request, args.prefer, args.exclude))
    # The checkpoint's own quantization decides too: a device that runs it, or transformers' dequantizing load.
    quant, (backend, result), dequantize = trace.take(_prequantized(model, args, (backend, result), request))
    dist = launch_of(backend, args.task)
    result, selection = trace.take(select_devices(backend, result, asked, dist, args.task, request))
    device, count = trace.take(device_string(backend, result, request, dist, args.task))
    parallel_at = len(trace)
    parallel = trainer_device_steps(backend, result, request.index, dist) if args.task == "training" else []
    env_set = trace.take(environment_step(backend, result))
    calibration = trace.take(calibration_step(backend, args))
    checkpoint = model.checkpoint if model is not None else None
    weights = model.stored.step_weights() if model is not None and model.stored is not None else None
    measured = CpuJob(calibration, job, weights) if calibration is not None else None
    # A checkpoint from_pretrained loads as stored whatever dtype= says (bitsandbytes) is decided as
    # dtype=None, "left to transformers", which is what runs; _follow_compute_dtype says what that is.
    kept = quant is not None and not dequantize and quant.loads_as_stored
    asked = None if kept else args.dtype
    precision = trace.take(decide_precision(backend, result, asked, args.task, checkpoint, measured))
    if quant is not None and not dequantize:
        precision = precision._replace(
            weights=trace.take(_follow_compute_dtype(quant, backend, result, precision.weights, args.dtype, model))
        )
    dtype = precision.weights
    computes_in, attn = _computes_in(precision, args.task), args.attn_implementation
    tf32 = trace.take(decide_tf32(backend, result, computes_in, args.task, model))
    attention = trace.take(
        choose_attention(
            backend, result, computes_in, attn, task=args.task, model=model, measured=calibration, serving=job.serving
        )
    )
    job = replace(job, attention=attention.name, dequantize=dequantize)
    trace.extend(context_steps(model.shape.context if model is not None and model.shape else None, job.max_length))
    placed = trace.take(
        _placement(backend, result, device, dist, (dtype, computes_in), args, model, job, accelerate.strategy, request)
    )
    dtype = placed.dtype or dtype
    if isinstance(placed.device_map, str) and placed.device_map.startswith(f"{backend.name}:"):
        device = placed.device_map  # placement moved to a device the whole job fits on (memory/placement.py)
    if parallel or placed.plan is not None:
        from whichdevice.memory.training_plan import trainer_parallel_steps

        trace[parallel_at:parallel_at] = trainer_parallel_steps(
            parallel, placed.device_map, placed.plan, dist, backend, result
        )
    quantization = _quantization(placed.quantization, backend, result, dtype, args, quant, trace)
    use_kernels, kernels_key = trace.take(decide_kernels(backend, result, args.use_kernels))
    if use_kernels:
        trace.extend(kernel_layer_steps(model, kernels_key, result, args.task))
    serves = trace.take(
        decide_serving(backend, result, job, attention=attention.name, dtype=dtype, use_kernels=use_kernels)
    )
    quantized = quantization or (None if dequantize else quant)
    loaded = Loaded(dtype, attention.name, device, placed.device_map, quantized, use_kernels, attention.decode)
    tuning = trace.take(decide_tuning(backend, result, args.task, measured, model, job, loaded))
    trace.extend(launch_steps(backend, dist))
    mixed = precision.mixed if args.task == "training" else None
    trace.extend(settings_steps(accelerate, args.task, backend, mixed, dist.launcher if dist else None))
    return Resolution(
        device=device,
        backend=backend,
        task=args.task,
        device_count=count,
        device_map=placed.device_map,
        dtype_name=dtype,
        mixed_precision=precision.mixed,
        attn_implementation=attention.name,
        attn_passed=attention.passed,
        probe=result,
        max_memory=placed.max_memory,
        offload_folder=placed.offload_folder,
        distributed=dist,
        env_set=env_set,
        trace=tuple(trace),
        source=request.source,
        quantization=quantization,
        use_kernels=use_kernels,
        kernels_key=kernels_key,
        torch_compile=args.torch_compile,
        tuning=tuning,
        accelerate=accelerate,
        training_plan=placed.plan,
        fit_limits=placed.limits,
        revision=model.hub.commit if model is not None and model.hub is not None else None,
        serving=serves,
        devices=selection,
        load_peak=placed.load,
        tf32=tf32,
        training_setup=placed.setup,
    )


def _quantization(
    plan: QuantizationPlan | None,
    backend: Backend,
    result: ProbeResult,
    dtype: str | None,
    args: Arguments,
    quant: CheckpointQuantization | None,
    trace: Trace,
) -> QuantizationPlan | None:
    """bitsandbytes for an unquantized checkpoint; a pre-quantized one keeps its own (and says so for training)."""
    if quant is not None:
        from whichdevice.memory.prequantized import training_note

        trace.extend(training_note(quant, args.task))
        return None
    return trace.take(finish_quantization(plan, backend, result, dtype or "float32", args.quantize, args.task))


def _prequantized(
    model: ModelFacts | None, args: Arguments, chosen: tuple[Backend, ProbeResult], request: DeviceRequest
) -> tuple[tuple[CheckpointQuantization | None, tuple[Backend, ProbeResult], bool], list[TraceStep]]:
    """The checkpoint's own quantization decides too: a device that runs it, or transformers'
    dequantizing load (memory/prequantized.py, imported only for a model=)."""
    if model is None:
        return (None, chosen, False), []
    from whichdevice.memory.prequantized import prequantized_device

    return prequantized_device(model, args.quantize, chosen, request.detect, args.prefer, args.exclude)


def _follow_compute_dtype(
    quant: CheckpointQuantization,
    backend: Backend,
    result: ProbeResult,
    dtype: str | None,
    asked: Any,
    model: ModelFacts | None,
) -> tuple[str | None, list[TraceStep]]:
    from whichdevice.memory.prequantized import follow_compute_dtype

    stored = model.checkpoint.dtype if model is not None else None
    return follow_compute_dtype(quant, backend, result, dtype, asked, stored)


def _read_model(model: Any, revision: str | None) -> ModelFacts | None:
    if model is None:
        return None
    from whichdevice.model.facts import read_model_facts  # no model=, no model module loaded

    return read_model_facts(model, revision=revision)


def _computes_in(precision: Precision, task: str) -> str | None:
    # Under mixed precision the layers compute in the autocast dtype, not the fp32 weights' dtype.
    if task == "training" and precision.mixed is not None:
        return from_short(precision.mixed)
    return precision.weights


class _Placed(NamedTuple):
    device_map: str | dict[str, Any]
    max_memory: dict[int | str, str] | None = None
    quantization: QuantizationPlan | None = None
    offload_folder: str | None = None
    plan: TrainingPlan | None = None
    dtype: str | None = None  # the weights' dtype placement chose instead (LoRA's 16-bit base)
    limits: LargestFit | None = None
    load: LoadPeak | None = None
    setup: TrainingSetup | None = None  # how a training job trains (full, LoRA, QLoRA; checkpointing)


def _placement(
    backend: Backend,
    result: ProbeResult,
    device: str,
    dist: DistributedContext | None,
    dtypes: tuple[str | None, str | None],
    args: Arguments,
    model: ModelFacts | None,
    job: Job,
    launched: LaunchStrategy | None,
    request: DeviceRequest,
) -> tuple[_Placed, list[TraceStep]]:
    """device_map and max_memory: as asked, sized to the model, or the whole model on the device
    (``launched``: the FSDP/DeepSpeed strategy the launch carries, sized as launched)."""
    if args.max_memory is not None:
        check_memory_devices(args.max_memory, backend, result)
    if args.device_map is not None:
        check_device_map(backend, args.device_map)
        check_map_devices(args.device_map, backend, result)
        steps = [TraceStep("placement", f"device_map={args.device_map!r} as you asked")]
        if args.max_memory is None:
            return _Placed(args.device_map), steps
        from whichdevice.core.sizes import parse_size

        budget = {k: f"{parse_size(v, f'max_memory[{k!r}]') // 1024**2}MiB" for k, v in args.max_memory.items()}
        return _Placed(args.device_map, budget), steps
    if model is not None or args.max_memory is not None:
        from whichdevice.memory.training_placement import place_training

        dtype, computes = dtypes[0] or "float32", dtypes[1] or dtypes[0] or "float32"
        sized: list[TraceStep] = []
        from whichdevice.memory.training_fit import training_ask

        checkpointing = args.gradient_checkpointing
        ask = training_ask(checkpointing, backend, result, model, dtype, computes) if args.task == "training" else None
        done = place_training(
            model, backend, result, device, dist, dtype, computes, args.max_memory, args.quantize, sized, job,
            launched, movable=request.index is None, ask=ask,
        )  # fmt: skip
        loads = done.loads if done.loads != dtype else None
        return _Placed(*done.placed, done.plan, loads, done.limits, done.load, done.setup), sized
    if args.task == "training" and partitioned_on_load(None, launched, dist is not None):
        return _Placed(device), [TraceStep("placement", ZERO3_LOADING)]
    return _Placed(device), [
        TraceStep(
            "placement",
            f"device_map={device!r}: the whole model on the chosen device (pass model= to check that it fits)",
        )
    ]
