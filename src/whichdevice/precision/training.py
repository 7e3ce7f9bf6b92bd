"""Mixed precision for training: the one a resolution trains with, and whether a flag the user set runs here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from whichdevice.core.errors import ConfigConflictError
from whichdevice.core.frozen import NamedTuple
from whichdevice.precision.hardware import supports

if TYPE_CHECKING:
    from whichdevice.device.target import Target
    from whichdevice.measure.figures import Calibration

__all__ = ["FlagCheck", "check_precision_flag", "fp16_weights_problem", "precision_conflicts", "training_precision"]


def _cpu_cost(dtype: str, calib: Calibration | None) -> str:
    """What ``dtype`` costs on this CPU, from its own calibration (a prompt-sized matmul against fp32,
    the training-shaped figure), or that it was not measured here: never a figure from another machine."""
    short = "bf16" if dtype == "bfloat16" else "fp16"
    figure = calib.speed(dtype, "prompt") if calib is not None and not calib.lost("prompt") else None
    if figure is None or figure <= 0:
        return f"its cost is not measured on this CPU (`whichdevice calibrate` times a {short} matmul against fp32)"
    return (
        f"measured on this CPU (whichdevice's calibration): a prompt-sized {short} matmul runs at {figure:.2f}x "
        f"the speed of fp32 ({1 / figure:.1f}x the time)"
    )


# Apple's quirk: whichdevice does not hand over autocast training on MPS.
_NO_AUTOCAST = {"mps": "no mixed precision on MPS (fp32 training); pass fp16=True to try autocast"}


def training_precision(target: Target, dtype_name: str | None) -> tuple[str | None, str]:
    """("bf16" | "fp16" | None, why) for mixed-precision training here."""
    if dtype_name == "float32":
        return None, "fp32 training: the resolved dtype is fp32"
    if target.name in _NO_AUTOCAST:
        return None, _NO_AUTOCAST[target.name]
    bf16_ok, bf16_why = supports(target, "bfloat16")
    if dtype_name in (None, "bfloat16") and bf16_ok:
        return "bf16", bf16_why
    if not target.backend.fast_fp16:
        return None, f"fp32 training: {bf16_why}"
    fp16_ok, fp16_why = supports(target, "float16")
    if fp16_ok:
        return "fp16", f"{bf16_why}; fp16 with loss scaling instead" if not bf16_ok else fp16_why
    return None, f"fp32 training: {fp16_why}"


class FlagCheck(NamedTuple):
    """Whether a user's ``bf16=True`` / ``fp16=True`` runs here: "ok", "warn" (runs, with a cost) or "refuse"."""

    verdict: Literal["ok", "warn", "refuse"]
    message: str


def check_precision_flag(target: Target, flag: str, calib: Calibration | None = None) -> FlagCheck:
    """``flag`` is "bf16" or "fp16": refuse only what cannot run; warn, with the cost, what runs slowly.

    ``calib``: this CPU's calibration, whose figures a CPU warning quotes (None: not measured here).
    A warning recommends the other flag only where that flag's own check is "ok" (no answer both
    recommends and warns against one flag)."""
    ok, why = supports(target, "bfloat16" if flag == "bf16" else "float16")
    if ok and (flag == "bf16" or target.backend.fast_fp16):
        return FlagCheck("ok", why)
    family = "rocm" if target.name == "cuda" and target.variant == "rocm" else target.name
    runs_slowly = _RUNS_SLOWLY.get(family)
    said = runs_slowly(target, flag, why, calib) if runs_slowly is not None else None
    return FlagCheck("warn", said) if said is not None else FlagCheck("refuse", _refusal(target, flag, why))


def _on_cpu(target: Target, flag: str, why: str, calib: Calibration | None) -> str:
    dtype = "bfloat16" if flag == "bf16" else "float16"
    said = f"{flag}=True on {target.device} runs, slowly: {why}; {_cpu_cost(dtype, calib)}"
    if flag == "fp16":
        said += "; accelerate makes no loss scaler on the CPU, so small gradients underflow to zero"
    return said


def _on_nvidia(target: Target, flag: str, why: str, calib: Calibration | None) -> str:
    if flag == "fp16":
        # fp16 mixed precision runs on every CUDA GPU, converting where the GPU has no fp16 arithmetic.
        return f"fp16=True on {target.device} runs, slowly: {why}; fp32 (neither flag) is faster here"
    # torch.cuda.is_bf16_supported() counts emulation: pre-Ampere GPUs run bf16 without bf16 tensor cores.
    fast_fp16 = check_precision_flag(target, "fp16").verdict == "ok"
    instead = "fp16=True is the fast one" if fast_fp16 else "fp32 (neither flag) is the fast one here"
    return f"bf16=True on {target.device} runs emulated and slowly ({why}); {instead}"


def _on_amd(target: Target, flag: str, why: str, calib: Calibration | None) -> str | None:
    if flag == "fp16":
        return None
    # ROCm runs bf16 (natively on CDNA, at half fp16's rate on the MI100); the reason says which.
    return f"bf16=True on {target.device} runs, slower than fp16: {why}; fp16=True is the fast one"


# Where a flag that is not fast here still runs (a warning with its cost); anywhere else it is refused.
_RUNS_SLOWLY: dict[str, Callable[[Target, str, str, Calibration | None], str | None]] = {
    "cpu": _on_cpu,
    "cuda": _on_nvidia,
    "rocm": _on_amd,
}


def _refusal(target: Target, flag: str, why: str) -> str:
    if flag == "bf16":
        instead = "fp16=True" if check_precision_flag(target, "fp16").verdict == "ok" else "neither bf16 nor fp16"
        return f"bf16=True does not work on {target.device}: {why}; pass {instead}"
    if not target.backend.fast_fp16:
        instead = "bf16=True" if supports(target, "bfloat16")[0] else "neither (fp32)"
        hardware = target.backend.hardware
        return f"fp16=True does not work on {target.name} ({hardware} has no fast fp16 training); pass {instead}"
    return f"fp16=True does not work on {target.device}: {why}"


def precision_conflicts(target: Target, user: dict[str, Any], calib: Calibration | None = None) -> list[str]:
    """Raise ConfigConflictError for a precision flag in ``user`` that cannot run here; return the
    warnings for those that run at a cost (``calib``: this CPU's figures, quoted where given)."""
    warnings = []
    for flag in ("bf16", "fp16"):
        if user.get(flag) or user.get(f"{flag}_full_eval"):
            check = check_precision_flag(target, flag, calib)
            if check.verdict == "refuse":
                raise ConfigConflictError(check.message)
            if check.verdict == "warn":
                warnings.append(check.message)
    return warnings


def fp16_weights_problem(model: Any, fp16: bool) -> str | None:
    """The warning for ``fp16=True`` over a model whose trainable weights are fp16 (None: none).

    torch's GradScaler unscales fp32 gradients only: the first optimizer step raises "Attempting to
    unscale FP16 gradients" (torch/amp/grad_scaler.py). ``model`` is read duck-typed (``parameters()``).
    """
    if not fp16 or not hasattr(model, "parameters"):
        return None
    half = [p for p in model.parameters() if getattr(p, "requires_grad", False) and str(p.dtype) == "torch.float16"]
    if not half:
        return None
    return (
        f"the model trains {len(half)} fp16 weight tensor(s) under fp16=True: the first optimizer step fails with "
        "'Attempting to unscale FP16 gradients'. Load it for training (resolve_device(model=..., task='training')"
        ".model_kwargs() gives fp32 weights), or train adapters over it (whichdevice.lora_training)"
    )
