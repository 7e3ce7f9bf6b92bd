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
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import DoesNotFitError
from whichdevice.core.job import Job
from whichdevice.core.packages import package_version
from whichdevice.core.records import TraceStep
from whichdevice.core.sizes import format_bytes
from whichdevice.launch.accelerate_settings import launch_command
from whichdevice.launch.launch_strategy import ZERO3_LOADING, fsdp_plugin_steps
from whichdevice.memory.fit import FIT_FRACTION
from whichdevice.memory.job import ADAPTER_FRACTION, job_memory
from whichdevice.memory.placement import LORA_STEP, Placed, capacities, place_model
from whichdevice.memory.strategy import FULL, Strategy, TrainingPlan, plan_strategies
from whichdevice.model.facts import estimate_model_size, model_shape
from whichdevice.model.layers import layer_classes

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, ProbeResult
    from whichdevice.launch.distributed import DistributedContext
    from whichdevice.launch.launch_strategy import LaunchStrategy
    from whichdevice.memory.largest import LargestFit
    from whichdevice.memory.load_peak import LoadPeak

__all__ = ["TrainingPlaced", "place_training", "plan_training", "trainer_parallel_steps"]

TrainingPlaced = tuple[Placed, "TrainingPlan | None", str, "LargestFit | None", "LoadPeak | None"]


# accelerate 1.16 AcceleratorState turns an fsdp_plugin into DistributedType.FSDP only for the MULTI_GPU,
# MULTI_XPU, MULTI_NPU, MULTI_HPU, ... types (state.py, "if ... fsdp_plugin is not None"); a MULTI_CPU run
# keeps DDP and ignores the plugin without a word, so FSDP is never handed over for the CPU. The rule is
# accelerate's, and FSDP's alone.
_CPU_FSDP = "accelerate ignores fsdp on CPU processes (they train with DDP)"
# DeepSpeed is another matter: AcceleratorState takes DistributedType.DEEPSPEED whenever the plugin or
# ACCELERATE_USE_DEEPSPEED is there "and not cpu" (state.py), and that cpu is the Accelerator's own
# argument, which Trainer does not pass, or ACCELERATE_USE_CPU: CPU processes run DeepSpeed (its CPU
# accelerator, gloo). A launch that carries it is planned as such (_runs). Unasked, it is not offered:
# its first step builds DeepSpeed's shared-memory op with the host's C++ compiler, which is not checked.
_CPU_DEEPSPEED = (
    "not offered to CPU processes unless the launch carries it (accelerate launch --use_deepspeed: DeepSpeed "
    "runs there, AcceleratorState state.py): its first step builds DeepSpeed's shared-memory op with the "
    "host's C++ compiler, which whichdevice does not check"
)


def plan_training(
    model: Any,
    job: Job,
    dtype: str,
    compute_dtype: str,
    devices: int,
    budget: int,
    cpu_memory: int | None,
    backend: str = "cuda",
    quantize: str | None = "auto",
    launched: LaunchStrategy | None = None,
    local_devices: int | None = None,
) -> TrainingPlan:
    """Every strategy for ``model`` on ``devices`` devices of ``budget`` bytes, the first that fits chosen,
    or the strategy the launch carries (``launched``), sized as launched."""
    size = estimate_model_size(model)
    shape = model_shape(model)
    eager = job.attention == "eager"
    args = (shape, size.parameters, "training", dtype, job.batch_size, job.max_length)
    full = job_memory(*args, eager=eager)
    adapters = job_memory(*args, trainable=ADAPTER_FRACTION, eager=eager)
    return plan_strategies(
        params=size.parameters,
        shape=shape,
        dtype=dtype,
        compute_dtype=compute_dtype,
        full=full,
        adapters=adapters,
        qlora_base=size.bytes_quantized(4, compute_dtype),
        devices=devices,
        budget=budget,
        cpu_memory=cpu_memory,
        deepspeed=package_version("deepspeed") is not None,
        layer_classes=layer_classes(model).names,
        no_fsdp=_CPU_FSDP if backend == "cpu" else None,
        no_deepspeed=_CPU_DEEPSPEED if backend == "cpu" and not (launched and launched.kind == "deepspeed") else None,
        no_qlora="quantize=None keeps the weights unquantized" if quantize is None else None,
        largest_module=size.largest_module or None,
        launched=launched,
        local_devices=local_devices,
    )


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
) -> TrainingPlaced:
    """(placement, plan or None, dtype to load in, largest job that fits, load peak) for ``job``: a
    training job on several devices gets a plan (``launched``: the launch's own strategy, kept), any
    other job place_model's answer (``movable``: the device was detected, an inference job may move)."""
    training = job.task == "training" and model is not None
    devices = _device_count(backend, result, dist) if training else 1
    caps = capacities(backend, result, device, dist, max_memory) if devices > 1 else None
    plan = None
    launched = _runs(launched, backend, dist, trace) if training else None
    if caps and quantize not in ("4bit", "8bit"):
        from whichdevice.memory.placement import cpu_available

        budget = int(min(caps.values()) * (1.0 if max_memory is not None else FIT_FRACTION))
        local = dist.local_world_size if dist is not None else None
        plan = plan_training(
            model, job, dtype, compute_dtype, devices, budget, cpu_available(), backend.name, quantize, launched, local
        )
        trace.extend(plan_steps(plan))
    chosen = plan.chosen.key if plan and plan.chosen else None
    if dist is not None and chosen in FULL and chosen != "ddp":
        # This rank loads the whole model where the strategy wants it; Trainer then shards it.
        where = device if chosen == "zero2" else "cpu"
        trace.append(TraceStep("placement", _loading(chosen, where, dist.world_size)))
        return (where, None, None, None), plan, dtype, None, None
    sized: list[TraceStep] = []
    limits: list[LargestFit] = []  # place_model's limits of the plan it chooses
    loads: list[LoadPeak] = []
    try:
        placed = place_model(
            model, backend, result, device, dist, dtype, max_memory, quantize, sized, job,
            compute_dtype=compute_dtype, limits=limits, loads=loads,
            movable=movable and dist is None and job.task == "inference",
        )  # fmt: skip
    except DoesNotFitError as err:
        if plan is None:
            raise
        raise DoesNotFitError(f"{err}. {_totals(plan)}") from None
    trace.extend(sized)
    lora = any(s.message.startswith(LORA_STEP) for s in sized)
    if lora and compute_dtype != dtype:
        why = f"it computes in {compute_dtype} already; peft keeps the adapters in float32"
        trace.append(
            TraceStep("dtype", f"{compute_dtype} weights for the frozen base under LoRA ({why}), instead of {dtype}")
        )
    return placed, plan, compute_dtype if lora else dtype, limits[0] if limits else None, loads[0] if loads else None


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


