"""TF32 on NVIDIA GPUs: what it would gain where a resolution computes in fp32, and when training hands it over.

Ampere and newer NVIDIA GPUs (compute capability 8.0 and up) run fp32 matmuls on tensor cores in
TF32, which rounds each input to a 10-bit mantissa (fp32 keeps 23), but torch does so only when asked
(``torch.backends.fp32_precision = "tf32"`` from torch 2.9, ``torch.set_float32_matmul_precision("high")``,
or the older ``allow_tf32`` flags). ``TrainingArguments(tf32=True)`` asks for the whole process
(transformers 5.25 training_args.py:1677-1682 calls ``enable_tf32``, utils/import_utils.py:758-780)
and refuses where transformers' ``is_torch_tf32_available()`` is False (import_utils.py:737-755: a
CUDA build of torch and a GPU of major capability 8 or more), the CPU included.

Where a resolution computes in fp32 on such GPUs, the trace says what TF32 would gain: the GPU's
FP32 and TF32 peaks from NVIDIA's datasheet, where :data:`PEAKS` has them. For training it hands
``tf32=True`` over (``training_kwargs()``) only where all of these hold, and otherwise says which
does not: every device it uses has TF32; it trains in fp32 (under bf16 or fp16 autocast the matmuls
are 16-bit already); ``model=`` names an architecture transformers builds with its own code whose
modeling file computes no matmul in float32 on purpose (precision/full_fp32.py, read from the
installed transformers and trusted only for the version it was read from: it fails closed); and the
user set no TF32 of their own (torch's switches, where torch is imported, or
``NVIDIA_TF32_OVERRIDE``/``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE``). A ``tf32=`` passed to
``training_arguments()`` is kept as passed. Nothing is set here: for inference the trace says how to
turn TF32 on.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from whichdevice.core import envview
from whichdevice.core.packages import package_version
from whichdevice.core.records import TraceStep

if TYPE_CHECKING:
    from whichdevice.core.records import ProbeResult
    from whichdevice.device.target import Target


class ModelFacts(Protocol):
    """What this module reads of ``model=`` (whichdevice.model.facts.ModelFacts, named by its fields
    so that the resolver's memo, which imports this module, stays off the model readers)."""

    @property
    def config(self) -> Mapping[str, Any] | None: ...
    @property
    def model_type(self) -> str | None: ...


__all__ = ["ENV_VARIABLES", "PEAKS", "decide_tf32", "has_tf32", "tf32_gain", "user_tf32"]

# NVIDIA_TF32_OVERRIDE=0 turns TF32 off in cuBLAS and cuDNN whatever the framework asks (NVIDIA's
# CUDA libraries); TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 turns torch's cuBLAS TF32 on (torch's CUDA notes).
ENV_VARIABLES = ("NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")

# (name pattern, FP32 TFLOPS, TF32 tensor-core TFLOPS without sparsity, source): NVIDIA's figures.
# A GPU no row matches gets no figure (never one of another model's).
PEAKS = (
    (r"\bA100\b", 19.5, 156.0, "NVIDIA A100 datasheet (19.5 FP32, 156 TF32; 312 with sparsity)"),
    (
        r"\bH100\b.*\b(HBM3|SXM)",
        67.0,
        494.5,
        "NVIDIA H100 datasheet, SXM (67 FP32; 989 TF32 with sparsity, half without)",
    ),
    (r"\bH100 PCIe\b", 51.0, 378.0, "NVIDIA H100 datasheet, PCIe (51 FP32; 756 TF32 with sparsity, half without)"),
    (r"\bH200\b(?! NVL)", 67.0, 494.5, "NVIDIA H200 datasheet, SXM (67 FP32; 989 TF32 with sparsity, half without)"),
    (
        r"\bRTX 4090\b",
        82.6,
        82.6,
        "NVIDIA Ada architecture whitepaper, GeForce RTX 4090 (82.6 FP32; 82.6 TF32, 165.2 with sparsity)",
    ),
)
_TF32_CAPABILITY = (8, 0)


def has_tf32(target: Target) -> str | None:
    """Why these devices have no TF32 for torch (None: every one has it)."""
    if target.name != "cuda" or target.variant != "cuda":
        return f"TF32 is NVIDIA's (CUDA builds of torch); {target.variant or target.name} has none here"
    caps = [d.capability for d in target.probe.devices]
    if not caps or any(c is None for c in caps):
        return "the GPUs' compute capability is unknown"
    low = min(c for c in caps if c is not None)
    if low < _TF32_CAPABILITY:
        return f"TF32 needs compute capability 8.0 (Ampere) or newer; this GPU has {low[0]}.{low[1]}"
    return None


def tf32_gain(result: ProbeResult) -> str:
    """What TF32 would gain on these GPUs: NVIDIA's peaks where :data:`PEAKS` has the model."""
    names = sorted({d.name for d in result.devices if d.name})
    rounding = "TF32 rounds each matmul input to a 10-bit mantissa (fp32 keeps 23)"
    for pattern, fp32, tf32, source in PEAKS:
        if names and all(re.search(pattern, n, re.IGNORECASE) for n in names):
            return (
                f"fp32 matmuls would run on tensor cores in TF32: {names[0]} peaks at {tf32:g} TFLOPS in TF32 against "
                f"{fp32:g} in FP32 ({tf32 / fp32:.1f}x; {source}); {rounding}"
            )
    which = names[0] if names else "this GPU"
    return (
        f"fp32 matmuls would run on tensor cores in TF32 ({which}'s TF32 and FP32 peaks are not in whichdevice's "
        f"table; NVIDIA quotes 8x on A100); {rounding}"
    )


def user_tf32() -> str | None:
    """The TF32 setting the user made, if any: a variable, or torch's switches (read only where torch
    is already imported: without torch, nothing in this process has set them)."""
    env = envview.environ()
    for name in ENV_VARIABLES:
        if env.get(name):
            return f"{name}={env[name]!r}"
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":
        return f"torch.get_float32_matmul_precision() is {precision!r}"
    switches = (("torch.backends", torch.backends), ("torch.backends.cuda.matmul", torch.backends.cuda.matmul))
    for where, owner in switches:
        value = getattr(owner, "fp32_precision", "none")
        if value != "none":
            return f"{where}.fp32_precision is {value!r}"
    return None


def _architecture_problem(model: ModelFacts | None) -> str | None:
    """Why ``model``'s architecture cannot be cleared for TF32 (None: it computes no matmul in fp32 on purpose)."""
    if model is None or model.config is None:
        return "no model= to check the architecture against (pass model=)"
    if model.config.get("auto_map"):
        return "the model brings its own code (auto_map), which whichdevice does not read"
    from whichdevice.precision.full_fp32 import FULL_FP32_MATMULS, SOURCE  # training a model= only

    version = package_version("transformers") or "?"
    if version.split(".")[:2] != SOURCE.split(".")[:2]:
        return (
            f"the list of architectures that compute matmuls in fp32 on purpose was read from transformers {SOURCE}, "
            f"and this is {version} (scripts/gen_full_fp32.py reads it again)"
        )
    types = _model_types(model.config)
    if not types:
        return "the config names no model_type"
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    for model_type in types:
        module = model_type_to_module_name(model_type)
        lines = FULL_FP32_MATMULS.get(module)
        if lines is not None:
            cited = ", ".join(f"modeling_{module}.py:{n}" for n in lines)
            return f"{model_type!r} computes matmuls in fp32 on purpose (transformers {SOURCE} {cited})"
    return None


def _model_types(config: Mapping[str, Any]) -> list[str]:
    """Every model_type in ``config`` and its sub-configs (a vision tower, a text model)."""
    found = [config["model_type"]] if isinstance(config.get("model_type"), str) else []
    for value in config.values():
        if isinstance(value, Mapping):
            found += _model_types(value)
    return found


def decide_tf32(
    target: Target, computes_in: str | None, task: str, model: ModelFacts | None
) -> tuple[bool | None, list[TraceStep]]:
    """(True where training hands ``tf32=True`` over, else None; the trace lines)."""
    if computes_in != "float32" or has_tf32(target) is not None:
        return None, []
    gain = tf32_gain(target.probe)
    if task != "training":
        how = (
            "whichdevice sets nothing: to use it, set torch.backends.fp32_precision = 'tf32' (torch 2.9 and newer; "
            "torch.set_float32_matmul_precision('high') before) in your program"
        )
        return None, [TraceStep("tf32", f"{gain}; {how}")]
    why = user_tf32()
    if why is not None:
        return None, [TraceStep("tf32", f"{gain}; not handed over: you set TF32 yourself ({why})")]
    problem = _architecture_problem(model)
    if problem is not None:
        return None, [TraceStep("tf32", f"{gain}; tf32=True not handed over: {problem}")]
    from whichdevice.precision.full_fp32 import SOURCE

    said = (
        f"tf32=True for TrainingArguments (training_kwargs()): {model.model_type if model else ''!r} computes no "
        f"matmul in fp32 on purpose (transformers {SOURCE}); TrainingArguments sets TF32 for the whole process, "
        "and a tf32= of yours is kept"
    )
    return True, [TraceStep("tf32", f"{gain}; {said}")]
