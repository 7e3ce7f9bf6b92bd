"""A pre-quantized checkpoint on this machine: can this device run its method, and what the plan says.

``runs_on`` answers from the probe (real or simulated) and the installed packages (real or
simulated): the method's packages (model/quantized.py ``NEEDS``, typed from transformers'
quantizers), the backends it runs on, the compute capability its kernels need. Where it cannot run,
``pick_device`` walks on through the detection order to a device that can; where none can, transformers'
dequantizing load (FP8, MXFP4) on the first device is the way out, else a ``DeviceUnavailableError``
that names the package, the hardware, or both. ``check_requested`` refuses quantize= asking for
another method on a quantized checkpoint: transformers would keep the checkpoint's own and ignore it.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import ConfigConflictError, DeviceUnavailableError
from whichdevice.core.frozen import frozen_record
from whichdevice.core.packages import package_version
from whichdevice.core.records import TraceStep

if TYPE_CHECKING:
    from whichdevice.core.records import Backend
    from whichdevice.device.target import Target
    from whichdevice.model.quantized import CheckpointQuantization

__all__ = [
    "Verdict",
    "check_requested",
    "follow_compute_dtype",
    "package_usable",
    "pick_device",
    "prequantized_device",
    "quantized_device",
    "runs_on",
    "training_note",
]


@frozen_record
class Verdict:
    """Whether ``method`` runs natively on a backend; else whether transformers dequantizes it there."""

    runs: bool
    dequantizes: bool
    why: str
    missing: tuple[str, ...] = ()


def _hardware(quant: CheckpointQuantization, target: Target) -> str | None:
    """What the backend lacks for the method's kernels (None: nothing)."""
    needs = quant.needs
    assert needs is not None
    if needs.backends is None:
        if quant.method.startswith("bitsandbytes") and not target.backend.bitsandbytes:
            return f"bitsandbytes does not run on {target.name} ({needs.source}; the registry's bitsandbytes rows)"
        return None
    if target.name not in needs.backends:
        return f"{quant.label} runs on {', '.join(sorted(needs.backends))}, not {target.name} ({needs.source})"
    cap = target.capability if target.name == "cuda" else None
    if needs.min_capability is not None and cap is not None and cap < needs.min_capability:
        want = ".".join(map(str, needs.min_capability))
        return (
            f"{quant.label} kernels need compute capability >= {want}; this GPU is {cap[0]}.{cap[1]} ({needs.source})"
        )
    return None


def package_usable(package: str) -> bool:
    """Whether ``package`` is installed in a version transformers uses (real or simulated)."""
    if package == "kernels":
        # transformers uses kernels only within its own version range (is_kernels_available).
        from whichdevice.attention.kernels import kernels_compatibility

        return kernels_compatibility()[0]
    return package_version(package) is not None


def runs_on(quant: CheckpointQuantization, target: Target) -> Verdict:
    """Whether this backend runs the checkpoint's method, from the probe and the installed packages."""
    needs = quant.needs
    if needs is None:
        return Verdict(True, False, f"{quant.label}: whichdevice has no row for its needs; transformers checks at load")
    lacking = _hardware(quant, target)
    missing = tuple(p for p in needs.packages if not package_usable(p))
    if lacking is None and not missing:
        return Verdict(True, False, f"{quant.label} runs on {target.name} ({needs.source})")
    why = lacking or f"{quant.label} needs {', '.join(missing)} installed ({needs.source})"
    if lacking and missing:
        why += f"; it also needs {', '.join(missing)} installed"
    return Verdict(False, needs.dequantizes, why, missing)


