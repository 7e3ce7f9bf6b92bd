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
from whichdevice.launch.accelerate_settings import launch_command
from whichdevice.memory.fit import FIT_FRACTION
from whichdevice.memory.job import ADAPTER_FRACTION, job_memory
from whichdevice.memory.placement import LORA_STEP, Placed, capacities, place_model
from whichdevice.memory.strategy import FULL, TrainingPlan, plan_strategies
from whichdevice.model.facts import estimate_model_size, model_shape
from whichdevice.model.layers import layer_classes

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, ProbeResult
    from whichdevice.launch.distributed import DistributedContext
    from whichdevice.memory.largest import LargestFit
    from whichdevice.memory.load_peak import LoadPeak

__all__ = ["TrainingPlaced", "place_training", "plan_training", "trainer_parallel_steps"]

TrainingPlaced = tuple[Placed, "TrainingPlan | None", str, "LargestFit | None", "LoadPeak | None"]


# accelerate 1.x AcceleratorState turns an fsdp_plugin into DistributedType.FSDP only for the MULTI_GPU,
# MULTI_XPU, MULTI_NPU, MULTI_HPU, ... types (state.py, "if ... fsdp_plugin is not None"); a MULTI_CPU run
# keeps DDP and ignores the plugin without a word, so FSDP is never handed over for the CPU.
_CPU_FSDP = "accelerate ignores fsdp on CPU processes (they train with DDP)"


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
) -> TrainingPlan:
    """Every strategy for ``model`` on ``devices`` devices of ``budget`` bytes, the first that fits chosen."""
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
        no_qlora="quantize=None keeps the weights unquantized" if quantize is None else None,
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
    movable: bool = False,
) -> TrainingPlaced:
    """(placement, the plan or None, the weights' dtype to load in, the largest job that fits, the load's
    peak) for ``job``; a training job with ``model`` on several devices gets a plan, any other job
    place_model's answer. ``movable``: the device was detected (place_model moves an inference job)."""
    training = job.task == "training" and model is not None
    devices = _device_count(backend, result, dist) if training else 1
    caps = capacities(backend, result, device, dist, max_memory) if devices > 1 else None
    plan = None
    if caps and quantize not in ("4bit", "8bit"):
        from whichdevice.memory.placement import cpu_available

        budget = int(min(caps.values()) * (1.0 if max_memory is not None else FIT_FRACTION))
        plan = plan_training(model, job, dtype, compute_dtype, devices, budget, cpu_available(), backend.name, quantize)
        trace.extend(plan_steps(plan))
    chosen = plan.chosen.key if plan and plan.chosen else None
    if dist is not None and chosen in FULL and chosen != "ddp":
        # This rank loads the whole model where the strategy wants it; Trainer then shards it.
        where = device if chosen == "zero2" else "cpu"
        trace.append(TraceStep("placement", f"device_map={where!r}: {_loading(chosen, where, dist.world_size)}"))
        return (where, None, None, None), plan, dtype, None, None
    sized: list[TraceStep] = []
    limits: list[LargestFit] = []
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
        table = "; ".join(s.line(plan.budget) for s in plan.strategies)
        raise DoesNotFitError(f"{err}. On {plan.devices} devices: {table}") from None
    trace.extend(sized)
    lora = any(s.message.startswith(LORA_STEP) for s in sized)
    if lora and compute_dtype != dtype:
        trace.append(
            TraceStep(
                "dtype",
                f"{compute_dtype} weights for the frozen base under LoRA (it computes in {compute_dtype} already; "
                f"peft keeps the adapters in float32), instead of {dtype}",
            )
        )
    return placed, plan, compute_dtype if lora else dtype, limits[0] if limits else None, loads[0] if loads else None


def _loading(key: str, where: str, ranks: int) -> str:
    if key == "zero2":
        return "ZeRO-2 keeps the whole weights on each rank's device"
    return (
        f"each of the {ranks} ranks loads the weights into CPU memory and Trainer's "
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
