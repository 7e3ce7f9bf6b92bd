"""Mixed precision for training: the one a resolution trains with, and whether a flag the user set runs here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from whichdevice.core.errors import ConfigConflictError
from whichdevice.precision.hardware import supports

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, ProbeResult
    from whichdevice.hardware.calibration_figures import Calibration

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


def training_precision(backend: Backend, probe: ProbeResult, dtype_name: str | None) -> tuple[str | None, str]:
    """("bf16" | "fp16" | None, why) for mixed-precision training here."""
    name = backend.name
    if dtype_name == "float32":
        return None, "fp32 training: the resolved dtype is fp32"
    if name == "mps":
        # Apple's quirk: whichdevice does not hand over autocast training on MPS.
        return None, "no mixed precision on MPS (fp32 training); pass fp16=True to try autocast"
    bf16_ok, bf16_why = supports(backend, probe, "bfloat16")
    if dtype_name in (None, "bfloat16") and bf16_ok:
        return "bf16", bf16_why
    if not backend.fast_fp16:
        return None, f"fp32 training: {bf16_why}"
    fp16_ok, fp16_why = supports(backend, probe, "float16")
    if fp16_ok:
        return "fp16", f"{bf16_why}; fp16 with loss scaling instead" if not bf16_ok else fp16_why
    return None, f"fp32 training: {fp16_why}"


class FlagCheck(NamedTuple):
    """Whether a user's ``bf16=True`` / ``fp16=True`` runs here: "ok", "warn" (runs, with a cost) or "refuse"."""

    verdict: Literal["ok", "warn", "refuse"]
    message: str


def check_precision_flag(
    backend: Backend, probe: ProbeResult, device: str, flag: str, calib: Calibration | None = None
) -> FlagCheck:
    """``flag`` is "bf16" or "fp16": refuse only what cannot run; warn, with the cost, what runs slowly.

    ``calib``: this CPU's calibration, whose figures a CPU warning quotes (None: not measured here).
    A warning recommends the other flag only where that flag's own check is "ok" (no answer both
    recommends and warns against one flag)."""
    name = backend.name
    if flag == "bf16":
        ok, why = supports(backend, probe, "bfloat16")
        if ok:
            return FlagCheck("ok", why)
        if name == "cpu":
            return FlagCheck("warn", f"bf16=True on {device} runs, slowly: {why}; {_cpu_cost('bfloat16', calib)}")
        fast_fp16 = check_precision_flag(backend, probe, device, "fp16").verdict == "ok"
        if name == "cuda":
            if probe.variant == "rocm":
                # ROCm runs bf16 (natively on CDNA, at half fp16's rate on the MI100); the reason says which.
                said = f"bf16=True on {device} runs, slower than fp16: {why}; fp16=True is the fast one"
                return FlagCheck("warn", said)
            # torch.cuda.is_bf16_supported() counts emulation: pre-Ampere GPUs run bf16 without bf16 tensor cores.
            instead = "fp16=True is the fast one" if fast_fp16 else "fp32 (neither flag) is the fast one here"
            return FlagCheck("warn", f"bf16=True on {device} runs emulated and slowly ({why}); {instead}")
        instead = "fp16=True" if fast_fp16 else "neither bf16 nor fp16"
        return FlagCheck("refuse", f"bf16=True does not work on {device}: {why}; pass {instead}")
    ok, why = supports(backend, probe, "float16")
    if ok and backend.fast_fp16:
        return FlagCheck("ok", why)
    if name == "cpu":
        return FlagCheck(
            "warn",
            f"fp16=True on {device} runs, slowly: {why}; {_cpu_cost('float16', calib)}; accelerate makes no loss "
            "scaler on the CPU, so small gradients underflow to zero",
        )
    if name == "cuda" and probe.variant != "rocm":
        # fp16 mixed precision runs on every CUDA GPU, converting where the GPU has no fp16 arithmetic.
        return FlagCheck("warn", f"fp16=True on {device} runs, slowly: {why}; fp32 (neither flag) is faster here")
    if not backend.fast_fp16:
        instead = "bf16=True" if supports(backend, probe, "bfloat16")[0] else "neither (fp32)"
        return FlagCheck(
            "refuse",
            f"fp16=True does not work on {name} ({backend.hardware} has no fast fp16 training); pass {instead}",
        )
    return FlagCheck("refuse", f"fp16=True does not work on {device}: {why}")


def precision_conflicts(
    backend: Backend, probe: ProbeResult, device: str, user: dict[str, Any], calib: Calibration | None = None
) -> list[str]:
    """Raise ConfigConflictError for a precision flag in ``user`` that cannot run here; return the
    warnings for those that run at a cost (``calib``: this CPU's figures, quoted where given)."""
    warnings = []
    for flag in ("bf16", "fp16"):
        if user.get(flag) or user.get(f"{flag}_full_eval"):
            check = check_precision_flag(backend, probe, device, flag, calib)
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
