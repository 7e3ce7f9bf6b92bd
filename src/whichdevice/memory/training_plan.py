"""Training on several devices: every strategy priced for the job and the first that fits, and its trace lines.

With a model and two or more devices (a launch's ranks, or the devices one process sees) every strategy of
:mod:`whichdevice.memory.strategy` is sized with the job's memory (memory/training_job.py: gradients,
optimizer state and activations at the step's peak) and the first that fits is chosen; gradient
checkpointing is priced where the fast strategies do not fit without it. The trace says every strategy's
formula, the choice, and in one process what Trainer will do and what to launch instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from whichdevice.core.job import Job
from whichdevice.core.packages import package_version
from whichdevice.core.records import TraceStep
from whichdevice.core.sizes import format_bytes
from whichdevice.device.launch_command import launch_command
from whichdevice.memory.strategy import Priced, plan_strategies
from whichdevice.memory.training_job import TrainingAsk, checkpointing_choices, setup_weights, training_memory
from whichdevice.memory.training_records import Strategy, TrainingPlan, TrainingSetup
from whichdevice.model.facts import estimate_model_size, model_shape

if TYPE_CHECKING:
    from whichdevice.device.target import Target
    from whichdevice.launch.context import DistributedContext
    from whichdevice.launch.strategy_record import LaunchStrategy

__all__ = ["plan_steps", "plan_training", "trainer_parallel_steps"]


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


# Strategies fast enough to prefer gradient checkpointing (one more forward per step) over leaving them:
# with checkpointing they still beat offloading and adapters.
_FAST = ("ddp", "zero2", "fsdp", "zero3")


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
    ask: TrainingAsk | None = None,
    layers: tuple[str, ...] = (),
) -> TrainingPlan:
    """Every strategy for ``model`` on ``devices`` devices of ``budget`` bytes, the first that fits chosen, or
    the launch's (``launched``), sized as launched; with checkpointing where the fast ones need it (``ask``).
    ``layers``: the model's no-split layer classes (model/layers.py), which FSDP wraps."""
    ask = ask or TrainingAsk(compute=compute_dtype if compute_dtype != dtype else None)
    size = estimate_model_size(model)
    shape = model_shape(model)
    compute = compute_dtype if compute_dtype != dtype else None
    paged = "paged_adamw_8bit" if ask.paged else "adamw"

    def strategies(ckpt: bool) -> TrainingPlan:
        def memory(setup: TrainingSetup) -> Any:
            return training_memory(size, shape, job, setup, fused_step=ask.fused_step, attention=ask.attention)

        lora = TrainingSetup("lora", compute_dtype, compute, ckpt)
        half = ask.quantized_compute if ask.quantized_compute != "float32" else None
        qlora = TrainingSetup("qlora", ask.quantized_compute, half, ckpt, paged)
        return plan_strategies(
            params=size.parameters,
            shape=shape,
            dtype=dtype,
            compute_dtype=compute_dtype,
            full=memory(TrainingSetup("full", dtype, compute, ckpt)),
            sharded=memory(TrainingSetup("full", dtype, compute, ckpt, sharded=True)),
            lora=Priced(setup_weights(size, lora), memory(lora)),
            qlora=Priced(setup_weights(size, qlora), memory(qlora)),
            devices=devices,
            budget=budget,
            cpu_memory=cpu_memory,
            deepspeed=package_version("deepspeed") is not None,
            layer_classes=layers,
            no_fsdp=_CPU_FSDP if backend == "cpu" else None,
            no_deepspeed=_CPU_DEEPSPEED
            if backend == "cpu" and not (launched and launched.kind == "deepspeed")
            else None,
            no_qlora="quantize=None keeps the weights unquantized" if quantize is None else None,
            largest_module=size.largest_module or None,
            launched=launched,
            local_devices=local_devices,
            checkpointing=ckpt,
        )

    if job.batch_size is None and job.max_length is None:
        # No activations priced without the job's sequences: checkpointing is not decided (None).
        return replace(strategies(bool(ask.checkpointing)), checkpointing=ask.checkpointing)
    return _preferred([strategies(ckpt) for ckpt in checkpointing_choices(ask)])


def _preferred(plans: list[TrainingPlan]) -> TrainingPlan:
    """Without checkpointing where a fast strategy fits so; else with it where one fits then; else the
    strategies that remain (offload, adapters), each without checkpointing before with it."""
    if len(plans) == 1:
        return plans[0]
    off, on = plans
    if off.launched is not None:
        return off if off.chosen is not None and off.chosen.fits else on if on.chosen and on.chosen.fits else off
    for plan in (off, on):
        if plan.chosen is not None and plan.chosen.key in _FAST:
            return plan
    for key in ("fsdp_offload", "lora", "qlora"):
        for plan in (off, on):
            if plan.chosen is not None and plan.chosen.key == key:
                return plan
    return off


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
    target: Target,
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
    launch = " ".join(launch_command(target, ["train.py"]))
    return [
        *steps,
        TraceStep(
            "launch",
            f"instead, launch one process per device: `{launch}` (res.launch_command); each rank then trains "
            f"with {plan.chosen.name}{with_} (training_arguments() fills them in under the launch)",
        ),
    ]
