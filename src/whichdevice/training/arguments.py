"""TrainingArguments from a resolution: fill in what the user left out, refuse what cannot work."""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

from whichdevice.core.envview import IMPORT_SIDE_EFFECTS, import_side_effects_undone
from whichdevice.core.errors import (
    ArgumentsClassError,
    ConfigConflictError,
    DeviceError,
    PackageVersionError,
)
from whichdevice.core.import_noise import quiet_import_noise
from whichdevice.core.packages import MIN_TRANSFORMERS, stack_problems, transformers_problem
from whichdevice.device.selection import narrowed_training
from whichdevice.hardware.probing import raise_if_gave_up
from whichdevice.launch.accelerate_settings import (
    ENV_MIXED_PRECISION,
    ENV_USE_CPU,
    AccelerateSettings,
    read_accelerate_settings,
)
from whichdevice.launch.checks import check_training_launch, checked_when_resolved
from whichdevice.launch.leftovers import launch_leftovers, refuse_accelerate_device, refuse_leftovers
from whichdevice.launch.trainer_kwargs import training_kwargs_for
from whichdevice.launch.user_keywords import (
    REMOVED_SWITCHES,
    check_compile_backend,
    check_compile_mode,
    check_ddp_package,
    cpu_switch_off,
)
from whichdevice.precision.training import fp16_weights_problem, precision_conflicts
from whichdevice.resolve.arguments import check_flag
from whichdevice.training.simulated import refuse_simulated_accelerator

if TYPE_CHECKING:
    from transformers import TrainingArguments

    from whichdevice.resolve.resolver import Resolution

__all__ = [
    "IMPORT_SIDE_EFFECTS",
    "MIN_TRANSFORMERS",
    "ArgumentsClassError",
    "check_resolution",
    "training_arguments",
    "training_arguments_type",
    "training_kwargs_for",
    "transformers_problem",
]


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller_stacklevel() -> int:
    """The stacklevel that points a warning issued by our caller at the first frame outside whichdevice.

    A fixed number points at ``sys:1`` or at whichdevice itself, depending on which public function
    led here (training_arguments, or its accelerate-variable path one frame deeper).
    """
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def _conflicts(res: Resolution, user: dict[str, Any]) -> None:
    backend = res.backend
    name = backend.name
    # A flag that cannot run here is refused; one that runs at a cost (bf16 emulated on this CPU) is
    # the user's to take, with the measured cost said.
    for message in precision_conflicts(res.target, user, _cpu_calibration(res, user)):
        warnings.warn(message, stacklevel=_caller_stacklevel())
    ddp = user.get("ddp_backend")
    if ddp is not None:
        allowed = tuple(b for b in (backend.distributed_backend, *backend.other_distributed_backends) if b)
        if ddp not in allowed:
            raise ConfigConflictError(
                f"ddp_backend={ddp!r} does not fit {name} ({backend.hardware}); "
                + (f"use {' or '.join(repr(a) for a in allowed)}" if allowed else f"{name} has no distributed backend")
            )
        ccl = check_ddp_package(ddp)
        if ccl is not None:
            warnings.warn(ccl, stacklevel=4)
        if res.distributed is None:
            raise ConfigConflictError(
                f"ddp_backend={ddp!r} in a single process: TrainingArguments then fails with 'Default "
                "process group has not been initialized'. Leave ddp_backend out, or launch with torchrun "
                "or accelerate launch"
            )
    check_compile_backend(backend, user.get("torch_compile_backend"))
    check_compile_mode(backend, res.probe.features, user.get("torch_compile"))
    # use_cpu is TrainingArguments' switch for the CPU itself; use_cpu=False on the CPU: cpu_switch_off.
    # ACCELERATE_USE_CPU is not a choice of device that use_cpu=False contradicts: TrainingArguments
    # trains on the CPU when either says so (training_args.py, _setup_devices).
    if user.get("use_cpu") is False and name == "cpu" and res.source not in ("detection", ENV_USE_CPU):
        raise ConfigConflictError(
            f"use_cpu=False contradicts the device {res.device} ({res.source}); leave one of them out"
        )
    if user.get("use_cpu") and name != "cpu":
        raise ConfigConflictError(
            f"use_cpu=True contradicts the device {res.device} ({res.source}); leave device out "
            "(use_cpu=True then resolves to the CPU) or pass device='cpu'"
        )


