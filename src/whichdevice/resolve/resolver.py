"""The resolver: device, device_map, dtype, attention and distributed settings, with the reasons.

``resolve_device()`` reads probe results (never hardware directly), so everything here runs the
same on real and simulated machines. Precedence: the ``device`` argument, then the
``WHICHDEVICE_DEVICE`` variable, then detection in the registry's declared order; each step that
mattered is kept in the trace that :meth:`Resolution.explain` prints.

``_resolve`` is the pipeline, one step per line; each step returns its value and its trace lines.
The steps' rules live in the modules below this one (request, detection, precision, attention,
placement, quantization, kernels_support, distributed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from whichdevice.attention.choose import choose_attention
from whichdevice.attention.decode import ATTENTION_NAME, ensure_registered
from whichdevice.attention.kernels import decide_kernels
from whichdevice.core.dtypes import from_short
from whichdevice.core.envview import pinned
from whichdevice.core.job import Job
from whichdevice.core.packages import transformers_problem
from whichdevice.core.records import Backend, ProbeResult, Trace, TraceStep
from whichdevice.device.detection import choose_backend, device_string
from whichdevice.device.request import ENV_DEVICE, TASKS, DeviceRequest, parse_device, read_request
from whichdevice.device.selection import parse_devices, select_devices
from whichdevice.hardware import probing
from whichdevice.hardware.envhooks import EnvAction, apply_env_defaults
from whichdevice.hardware.store import current_store
from whichdevice.launch.accelerate_settings import (
    ENV_USE_CPU,
    AccelerateSettings,
    check_cpu_request,
    read_accelerate_settings,
    settings_steps,
    trainer_device_steps,
)
from whichdevice.launch.distributed import DistributedContext
from whichdevice.launch.steps import launch_of, launch_steps
from whichdevice.memory.quantization import finish_quantization
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
from whichdevice.resolve.memo import environment_mapping, memo_key, read_environment
from whichdevice.resolve.resolution import Resolution, check_device_map
from whichdevice.tuning.decide import Loaded, decide_tuning

if TYPE_CHECKING:
    from whichdevice.hardware.calibration import Calibration
    from whichdevice.memory.largest import LargestFit
    from whichdevice.memory.load_peak import LoadPeak
    from whichdevice.memory.quantization import QuantizationPlan
    from whichdevice.memory.strategy import TrainingPlan
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
    devices: Any = None,
    refresh: bool = False,
) -> Resolution:
    """Resolve the device and settings for ``task`` ("inference" or "training") on this machine.

    ``device`` (a string or ``torch.device``) beats ``WHICHDEVICE_DEVICE``, which beats detection.
    ``model`` (a local path, a cached model id or a config) lets placement and quantization know
    the model's size, and lets attention be checked against the model's classes (this imports
    transformers); ``max_memory`` (from_pretrained's form) states the memory budget.
    ``batch_size`` (sequences run together) and ``max_length`` (tokens per sequence, prompt
    included, as ``generate(max_length=)``) describe the job, where the caller knows them: with
    ``model=`` the fit then counts the KV cache and activations (training always counts gradients
    and optimizer state); ``max_new_tokens`` (as ``generate(max_new_tokens=)``) is what a one-time
    setup on a CPU (weights packed ahead) is counted against. ``offload="cpu"`` (or ``"disk"`` with
    ``offload_folder=path``) lets a model that fits no device spill to CPU memory (then disk);
    without it whichdevice never offloads. ``devices`` (Lightning's forms: a count, a list of indices,
    -1, or a string such as "0,2") limits the resolution to those devices, as making them visible would.
    ``use_kernels`` is off unless asked: "auto" turns Hub kernels on where they can work, True
    insists (transformers downloads and runs their compiled code from the Hub).
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
        devices=devices,
    )
    environment = read_environment()
    key = memo_key(args, environment)
    store = current_store()
    if key is not None:
        cached = store.resolutions.get(key)
        if cached is not None:
            return _attention_registered(cast(Resolution, cached))
    # Resolved under the reading the key was made from: another thread's change lands in the next key.
    with pinned(environment_mapping(environment)):
        res = _resolve(args)
    if key is not None:
        store.resolutions[key] = res
    return _attention_registered(res)


def _attention_registered(res: Resolution) -> Resolution:
    # whichdevice's decode attention must be registered with transformers before a model is built
    # with it, or transformers says the name "is not supported". Registered here, so that a caller
    # who passes res.attn_implementation by hand gets it. It costs nothing extra: the name is only
    # chosen for a model= whose classes were read (transformers imported already), or when asked for.
    if res.attn_implementation == ATTENTION_NAME:
        ensure_registered()
    return res


