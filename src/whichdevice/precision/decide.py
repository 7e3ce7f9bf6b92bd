"""The dtype a model loads in and the mixed precision it trains with, from the hardware and the checkpoint.

Inference follows vLLM's rule: keep a checkpoint's half-precision dtype when this hardware runs it,
downcast an fp32 checkpoint to the hardware's half precision, and cast a bf16 or fp32 checkpoint to
fp16 only for an architecture known to be safe in fp16 (``precision/fp16_safe.py``, an allow-list
that fails closed: any other gets fp32, and the trace says how to opt in). Training keeps fp32
weights under mixed precision: ``fp16=True`` needs them (torch's GradScaler refuses to unscale fp16
gradients), and bf16 weights lose most small optimizer updates.

An explicit ``dtype=`` for training names both the weights and the compute (one rule,
:data:`EXPLICIT_TRAINING_DTYPE`): float32 is fp32 weights without autocast, bfloat16 pure bf16
weights computing in bf16, float16 fp16 weights without loss scaling. No autocast to another dtype
is added behind the user's back; ``dtype="auto"`` is the way to get fp32 weights with autocast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from whichdevice.core.records import TraceStep
from whichdevice.measure.estimate import lost_figures
from whichdevice.precision.hardware import choose_dtype, parse_dtype, supports
from whichdevice.precision.measured import MeasuredChoice, measured_dtype, measured_training
from whichdevice.precision.record import Precision
from whichdevice.precision.training import training_precision

if TYPE_CHECKING:
    from whichdevice.device.target import Target
    from whichdevice.measure.estimate import CpuJob
    from whichdevice.model.size import CheckpointDtype

__all__ = ["EXPLICIT_TRAINING_DTYPE", "decide_precision"]

EXPLICIT_TRAINING_DTYPE = (
    "an explicit dtype for training is both the weights' dtype and the compute dtype: no autocast to "
    "another dtype is added (dtype='auto' chooses fp32 weights with mixed precision)"
)


def pure_half_cost(dtype: str) -> str:
    """Why AdamW loses updates on pure ``dtype`` ("bfloat16" or "float16") weights, in figures torch states
    (torch.finfo, torch.optim.AdamW's default eps, which TrainingArguments' adam_epsilon repeats)."""
    import inspect
    import math

    import torch

    info = torch.finfo(getattr(torch, dtype))
    short = "bf16" if dtype == "bfloat16" else "fp16"
    bits = 1 - round(math.log2(info.eps))
    # A weight keeps an update only above half its spacing, between eps/4 and eps/2 of it; AdamW steps by about lr.
    text = (
        f"{short} keeps {bits} significant bits (torch.finfo eps {info.eps:.3g}), so an update under "
        f"{info.eps / 4:.2%} of a weight always rounds away"
    )
    if dtype == "bfloat16":
        text += ": AdamW at lr=2e-5 moves a weight of 0.02 by 0.1%"
    else:
        eps = inspect.signature(torch.optim.AdamW).parameters["eps"].default
        tiny = info.smallest_normal * info.eps  # the smallest subnormal: the last mantissa bit below the normals
        text += (
            f"; AdamW's eps {eps:g} is below fp16's smallest subnormal {tiny:.3g}, so in fp16 optimizer state it "
            "rounds to 0 and a step whose second moment underflows divides by zero"
        )
    return text


def decide_precision(
    target: Target,
    requested: Any,
    task: str,
    checkpoint: CheckpointDtype | None,
    measured: CpuJob | None = None,
) -> tuple[Precision, list[TraceStep]]:
    """The weights' dtype and the training flag that agrees with it, with the trace of why.

    ``measured``: the CPU's calibration and the job, which decide the CPU's dtype for dtype="auto"
    in place of its flags (see precision.measured)."""
    steps = [TraceStep("dtype", f"checkpoint: {_read(checkpoint)}")] if checkpoint is not None else []
    if requested is None:
        precision, more = _left_to_transformers(target, task, checkpoint)
    elif isinstance(requested, str) and requested == "auto":
        if task == "training":
            precision, more = _training(target, checkpoint, measured)
        elif measured is not None and (lost := lost_figures(*measured, _candidates(checkpoint))):
            weights, more = _inference(target, checkpoint)
            them = "it" if len(lost) == 1 else "them"
            moved = f"the calibration's {', '.join(lost)} could not be timed steadily and this job needs {them}"
            more.append(TraceStep("calibration", f"{moved}: the CPU's flags decide its dtype"))
            precision = Precision(weights, _flag_for(target, weights))
        elif measured is not None:
            choice, more = _measured_inference(target, measured, checkpoint)
            flag = _flag_for(target, choice.dtype)
            precision = Precision(choice.dtype, flag)
        else:
            weights, more = _inference(target, checkpoint)
            precision = Precision(weights, _flag_for(target, weights))
    else:
        precision, more = _as_asked(target, parse_dtype(requested), task, checkpoint)
    return precision, steps + more


def _read(checkpoint: CheckpointDtype) -> str:
    dtype = checkpoint.dtype or "no float dtype stated"
    arch = f", model_type {checkpoint.model_type!r}" if checkpoint.model_type else ""
    return f"{dtype}{arch} (read from {checkpoint.source})"


def _unsafe(checkpoint: CheckpointDtype | None) -> str | None:
    """Why this checkpoint must not be cast to fp16 (None: it may). Fails closed: an architecture
    not on the allow-list is unsafe; an fp16 checkpoint is its authors' choice and stays fp16."""
    if checkpoint is None:
        return None
    from whichdevice.precision.fp16_safe import fp16_evidence, known_overflow  # read only for a model=

    overflow = known_overflow(checkpoint.model_type)
    if overflow is not None:
        return f"{checkpoint.model_type!r} is known to overflow in fp16 ({overflow})"
    if checkpoint.dtype == "float16" or fp16_evidence(checkpoint.model_type) is not None:
        return None
    arch = repr(checkpoint.model_type) if checkpoint.model_type else "an architecture the checkpoint does not name"
    return (
        f"{arch} is not on the fp16 allow-list (whichdevice.precision.fp16_safe): bf16-trained activations "
        "beyond fp16's 65504 become inf, then NaN (transformers #39686, #39972); pass dtype='float16' to opt in"
    )