def _cpu_calibration(res: Resolution, user: dict[str, Any]) -> Any:
    """This CPU's cached calibration, for a warning about the user's bf16/fp16 flag to quote (None: not
    calibrated, or not the CPU); never measured for a warning."""
    if res.backend.name != "cpu" or not any(user.get(f) for f in ("bf16", "fp16", "bf16_full_eval", "fp16_full_eval")):
        return None
    from whichdevice.measure.calibration import calibration

    return calibration(measure=False)[0]


def training_arguments(
    output_dir: str | None = None,
    *,
    arguments_class: type[TrainingArguments] | None = None,
    resolution: Resolution | None = None,
    device: Any = None,
    model: Any = None,
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
    refused when it cannot. ``model``: the model you will train (a path, a config, or the loaded model,
    whose config is read): the resolution is then the one ``resolve_device(model=..., task="training")``
    makes, with its strategy's keywords (``fsdp=``/``deepspeed=`` under a launch), and fp16 weights under
    ``fp16=True`` are warned about (the first step would fail). Accelerate's global state is left as
    found: if you configured an ``Accelerator``/``PartialState`` first, it is reused
    (``accelerator_config={"use_configured_state": True}``) unless you pass ``accelerator_config``.
    """
    # A vendor import that hung or crashed in a probe would hang (or crash) transformers too.
    raise_if_gave_up("training_arguments()")
    problems = stack_problems()
    if problems:
        raise PackageVersionError("; ".join(problems))
    _check_shapes(output_dir, resolution)
    cls = _arguments_class(arguments_class, kwargs)
    _check_switches(cls, kwargs)
    from whichdevice.resolve.resolver import resolve_device

    if device is None and resolution is None and kwargs.get("use_cpu"):
        device = "cpu"  # TrainingArguments' own switch for the CPU: resolve for it, not against it
    compile_ = bool(kwargs.get("torch_compile"))
    asked = _asked_checkpointing(kwargs)
    res = resolution or resolve_device(
        device, task="training", model=_planned(model), torch_compile=compile_, gradient_checkpointing=asked
    )
    if model is not None:
        _say_the_plan(res)
    # accelerate's settings as the resolution read them: read again only for one built by hand.
    settings = res.accelerate if res.accelerate is not None else read_accelerate_settings()
    problems = settings.problems()
    if problems:  # TrainingArguments or the Trainer's Accelerator would raise later, with less to go on
        raise ConfigConflictError("; ".join(problems))
    _check_launch(res)
    refuse_accelerate_device(res.backend.name)  # also for a resolution made for inference
    _conflicts(res, kwargs)
    filled = _filled(res, kwargs, settings)
    final = {**filled, **kwargs}
    if output_dir is not None:
        final["output_dir"] = output_dir
    if "accelerator_config" not in kwargs and _accelerate_state_configured():
        final["accelerator_config"] = {"use_configured_state": True}
    return _build(cls, res, final, model)


_CHECKPOINTING = (
    ("gradient_checkpointing", "activation_checkpointing"),
    ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
)


def _asked_checkpointing(kwargs: dict[str, Any]) -> bool | None:
    """Gradient checkpointing as the caller set it for Trainer (under either of transformers' names):
    the plan prices what Trainer will do."""
    for name in _CHECKPOINTING[0]:
        value = kwargs.get(name)
        if isinstance(value, bool):
            return value
    return None


def _say_the_plan(res: Resolution) -> None:
    """Warn where the job priced for ``model=`` does not fit as a full fine-tune: the numbers, and the call
    that fits (TrainingArguments alone cannot make a LoRA or a 4-bit model)."""
    setup = res.training_setup
    if setup is None or setup.train == "full":
        return
    load = "from_pretrained(..., **res.model_kwargs())" + (
        " (its quantization_config loads the 4-bit base)" if setup.train == "qlora" else ""
    )
    warnings.warn(
        f"training_arguments(model=...): {setup.passed_over or 'full fine-tuning does not fit'}; what fits is "
        f"{setup.describe()}: res = whichdevice.resolve_device(model=..., task='training'), load the model with "
        f"{load}, then whichdevice.lora_training(model, res).training_arguments(output_dir) gives these "
        "keywords with the adapters' own",
        stacklevel=_caller_stacklevel(),
    )


def _planned(model: Any) -> Any:
    """What of ``model`` resolve_device(model=) reads: a path or config as given, a loaded model's config
    (a PreTrainedModel, a peft model: ``.config``); None for anything else (then the plan is made without it).

    One plan, one path: with model= the resolution is the one resolve_device(model=..., task="training")
    makes, so its strategy keywords (fsdp=, deepspeed=) are the same whichever way the user came in."""
    from whichdevice.model.files import is_config_object

    if model is None or isinstance(model, (str, os.PathLike)) or is_config_object(model):
        return model
    config = getattr(model, "config", None)
    return config if is_config_object(config) else None


def _filled(res: Resolution, kwargs: dict[str, Any], settings: AccelerateSettings) -> dict[str, Any]:
    """The keywords whichdevice adds to the user's, the precision flags agreed with theirs."""
    # torch_compile: yours when you pass it, else the resolution's (resolve_device(torch_compile=True)).
    compile_ = kwargs.get("torch_compile")
    filled = dict(res.training_kwargs(torch_compile=None if compile_ is None else bool(compile_)))
    for pair in _CHECKPOINTING:
        if any(name in kwargs for name in pair):  # the caller's under either name: none of ours beside it
            for name in pair:
                filled.pop(name, None)
    if "bf16" in kwargs or "fp16" in kwargs:
        # One precision choice is the user's: the other flag is stated off, not left to the class's
        # default (SFTConfig defaults to bf16=True, which beside fp16=True makes two precisions).
        filled.pop("bf16", None)
        filled.pop("fp16", None)
        filled.update({flag: False for flag in ("bf16", "fp16") if flag not in kwargs})
    else:
        filled.update(_precision_flags(res, filled, settings))
    if kwargs.get("use_cpu") is False and res.backend.name == "cpu":
        why = (
            f"{ENV_USE_CPU}={settings.use_cpu!r} makes TrainingArguments train on the CPU whatever use_cpu says"
            if settings.cpu_forced
            else "this machine has no usable accelerator"
        )
        filled, note = cpu_switch_off(res.backend, kwargs, filled, why)
        warnings.warn(note, stacklevel=3)
    return filled


def _build(cls: type[TrainingArguments], res: Resolution, final: dict[str, Any], model: Any) -> TrainingArguments:
    """The class built from ``final``, after the checks that need every keyword."""
    unscale = fp16_weights_problem(model, bool(final.get("fp16")))
    if unscale is not None:
        warnings.warn(unscale, stacklevel=3)
    refuse_simulated_accelerator(res, final)  # every check has run: the error carries the keywords
    with quiet_import_noise():  # a deepspeed= config imports deepspeed
        return cls(**final)


def _check_launch(res: Resolution) -> None:
    """The launch checks resolve_device(task="training") did not run for ``res``: all of them for a
    resolution made for inference, and torch's own variables (which resolving leaves to this moment)."""
    if res.task != "training":
        refuse_leftovers(launch_leftovers(cpu=res.backend.name == "cpu"))
    if res.task != "training" or not checked_when_resolved(res.distributed):
        check_training_launch(res.distributed)
    # A device list (devices=, or the GPUs this process can use) binds Trainer only through the
    # visible-devices variable, which a running process cannot change: say how to start it instead.
    narrowed = narrowed_training(res.backend, res.devices, res.probe) if res.distributed is None else None
    if narrowed is not None:
        raise ConfigConflictError(narrowed)


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


def training_arguments_type() -> type[TrainingArguments]:
    """``transformers.TrainingArguments``, imported without leaving :data:`IMPORT_SIDE_EFFECTS` set."""
    with import_side_effects_undone(), quiet_import_noise():  # it imports peft, so bitsandbytes
        from transformers import TrainingArguments
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
        removed = [
            f"{name} was removed in transformers 5: use {REMOVED_SWITCHES[name]}"
            for name in unknown
            if name in REMOVED_SWITCHES
        ]
        other = (
            f"; {'; '.join(removed)}"
            if removed
            else ""
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