def _totals(plan: TrainingPlan) -> str:
    """Each strategy's total only (the formulas are in the trace): the error stays whole under its length limit."""
    table = "; ".join(
        f"{s.name}: not considered, {s.unavailable}" if s.unavailable else f"{s.name}: {format_bytes(s.per_device)}"
        for s in plan.strategies
    )
    return f"On {plan.devices} devices, per device against {format_bytes(plan.budget)}: {table}"


def _loading(key: str, where: str, ranks: int) -> str:
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


def plan_steps(plan: TrainingPlan) -> list[TraceStep]:
    """The trace lines: every strategy's formula and verdict, then the choice and why."""
    steps = [
        TraceStep("strategy", s.line(plan.budget), chosen=plan.chosen is s if s.fits else False)
        for s in plan.strategies
    ]
    if plan.chosen is None:
        steps.append(TraceStep("strategy", f"no strategy fits {plan.devices} devices"))
        return steps
    if plan.launched is not None:
        return [*steps, *_launched_steps(plan, plan.chosen)]
    kwargs = plan.kwargs()
    said = f"; TrainingArguments({_kwargs_text(kwargs)})" if kwargs else ""
    steps.append(
        TraceStep(
            "strategy",
            f"{plan.chosen.name} on {plan.devices} devices: the first that fits in the order speed first, then "
            f"memory, full fine-tuning before adapters{said}",
        )
    )
    return steps


def _launched_steps(plan: TrainingPlan, chosen: Strategy) -> list[TraceStep]:
    """The launch's strategy: kept, with no keyword of whichdevice's over it, and warned where it does not fit."""
    steps = [
        TraceStep(
            "strategy",
            f"{chosen.name} on {plan.devices} devices, as the launch carries it ({plan.launched}): training_kwargs() "
            "passes no fsdp=/deepspeed= over it (TrainingArguments would build its plugin from them instead)",
        )
    ]
    if chosen.unavailable:
        steps.append(TraceStep("warning", f"the launch asks for {chosen.name}, but {chosen.unavailable}"))
    elif not chosen.fits:
        others = [s for s in plan.strategies if s is not chosen and s.fits]
        instead = (
            f"{others[0].name} fits ({format_bytes(others[0].per_device)} per device): change the launch's config"
            if others
            else "no strategy fits these devices"
        )
        steps.append(
            TraceStep(
                "warning",
                f"the launch's {chosen.name} needs {format_bytes(chosen.per_device)} per device ({chosen.formula}), "
                f"over the {format_bytes(plan.budget)} budget of each of the {plan.devices} devices: it will run out "
                f"of memory; {instead}",
            )
        )
    return steps


def _kwargs_text(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def trainer_parallel_steps(
    steps: list[TraceStep],
    device_map: Any,
    plan: TrainingPlan | None,
    dist: DistributedContext | None,
    backend: Backend,
    result: ProbeResult,
) -> list[TraceStep]:
    """One process on several devices: the DataParallel warning (``steps``) when the model is on one
    device, or what Trainer does with a split instead; and what to launch for the plan."""
    if dist is not None or (plan is None and not steps):
        return steps
    split = isinstance(device_map, dict) or device_map in ("auto", "balanced", "balanced_low_0", "sequential")
    if split:
        # transformers' Trainer: a model whose hf_device_map spans several devices sets
        # is_model_parallel, which forces n_gpu = 1: no DataParallel (trainer.py, "Distributed strategy").
        steps = [
            TraceStep(
                "warning",
                "Trainer runs the split model as naive model parallelism (is_model_parallel: its hf_device_map "
                "spans several devices, so n_gpu = 1 and no nn.DataParallel): one device computes at a time",
            )
        ]
    if plan is None or plan.chosen is None or plan.devices < 2:
        return steps
    kwargs = plan.kwargs()
    if not (split or kwargs or plan.chosen.key != "ddp"):
        return steps  # the DataParallel warning names the launch already
    with_ = f" with TrainingArguments({_kwargs_text(kwargs)})" if kwargs else ""
    launch = " ".join(launch_command(backend, result, ["train.py"]))
    return [
        *steps,
        TraceStep(
            "launch",
            f"instead, launch one process per device: `{launch}` (res.launch_command); each rank then trains "
            f"with {plan.chosen.name}{with_} (training_arguments() fills them in under the launch)",
        ),
    ]
