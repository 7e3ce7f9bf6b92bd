"""TrainingArguments from a resolution: fill in what the user left out, refuse what cannot work."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import ConfigConflictError, DeviceError, DeviceUnavailableError, PackageVersionError
from whichdevice.core.packages import MIN_TRANSFORMERS, transformers_problem
from whichdevice.hardware.probing import raise_if_gave_up
from whichdevice.launch.accelerate_settings import ENV_MIXED_PRECISION, AccelerateSettings, read_accelerate_settings
from whichdevice.launch.distributed import check_training_launch
from whichdevice.launch.leftovers import launch_leftovers, refuse_leftovers
from whichdevice.launch.trainer_kwargs import training_kwargs_for
from whichdevice.precision.training import precision_conflicts
from whichdevice.resolve.arguments import check_flag

if TYPE_CHECKING:
    from transformers import TrainingArguments

    from whichdevice.resolve.resolver import Resolution

__all__ = [
    "MIN_TRANSFORMERS",
    "ArgumentsClassError",
    "check_resolution",
    "training_arguments",
    "training_arguments_type",
    "training_kwargs_for",
    "transformers_problem",
]


class ArgumentsClassError(ConfigConflictError, TypeError):
    """An ``arguments_class`` that is not a TrainingArguments subclass, or a keyword it does not take.

    Also a ``TypeError``, as Python raises for a wrong type or an unexpected keyword.
    """


def _conflicts(res: Resolution, user: dict[str, Any]) -> None:
    backend = res.backend
    name = backend.name
    # A flag that cannot run here is refused; one that runs at a cost (bf16 emulated on this CPU) is
    # the user's to take, with the measured cost said.
    for message in precision_conflicts(backend, res.probe, res.device, user):
        warnings.warn(message, stacklevel=4)
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
            f"use_cpu=True contradicts the device {res.device} ({res.source}); leave device out "
            "(use_cpu=True then resolves to the CPU) or pass device='cpu'"
        )


def training_arguments(
    output_dir: str | None = None,
    *,
    arguments_class: type[TrainingArguments] | None = None,
    resolution: Resolution | None = None,
    device: Any = None,
    **kwargs: Any,
) -> TrainingArguments:
    """A real ``TrainingArguments`` (or ``arguments_class``, any subclass of it) for this machine.

    ``arguments_class`` takes TRL's ``SFTConfig``/``DPOConfig``/``GRPOConfig``, sentence-transformers'
    ``SentenceTransformerTrainingArguments``, optimum-habana's ``GaudiTrainingArguments``, ...; the
    class's own keywords (``max_length=``, ...) pass through. Every keyword you pass is kept as you
    passed it; whichdevice fills in the device, precision (both ``bf16`` and ``fp16``, so a class
    whose default is ``bf16=True`` does not override the choice), ``ddp_backend`` and compile
    settings you left out, and raises ``DeviceError`` before construction when one of yours
    conflicts with the hardware. ``use_cpu=True`` trains on the CPU. ``ACCELERATE_MIXED_PRECISION``
    (which ``accelerate launch`` exports from its config) is followed when it can run here, and
    refused when it cannot. Accelerate's global state is left as found: if you configured an
    ``Accelerator``/``PartialState`` first, it is reused
    (``accelerator_config={"use_configured_state": True}``) unless you pass ``accelerator_config``.
    """
    # A vendor import that hung or crashed in a probe would hang (or crash) transformers too.
    raise_if_gave_up("training_arguments()")
    problem = transformers_problem()
    if problem is not None:
        raise PackageVersionError(problem)
    _check_shapes(output_dir, resolution)
    cls = _arguments_class(arguments_class, kwargs)
    _check_switches(cls, kwargs)
    from whichdevice.resolve.resolver import resolve_device

    settings = read_accelerate_settings()
    problems = settings.problems()
    if problems:  # TrainingArguments or the Trainer's Accelerator would raise later, with less to go on
        raise ConfigConflictError("; ".join(problems))
    if device is None and resolution is None and kwargs.get("use_cpu"):
        device = "cpu"  # TrainingArguments' own switch for the CPU: resolve for it, not against it
    res = (
        resolution
        if resolution is not None
        else resolve_device(device, task="training", torch_compile=bool(kwargs.get("torch_compile")))
    )
    refuse_leftovers(launch_leftovers(cpu=res.backend.name == "cpu"))  # also for a resolution made for inference
    check_training_launch(res.distributed)
    _conflicts(res, kwargs)
    filled = dict(res.training_kwargs(torch_compile=bool(kwargs.get("torch_compile"))))
    if "bf16" in kwargs or "fp16" in kwargs:
        # One precision choice is the user's: the other flag is stated off, not left to the class's
        # default (SFTConfig defaults to bf16=True, which beside fp16=True makes two precisions).
        filled.pop("bf16", None)
        filled.pop("fp16", None)
        filled.update({flag: False for flag in ("bf16", "fp16") if flag not in kwargs})
    else:
        filled.update(_precision_flags(res, filled, settings))
    final = {**filled, **kwargs}
    if output_dir is not None:
        final["output_dir"] = output_dir
    if "accelerator_config" not in kwargs and _accelerate_state_configured():
        final["accelerator_config"] = {"use_configured_state": True}
    return cls(**final)


def check_resolution(resolution: Any) -> None:
    """``resolution`` is None or what resolve_device() returned."""
    from whichdevice.resolve.resolution import Resolution

    if resolution is not None and not isinstance(resolution, Resolution):
        raise DeviceError(
            f"resolution={resolution!r}: pass what resolve_device(task='training') returns (a "
            f"whichdevice.Resolution), not {type(resolution).__name__}; to name a device, pass device={resolution!r}"
            if isinstance(resolution, str)
            else f"resolution={resolution!r}: pass what resolve_device(task='training') returns, or leave it out"
        )


def _check_shapes(output_dir: Any, resolution: Any) -> None:
    check_resolution(resolution)
    if output_dir is not None and not isinstance(output_dir, (str, os.PathLike)):
        raise DeviceError(f"output_dir={output_dir!r}: give a folder path (a string or pathlib.Path)")


def _check_switches(cls: type[TrainingArguments], kwargs: dict[str, Any]) -> None:
    """The class's True/False fields get True or False (None where the field allows it): a string such
    as "false" would switch them on, so it is refused rather than read."""
    import dataclasses

    for field in dataclasses.fields(cls):
        if field.name in kwargs and field.type in (bool, "bool", bool | None, "bool | None", "Optional[bool]"):
            value = kwargs[field.name]
            if value is None and field.type not in (bool, "bool"):
                continue
            check_flag(value, field.name)


# Variables an import of transformers' TrainingArguments sets as a side effect: it imports peft,
# which imports bitsandbytes, whose torch.compile decorators make torch._inductor write its cache
# folder into os.environ (torch/_inductor/runtime/cache_dir_utils.py, cache_dir()). The value is a
# default torch derives again whenever it needs one, so whichdevice leaves the variable as it was.
IMPORT_SIDE_EFFECTS = ("TORCHINDUCTOR_CACHE_DIR",)


def training_arguments_type() -> type[TrainingArguments]:
    """``transformers.TrainingArguments``, imported without leaving :data:`IMPORT_SIDE_EFFECTS` set."""
    unset = [name for name in IMPORT_SIDE_EFFECTS if name not in os.environ]
    from transformers import TrainingArguments

    for name in unset:
        os.environ.pop(name, None)
    return TrainingArguments


def _arguments_class(arguments_class: Any, kwargs: dict[str, Any]) -> type[TrainingArguments]:
    """The class to build, checked to be a TrainingArguments that takes every keyword given."""
    base = training_arguments_type()
    if arguments_class is None:
        cls: type[TrainingArguments] = base
    elif isinstance(arguments_class, type) and issubclass(arguments_class, base):
        cls = arguments_class
    else:
        what = (
            f"an instance of {type(arguments_class).__name__}; pass the class itself"
            if isinstance(arguments_class, base)
            else "not a subclass of transformers.TrainingArguments"
        )
        raise ArgumentsClassError(
            f"arguments_class={arguments_class!r} is {what}: training_arguments() builds "
            "transformers.TrainingArguments or a subclass of it, such as trl.SFTConfig, trl.DPOConfig, "
            "trl.GRPOConfig, sentence_transformers.SentenceTransformerTrainingArguments or "
            "optimum.habana.GaudiTrainingArguments"
        )
    import dataclasses

    takes = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(kwargs) - takes)
    if unknown:
        import difflib

        near = [m for name in unknown for m in difflib.get_close_matches(name, sorted(takes), n=1)]
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        other = (
            ""
            if arguments_class is not None
            else "; pass arguments_class= for a class that takes it (trl.SFTConfig takes max_length, ...)"
        )
        raise ArgumentsClassError(f"{cls.__name__} takes no {', '.join(unknown)}{hint}{other}")
    return cls


def _precision_flags(res: Resolution, filled: dict[str, Any], settings: AccelerateSettings) -> dict[str, bool]:
    """bf16 and fp16 both stated: accelerate's variable when it can run here, else whichdevice's choice."""
    asked = settings.precision
    if asked in ("bf16", "fp16"):
        try:
            _conflicts(res, {asked: True})
        except ConfigConflictError as exc:
            raise ConfigConflictError(
                f"{ENV_MIXED_PRECISION}={settings.mixed_precision!r} asks for {asked}, and {exc}. Unset "
                f"{ENV_MIXED_PRECISION} (`accelerate launch` exports it from --mixed_precision or from "
                f"mixed_precision in {settings.config_path}), or pass bf16=/fp16= to training_arguments()"
            ) from None
        return {"bf16": asked == "bf16", "fp16": asked == "fp16"}
    if asked is not None:
        # fp8 and any later precision: stating neither flag lets TrainingArguments take the variable.
        return {"bf16": False, "fp16": False}
    return {"bf16": bool(filled.get("bf16")), "fp16": bool(filled.get("fp16"))}


def _accelerate_state_configured() -> bool:
    # TrainingArguments resets accelerate's shared state unless told to reuse it; read the shared
    # dict without importing accelerate when nobody has (then there is nothing to keep).
    import sys

    state = sys.modules.get("accelerate.state")
    if state is None:
        return False
    return bool(getattr(state.PartialState, "_shared_state", {}))
