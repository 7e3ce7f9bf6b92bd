"""The TrainingArguments keywords a resolution implies: device, mixed precision, ddp_backend, compile."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from whichdevice.distributed import process_group_backend
from whichdevice.precision import supports

if TYPE_CHECKING:
    from whichdevice.distributed import DistributedContext
    from whichdevice.records import Backend, ProbeResult

__all__ = ["training_kwargs_for", "training_precision"]


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


def training_kwargs_for(
    backend: Backend,
    probe: ProbeResult,
    dtype_name: str | None,
    distributed: DistributedContext | None,
    *,
    torch_compile: bool = False,
) -> dict[str, Any]:
    """TrainingArguments keywords for training on ``backend`` in ``dtype_name`` (see ``Resolution.training_kwargs``)."""
    kwargs: dict[str, Any] = {}
    if backend.name == "cpu":
        # use_cpu is TrainingArguments' switch for the CPU itself (no other row has one); it is
        # also what lets bf16=True pass TrainingArguments' own check on CPU.
        kwargs["use_cpu"] = True
    precision, _ = training_precision(backend, probe, dtype_name)
    if precision:
        kwargs[precision] = True
    ddp_backend = process_group_backend(backend, distributed)
    if ddp_backend:
        # Only when really distributed: any ddp_backend in a single process makes
        # TrainingArguments fail with "Default process group has not been initialized".
        kwargs["ddp_backend"] = ddp_backend
    if torch_compile:
        kwargs["torch_compile"] = True
        if backend.compile_backend and backend.compile_backend != "inductor":
            kwargs["torch_compile_backend"] = backend.compile_backend
    return kwargs