def _flag_for(target: Target, weights: str | None) -> str | None:
    # The mixed-precision flag that can train these weights: never fp16 over fp16 weights.
    if weights == "float16":
        return None
    return training_precision(target, weights)[0]


def _inference(target: Target, checkpoint: CheckpointDtype | None) -> tuple[str, list[TraceStep]]:
    hardware, why = choose_dtype(target)
    stored = checkpoint.dtype if checkpoint is not None else None
    unsafe = _unsafe(checkpoint)
    keep = stored in ("bfloat16", "float16") and (stored != "float16" or unsafe is None)
    if keep and stored is not None and supports(target, stored)[0]:
        return stored, [TraceStep("dtype", f"{stored}: the checkpoint's own dtype, which runs natively here")]
    if hardware != "float16":
        fits = "the checkpoint's fp32 downcast: " if stored == "float32" and hardware != "float32" else ""
        return hardware, [TraceStep("dtype", f"{hardware}: {fits}{why}")]
    # fp16 is this hardware's half precision (T4, V100, MPS, GPUs without bf16).
    if unsafe is not None:
        safe = "bfloat16" if supports(target, "bfloat16")[0] else "float32"
        return safe, [TraceStep("dtype", f"{safe}, not fp16: {unsafe}")]
    from whichdevice.precision.fp16_safe import fp16_evidence

    evidence = fp16_evidence(checkpoint.model_type) if checkpoint is not None else None
    if stored in ("bfloat16", "float32") and evidence is not None:
        return "float16", [
            TraceStep("dtype", f"float16: {why}; {checkpoint.model_type!r} is known to run in fp16 ({evidence})")  # type: ignore[union-attr]
        ]
    return "float16", [TraceStep("dtype", f"float16: {why}")]


def _measured_inference(
    target: Target, measured: CpuJob, checkpoint: CheckpointDtype | None
) -> tuple[MeasuredChoice, list[TraceStep]]:
    stored = checkpoint.dtype if checkpoint is not None else None
    fp16 = _candidates(checkpoint)[2:]
    # The default, kept unless another dtype is measured faster: a half-precision checkpoint's own
    # dtype where this CPU runs it natively (upcasting it is a choice a figure must justify), else fp32.
    native = stored in ("bfloat16", *fp16) and stored is not None and supports(target, stored)[0]
    default = stored if native and stored is not None else "float32"
    choice = measured_dtype(measured.calibration, measured.job, ("bfloat16", *fp16), default, measured.weights)
    cast = f" (the checkpoint is {stored})" if stored is not None and stored != choice.dtype else ""
    return choice, [TraceStep("dtype", f"{choice.dtype}{cast}: {choice.why}")]