def pick_device(
    quant: CheckpointQuantization, chosen: Target, others: list[Target], explicit: bool
) -> tuple[Target, bool, list[TraceStep]]:
    """(the candidate that runs it, dequantize?) for a pre-quantized checkpoint, with the trace.

    ``others``: the usable backends after ``chosen`` in the detection order (empty when the device
    was asked for: an explicit choice is never moved)."""
    first = runs_on(quant, chosen)
    if first.runs:
        return chosen, False, [TraceStep("quantization", first.why)]
    steps = [TraceStep("quantization", f"not on {chosen.name}: {first.why}")]
    if not explicit:
        for other in others:
            verdict = runs_on(quant, other)
            if verdict.runs:
                steps.append(TraceStep("quantization", f"{verdict.why}: the next device in the order that runs it"))
                return other, False, steps
    if first.dequantizes:
        steps.append(
            TraceStep(
                "warning",
                f"transformers loads this {quant.label} checkpoint dequantized on {chosen.name} ({first.why}): "
                "the weights take their unquantized size",
            )
        )
        return chosen, True, steps
    raise DeviceUnavailableError(_refusal(quant, chosen.backend, first, explicit))


def _refusal(quant: CheckpointQuantization, backend: Backend, verdict: Verdict, explicit: bool) -> str:
    where = f"{backend.name}, as asked" if explicit else "any device here"
    fix = f"pip install {' '.join(shlex.quote(p) for p in verdict.missing)}" if verdict.missing else ""
    needs = quant.needs
    if needs is not None and needs.backends is not None and backend.name not in needs.backends:
        fix = (fix + "; " if fix else "") + f"run it on {' or '.join(sorted(needs.backends))}"
    elif needs is not None and needs.min_capability is not None and not verdict.missing:
        fix = f"run it on a GPU of compute capability >= {'.'.join(map(str, needs.min_capability))}"
    return (
        f"This checkpoint is pre-quantized ({quant.describe()}) and cannot run on {where}: {verdict.why}. "
        f"Fix: {fix or 'use a checkpoint in another format'}; or load an unquantized checkpoint of the model"
    )


def check_requested(quant: CheckpointQuantization, quantize: Any) -> None:
    """Refuse quantize="4bit"/"8bit" that asks for another method than the checkpoint's own."""
    if quantize in ("4bit", "8bit") and quant.method != f"bitsandbytes_{quantize}":
        raise ConfigConflictError(
            f"quantize={quantize!r} asks for bitsandbytes {quantize}, but the checkpoint is already quantized "
            f"({quant.describe()}) and transformers keeps the checkpoint's own method: pass quantize='auto' "
            "(or None), or quantize an unquantized checkpoint of the model"
        )


def quantized_device(
    quant: CheckpointQuantization, chosen: Target, detect: bool, prefer: Any, exclude: Any
) -> tuple[Target, bool, list[TraceStep]]:
    """pick_device over the usable backends after ``chosen`` in the detection order (none when asked for)."""
    from whichdevice.device.detection import candidates_after

    others = candidates_after(chosen, prefer, exclude) if detect else []
    return pick_device(quant, chosen, others, not detect)


# What from_pretrained does with a pre-quantized bitsandbytes checkpoint (transformers 5.25, read back in
# tests/model/test_quantized.py): a quantization_config passed beside the checkpoint's own is ignored
# (quantizers/auto.py, merge_quantization_configs: "The quantization_config from the model will be used";
# BitsAndBytesConfig has no loading attributes), so Linear4bit computes in the saved bnb_4bit_compute_dtype,
# and the float weights load as stored whatever dtype= says.
_BNB_KEEPS = (
    "from_pretrained keeps a pre-quantized bitsandbytes checkpoint's saved quantization_config and float "
    "weights whatever dtype= says (transformers' merge_quantization_configs uses the model's own config)"
)