def _resolve(args: Arguments) -> Resolution:
    check_arguments(args)
    asked = parse_devices(args.devices)  # its form, before anything is probed
    # model= is read here, once, and checked for damage before anything is decided from it.
    model = _read_model(args.model)
    check_shapes(args)
    job = args.job()
    trace = Trace()
    accelerate = read_accelerate_settings()
    request = trace.take(_training_request(trace.take(read_request(args.device)), args.task, accelerate))
    backend, result = trace.take(choose_backend(request, args.prefer, args.exclude))
    # The checkpoint's own quantization decides too: a device that runs it, or transformers' dequantizing load.
    quant, (backend, result), dequantize = trace.take(_prequantized(model, args, (backend, result), request))
    dist = launch_of(backend, args.task)
    result, selection = trace.take(select_devices(backend, result, asked, dist, args.task, request))
    device, count = trace.take(device_string(backend, result, request, dist, args.task))
    parallel_at = len(trace)
    parallel = trainer_device_steps(backend, result, request.index, dist) if args.task == "training" else []
    env_set = trace.take(_environment(backend, result))
    calibration = trace.take(_calibration(backend, args))
    checkpoint = model.checkpoint if model is not None else None
    weights = model.stored.step_weights() if model is not None and model.stored is not None else None
    measured = CpuJob(calibration, job, weights) if calibration is not None else None
    precision = trace.take(decide_precision(backend, result, args.dtype, args.task, checkpoint, measured))
    if quant is not None and not dequantize:
        precision = precision._replace(
            weights=trace.take(_follow_compute_dtype(quant, backend, result, precision.weights, args.dtype))
        )
    dtype = precision.weights
    computes_in, attn = _computes_in(precision, args.task), args.attn_implementation
    tf32 = trace.take(decide_tf32(backend, result, computes_in, args.task, model))
    attention = trace.take(
        choose_attention(backend, result, computes_in, attn, task=args.task, model=model, measured=calibration)
    )
    job = replace(job, attention=attention.name, dequantize=dequantize)
    placed = trace.take(_placement(backend, result, device, dist, (dtype, computes_in), args, model, job, request))
    dtype = placed.dtype or dtype
    if isinstance(placed.device_map, str) and placed.device_map.startswith(f"{backend.name}:"):
        device = placed.device_map  # placement moved to a device the whole job fits on (memory/placement.py)
    if parallel or placed.plan is not None:
        from whichdevice.memory.training_placement import trainer_parallel_steps

        trace[parallel_at:parallel_at] = trainer_parallel_steps(
            parallel, placed.device_map, placed.plan, dist, backend, result
        )
    quantization = _quantization(placed.quantization, backend, result, dtype, args, quant, trace)
    use_kernels, kernels_key = trace.take(decide_kernels(backend, result, args.use_kernels))
    quantized = quantization or (None if dequantize else quant)
    loaded = Loaded(dtype, attention.name, device, placed.device_map, quantized, use_kernels)
    tuning = trace.take(decide_tuning(backend, result, args.task, measured, model, job, loaded))
    trace.extend(launch_steps(backend, dist))
    trace.extend(settings_steps(accelerate, args.task, backend, precision.mixed if args.task == "training" else None))
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
        devices=selection,
        load_peak=placed.load,
        tf32=tf32,
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
    quant: CheckpointQuantization, backend: Backend, result: ProbeResult, dtype: str | None, asked: Any
) -> tuple[str | None, list[TraceStep]]:
    from whichdevice.memory.prequantized import follow_compute_dtype

    return follow_compute_dtype(quant, backend, result, dtype, asked)


def _read_model(model: Any) -> ModelFacts | None:
    if model is None:
        return None
    from whichdevice.model.facts import read_model_facts  # no model=, no model module loaded

    return read_model_facts(model)


def _training_request(
    request: DeviceRequest, task: str, settings: AccelerateSettings
) -> tuple[DeviceRequest, list[TraceStep]]:
    """ACCELERATE_USE_CPU puts TrainingArguments and accelerate on the CPU: training follows it."""
    if task != "training" or not settings.cpu_forced:
        return request, []
    if not request.detect:
        check_cpu_request(settings, request.name, request.asked or request.name, request.source)
        return request, []
    step = TraceStep(
        "request",
        f"{ENV_USE_CPU}={settings.use_cpu!r}: training on the CPU, where accelerate and Trainer "
        "will run (beats detection)",
    )
    return DeviceRequest(ENV_USE_CPU, "cpu", "cpu"), [step]


def _environment(backend: Backend, result: ProbeResult) -> tuple[tuple[EnvAction, ...], list[TraceStep]]:
    """The env hooks of the chosen backend, and the warnings everything below depends on."""
    env_set = tuple(result.env_set) + apply_env_defaults(backend, "select")
    steps = [TraceStep("env", action.message) for action in env_set]
    steps += [TraceStep("warning", warning) for warning in result.warnings]
    problem = transformers_problem()
    if problem is not None:
        # Everything resolved here is handed to transformers: say so before it fails there.
        steps.append(TraceStep("warning", problem))
    return env_set, steps


def _calibration(backend: Backend, args: Arguments) -> tuple[Calibration | None, list[TraceStep]]:
    """The CPU's measured speeds (whichdevice.hardware.calibration): measured on first need when the dtype is
    "auto", else read from the cache only."""
    if backend.name != "cpu":
        return None, []
    from whichdevice.hardware.calibration import calibration

    auto = isinstance(args.dtype, str) and args.dtype == "auto"
    calib, why = calibration(measure=auto)
    if calib is None:
        return None, [TraceStep("calibration", f"not used: {why}; the CPU's flags decide")] if auto else []
    return calib, [TraceStep("calibration", f"{calib.summary()} ({why})")]


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


def _placement(
    backend: Backend,
    result: ProbeResult,
    device: str,
    dist: DistributedContext | None,
    dtypes: tuple[str | None, str | None],
    args: Arguments,
    model: ModelFacts | None,
    job: Job,
    request: DeviceRequest,
) -> tuple[_Placed, list[TraceStep]]:
    """device_map and max_memory: as asked, sized to the model, or the whole model on the device."""
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
        done, plan, loads, limits, peak = place_training(
            model, backend, result, device, dist, dtype, computes, args.max_memory, args.quantize, sized, job,
            movable=request.index is None,
        )  # fmt: skip
        return _Placed(*done, plan=plan, dtype=loads if loads != dtype else None, limits=limits, load=peak), sized
    return _Placed(device), [
        TraceStep(
            "placement",
            f"device_map={device!r}: the whole model on the chosen device (pass model= to check that it fits)",
        )
    ]