def _candidates(checkpoint: CheckpointDtype | None) -> tuple[str, ...]:
    """fp32 and the half precisions measured for it. bf16 has fp32's range, so it is always one;
    fp16 only keeps an fp16 checkpoint as it is."""
    stored = checkpoint.dtype if checkpoint is not None else None
    fp16 = ("float16",) if stored == "float16" and _unsafe(checkpoint) is None else ()
    return ("float32", "bfloat16", *fp16)


def _training(
    target: Target,
    checkpoint: CheckpointDtype | None,
    measured: CpuJob | None = None,
) -> tuple[Precision, list[TraceStep]]:
    mixed, why = training_precision(target, None)
    if measured is not None:
        ok, said = measured_training(measured.calibration)
        mixed, why = (mixed, f"{why} ({said})") if ok is None else ("bf16" if ok else None, said)
    unsafe = _unsafe(checkpoint)
    steps: list[TraceStep] = []
    if mixed == "fp16" and unsafe is not None:
        mixed, why = None, f"no fp16 autocast: {unsafe}"
    if mixed is None:
        return Precision("float32", None), [
            TraceStep("dtype", f"float32 weights, fp32 training: {why.removeprefix('fp32 training: ')}"),
            *steps,
        ]
    scaler = (
        "; torch's GradScaler unscales only fp32 gradients ('Attempting to unscale FP16 gradients')"
        if mixed == "fp16"
        else f"; not pure bf16 weights: {pure_half_cost('bfloat16')}"
    )
    line = f"float32 weights with {mixed} mixed precision ({mixed}=True autocast): {why}{scaler}"
    return Precision("float32", mixed), [TraceStep("dtype", line), *steps]


def _as_asked(
    target: Target, dtype: str, task: str, checkpoint: CheckpointDtype | None
) -> tuple[Precision, list[TraceStep]]:
    ok, why = supports(target, dtype)
    note = "" if ok else f" (slow or unsupported here: {why})"
    steps = [TraceStep("dtype", f"{dtype} as you asked{note}")]
    if dtype == "float16" and _unsafe(checkpoint) is not None:
        steps.append(TraceStep("warning", f"fp16 as you asked, though {_unsafe(checkpoint)}"))
    if task != "training":
        return Precision(dtype, _flag_for(target, dtype)), steps
    if dtype == "float16":
        steps.append(
            TraceStep(
                "training",
                "fp16=False: fp16 weights train without loss scaling, since fp16=True would stop at the first "
                "step ('Attempting to unscale FP16 gradients'); for fp16 mixed precision keep dtype='auto' "
                "(fp32 weights)",
            )
        )
        steps.append(
            TraceStep(
                "warning",
                f"pure fp16 training (fp16 weights, no mixed precision, no loss scaling): {pure_half_cost(dtype)}; "
                "keep dtype='auto' for fp32 weights under mixed precision",
            )
        )
        return Precision(dtype, None), steps
    if dtype == "bfloat16":
        # bf16=True autocasts to the weights' own dtype: the compute stays the bf16 the user named.
        steps.append(
            TraceStep(
                "training",
                f"pure bf16 weights and bf16 compute ({EXPLICIT_TRAINING_DTYPE}): {pure_half_cost(dtype)}",
            )
        )
        return Precision(dtype, "bf16" if ok else None), steps
    steps.append(
        TraceStep(
            "training", f"{dtype} weights and {dtype} compute, bf16=False and fp16=False: {EXPLICIT_TRAINING_DTYPE}"
        )
    )
    return Precision(dtype, None), steps


def _left_to_transformers(
    target: Target, task: str, checkpoint: CheckpointDtype | None
) -> tuple[Precision, list[TraceStep]]:
    steps = [TraceStep("dtype", "dtype=None: left to transformers (the checkpoint's own dtype)")]
    stored = checkpoint.dtype if checkpoint is not None else None
    mixed = training_precision(target, None)[0]
    if mixed == "fp16" and (stored != "float32" or _unsafe(checkpoint) is not None):
        # bf16 autocast trains weights of any dtype; fp16=True only fp32 ones (known to be fp32 here).
        mixed = None
    if task == "training" and mixed is None:
        steps.append(TraceStep("training", "no mixed precision: the weights' dtype is the checkpoint's"))
    return Precision(None, mixed), steps