def follow_compute_dtype(
    quant: CheckpointQuantization,
    target: Target,
    dtype: str | None,
    requested: Any,
    stored: str | None = None,
) -> tuple[str | None, list[TraceStep]]:
    """The load dtype that agrees with the method: for bitsandbytes what from_pretrained really loads (the
    float weights as ``stored``, the 4-bit layers in the saved compute dtype), AWQ's fp16 on CUDA/XPU
    (transformers casts bf16 to fp16 there: quantizer_awq.py:54-62). Never over a dtype asked for."""
    if quant.loads_as_stored:
        return _bitsandbytes_as_loaded(quant, target, dtype, requested, stored)
    if not (isinstance(requested, str) and requested == "auto"):
        return dtype, []
    want = quant.compute_dtype
    source = f"the checkpoint's saved compute dtype ({quant.label})"
    if quant.method == "awq" and target.name in ("cuda", "xpu"):
        want, source = (
            "float16",
            "AWQ's kernels on CUDA/XPU compute in fp16 (transformers/quantizers/quantizer_awq.py:54-62)",
        )
    if want is None or want == dtype:
        return dtype, []
    from whichdevice.precision.hardware import supports

    ok, why = supports(target, want)
    if not ok:
        return dtype, [TraceStep("dtype", f"{dtype}, not {source}: {why}")]
    return want, [TraceStep("dtype", f"{want}: {source}, in place of {dtype}")]


def _bitsandbytes_as_loaded(
    quant: CheckpointQuantization,
    target: Target,
    dtype: str | None,
    requested: Any,
    stored: str | None,
) -> tuple[str | None, list[TraceStep]]:
    """What a pre-quantized bitsandbytes checkpoint really runs in, announced as such: the dtype handed
    over is the float weights' stored one (None where unknown: then none is passed)."""
    from whichdevice.precision.hardware import parse_dtype, supports

    weights = stored if stored in ("float32", "bfloat16", "float16") else None
    steps: list[TraceStep] = []
    explicit = requested is not None and not (isinstance(requested, str) and requested == "auto")
    if explicit and parse_dtype(requested) != weights:
        steps.append(TraceStep("warning", f"dtype={requested!r} does not apply here: {_BNB_KEEPS}"))
    compute = quant.compute_dtype if quant.bits == 4 else None
    said = weights or "their stored dtype"
    layers = f", and its 4-bit layers compute in {compute} (its saved bnb_4bit_compute_dtype)" if compute else ""
    instead = f", in place of {dtype}" if dtype is not None and dtype != weights else ""
    steps.append(TraceStep("dtype", f"{said}: the checkpoint's float weights as stored{layers}{instead}: {_BNB_KEEPS}"))
    if compute is not None:
        ok, why = supports(target, compute)
        if not ok:
            steps.append(
                TraceStep(
                    "warning",
                    f"the 4-bit layers compute in {compute}, which is slow here ({why}); for another compute "
                    "dtype, load the unquantized model and quantize on load (quantize='4bit' chooses one that "
                    "runs here)",
                )
            )
    return weights, steps


def training_note(quant: CheckpointQuantization, task: str) -> list[TraceStep]:
    """How a pre-quantized model trains: adapters on its frozen quantized weights."""
    if task != "training":
        return []
    return [
        TraceStep(
            "quantization",
            f"{quant.label} weights do not train themselves: train LoRA adapters on them with "
            "whichdevice.lora_training(model, resolution)",
        )
    ]


def prequantized_device(
    model: Any, quantize: Any, chosen: Target, detect: bool, prefer: Any, exclude: Any
) -> tuple[tuple[CheckpointQuantization | None, Target, bool], list[TraceStep]]:
    """(the checkpoint's quantization, the backend that runs it, dequantize?) for ``model=``, with the
    trace; quantize= is checked against it first. Unquantized or no model: the chosen backend as is."""
    if model is None:
        return (None, chosen, False), []
    from whichdevice.model.facts import ModelFacts
    from whichdevice.model.size import checkpoint_quantization

    quant = model.quantization if isinstance(model, ModelFacts) else checkpoint_quantization(model)
    if quant is None:
        return (None, chosen, False), []
    check_requested(quant, quantize)
    picked, dequantize, steps = quantized_device(quant, chosen, detect, prefer, exclude)
    return (quant, picked, dequantize), steps
