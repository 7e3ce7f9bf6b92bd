"""TrainingArguments from a resolution: fill in what the user left out, refuse what cannot work."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from whichdevice.errors import ConfigConflictError, DeviceUnavailableError, PackageVersionError
from whichdevice.packages import MIN_TRANSFORMERS, transformers_problem
from whichdevice.precision import supports
from whichdevice.training_settings import training_kwargs_for

if TYPE_CHECKING:
    from transformers import TrainingArguments

    from whichdevice.resolver import Resolution

__all__ = ["MIN_TRANSFORMERS", "training_arguments", "training_kwargs_for", "transformers_problem"]


def _conflicts(res: Resolution, user: dict[str, Any]) -> None:
    backend = res.backend
    name = backend.name
    if user.get("bf16") or user.get("bf16_full_eval"):
        ok, why = supports(backend, res.probe, "bfloat16")
        if not ok:
            instead = (
                "fp16=True"
                if backend.fast_fp16 and supports(backend, res.probe, "float16")[0]
                else "neither bf16 nor fp16"
            )
            raise ConfigConflictError(f"bf16=True does not work on {res.device}: {why}; pass {instead}")
    if user.get("fp16") or user.get("fp16_full_eval"):
        if not backend.fast_fp16:
            instead = "bf16=True" if supports(backend, res.probe, "bfloat16")[0] else "neither (fp32)"
            raise ConfigConflictError(
                f"fp16=True does not work on {name} ({backend.hardware} has no fast fp16 training); pass {instead}"
            )
        ok, why = supports(backend, res.probe, "float16")
        if not ok:
            raise ConfigConflictError(f"fp16=True does not work on {res.device}: {why}")
    ddp = user.get("ddp_backend")
    if ddp is not None:
        allowed = tuple(b for b in (backend.distributed_backend, *backend.other_distributed_backends) if b)
        if ddp not in allowed:
            raise ConfigConflictError(
                f"ddp_backend={ddp!r} does not fit {name} ({backend.hardware}); "
                + (f"use {' or '.join(repr(a) for a in allowed)}" if allowed else f"{name} has no distributed backend")
            )
        if res.distributed is None:
            raise ConfigConflictError(
                f"ddp_backend={ddp!r} in a single process: TrainingArguments then fails with 'Default "
                "process group has not been initialized'. Leave ddp_backend out, or launch with torchrun "
                "or accelerate launch"
            )
    # use_cpu is TrainingArguments' switch for the CPU itself.
    if user.get("use_cpu") is False and name == "cpu":
        raise DeviceUnavailableError(
            f"use_cpu=False, but this machine has no usable accelerator ({res.probe.reason or 'only a CPU'}); "
            "leave use_cpu out or install the backend for your hardware (see `whichdevice`)"
        )
    if user.get("use_cpu") and name != "cpu":
        raise ConfigConflictError(
            f"use_cpu=True contradicts the resolved device {res.device}; pass device='cpu' to "
            "resolve_device (or training_arguments(device='cpu')) instead"
        )


def training_arguments(
    output_dir: str | None = None,
    *,
    resolution: Resolution | None = None,
    device: Any = None,
    **kwargs: Any,
) -> TrainingArguments:
    """A real ``transformers.TrainingArguments`` for this machine.

    Every keyword you pass is kept as you passed it; whichdevice fills in the device, precision,
    ``ddp_backend`` and compile settings you left out, and raises ``DeviceError`` before
    construction when one of yours conflicts with the hardware. Accelerate's global state is left
    as found: if you configured an ``Accelerator``/``PartialState`` first, it is reused
    (``accelerator_config={"use_configured_state": True}``) unless you pass ``accelerator_config``.
    """
    problem = transformers_problem()
    if problem is not None:
        raise PackageVersionError(problem)
    from whichdevice.resolver import resolve_device

    res = (
        resolution
        if resolution is not None
        else resolve_device(device, task="training", torch_compile=bool(kwargs.get("torch_compile")))
    )
    _conflicts(res, kwargs)
    filled = dict(res.training_kwargs(torch_compile=bool(kwargs.get("torch_compile"))))
    if "bf16" in kwargs or "fp16" in kwargs:
        # One precision choice is the user's: do not add the other flag beside it.
        filled.pop("bf16", None)
        filled.pop("fp16", None)
    final = {**filled, **kwargs}
    if output_dir is not None:
        final["output_dir"] = output_dir
    if "accelerator_config" not in kwargs and _accelerate_state_configured():
        final["accelerator_config"] = {"use_configured_state": True}

    from transformers import TrainingArguments

    args = TrainingArguments(**final)
    return args


def _accelerate_state_configured() -> bool:
    # TrainingArguments resets accelerate's shared state unless told to reuse it; read the shared
    # dict without importing accelerate when nobody has (then there is nothing to keep).
    import sys

    state = sys.modules.get("accelerate.state")
    if state is None:
        return False
    return bool(getattr(state.PartialState, "_shared_state", {}))
