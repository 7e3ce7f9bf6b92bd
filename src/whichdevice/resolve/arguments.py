"""resolve_device()'s arguments, checked before anything is probed: values that exist (task, quantize,
offload, counts, model=) and the right shapes (True/False switches, device_map, max_memory, the devices
they name).

Each check names the form to write instead. A string where True or False belongs is refused, not
read: Python reads every non-empty string as true, and which words mean "no" is a guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import ConfigConflictError, DeviceError, shown
from whichdevice.core.frozen import NamedTuple
from whichdevice.core.job import Job
from whichdevice.device.request import TASKS, _is_index, parse_device
from whichdevice.hardware.registry import backends

if TYPE_CHECKING:
    import os
    from typing import Literal

    import torch
    from transformers import PretrainedConfig

    from whichdevice.core.records import Backend, TraceStep
    from whichdevice.device.target import Target
    from whichdevice.memory.record import Placement

    # What resolve_device() takes, as the checks below accept it (and model/facts.py, model=): anything
    # else is refused with the form to write instead. At run time each is made when first read
    # (argument_alias): typing's work for the four was 0.15 ms of every fresh resolve.
    Quantize = Literal["auto", "4bit", "8bit"]
    DeviceLike = str | torch.device
    DtypeLike = str | torch.dtype
    ModelLike = str | os.PathLike[str] | PretrainedConfig

__all__ = [
    "DEVICE_MAP_WORDS",
    "Arguments",
    "argument_alias",
    "check_arguments",
    "check_checkpointing",
    "check_count",
    "check_device_map",
    "check_device_map_shape",
    "check_dtype_override",
    "check_flag",
    "check_lora_arguments",
    "check_map_devices",
    "check_max_memory",
    "check_memory_devices",
    "check_offload",
    "check_quantize",
    "check_shapes",
    "placement_as_asked",
]


def check_shapes(args: Arguments) -> None:
    """resolve_device()'s switches, use_kernels, device_map and max_memory, before anything is probed."""
    check_flag(args.torch_compile, "torch_compile")
    check_flag(args.serving, "serving")
    check_checkpointing(args.gradient_checkpointing)
    # None is not a documented value (transformers' own default is False): refused, not read as "off".
    if not ((isinstance(args.use_kernels, str) and args.use_kernels == "auto") or isinstance(args.use_kernels, bool)):
        raise ConfigConflictError(
            f"use_kernels={shown(args.use_kernels)}: use 'auto', True or False (False, the default, leaves Hub "
            "kernels off)"
        )
    if args.device_map is not None:
        check_device_map_shape(args.device_map)
    if args.max_memory is not None:
        check_max_memory(args.max_memory)


def check_flag(value: Any, name: str) -> None:
    """``value`` is True or False. A string is refused, not read: ``"false"`` is truthy in Python,
    and guessing which words mean no would differ from one library to the next."""
    if not isinstance(value, bool):
        hint = " (a string is not read as a switch: write the bare word)" if isinstance(value, str) else ""
        raise DeviceError(f"{name}={value!r}: pass True or False{hint}")


def check_checkpointing(value: Any) -> None:
    """``gradient_checkpointing`` is None (whichdevice decides: on where the job fits only with it), True or False."""
    if value is not None and not isinstance(value, bool):
        hint = " (a string is not read as a switch: write the bare word)" if isinstance(value, str) else ""
        raise DeviceError(
            f"gradient_checkpointing={value!r}: pass True, False, or None to let whichdevice decide (on where the "
            f"job fits only with it){hint}"
        )


# from_pretrained's device_map words; anything else names a device or maps modules to devices.
DEVICE_MAP_WORDS = ("auto", "balanced", "balanced_low_0", "sequential")


def check_device_map_shape(device_map: Any, what: str = "device_map") -> None:
    """A form from_pretrained takes: a word above, a device ("cuda:1", 0, torch.device), or a dict of
    module name -> device (or "cpu"/"disk")."""
    if isinstance(device_map, Mapping):
        for key, value in device_map.items():
            if not isinstance(key, str):
                raise DeviceError(f"{what} key {key!r}: a key is a module name such as 'model.layers.0' ('' for all)")
            if value != "disk":
                _check_map_device(value, f"{what}[{key!r}]")
        return
    if isinstance(device_map, str) and device_map in DEVICE_MAP_WORDS:
        return
    _check_map_device(device_map, what)


def _check_map_device(value: Any, what: str) -> None:
    words = ", ".join(repr(w) for w in DEVICE_MAP_WORDS)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise DeviceError(f"{what}={value!r}: device indices start at 0")
        return
    if isinstance(value, str) or type(value).__name__ == "device":
        try:
            parse_device(value, what)
            return
        except DeviceError as exc:
            raise DeviceError(f"{exc} ({what} also takes {words}, or a dict of module name -> device)") from None
    raise DeviceError(
        f"{what}={value!r}: use {words}, a device such as 'cuda:0' or 0, or a dict of module name -> device"
    )


_MEMORY_FORM = "a dict of device -> size, e.g. {0: '20GiB', 1: '20GiB', 'cpu': '64GiB'}"


def check_max_memory(max_memory: Any) -> None:
    """``max_memory`` in from_pretrained's form: device index (or 'cpu', 'disk', 'mps') -> size."""
    from whichdevice.core.sizes import parse_size

    if not isinstance(max_memory, Mapping):
        raise DeviceError(f"max_memory={max_memory!r}: give {_MEMORY_FORM}")
    if not max_memory:
        raise DeviceError(f"max_memory={{}} names no device; give {_MEMORY_FORM}, or leave it out")
    # Besides device indices: the backends whose memory is named ("cpu", "mps"), and accelerate's "disk".
    words = (*(b.name for b in backends() if b.memory_by_name), "disk")
    for key, value in max_memory.items():
        if isinstance(key, bool) or not ((isinstance(key, int) and key >= 0) or key in words):
            fix = ""
            if isinstance(key, str) and ":" in key and _is_index(key.rsplit(":", 1)[1]):
                fix = f"; write {int(key.rsplit(':', 1)[1])} for {key!r}"
            raise DeviceError(
                f"max_memory key {key!r}: keys are device indices (0, 1, ...) or {', '.join(map(repr, words))}{fix}"
            )
        parse_size(value, f"max_memory[{key!r}]")


def check_memory_devices(max_memory: Mapping[Any, Any], target: Target) -> None:
    """Every device ``max_memory`` names exists here (on this machine or the simulated one)."""
    indices = (
        [] if target.backend.memory_by_name else sorted(d.index for d in target.probe.devices if d.index is not None)
    )
    for key in max_memory:
        if isinstance(key, int) and key not in indices:
            have = (
                f"{target.name} devices {', '.join(map(str, indices))}"
                if indices
                else f"no device {key} (the memory of {target.name} is named {target.name!r})"
                if target.backend.memory_by_name
                else f"no {target.name} device"
            )
            raise DeviceError(f"max_memory names device {key}, but this machine has {have}; remove it")
        if isinstance(key, str) and key != "disk" and key not in ("cpu", target.name):
            raise DeviceError(f"max_memory names {key!r}, but the device is {target.name}; remove it")


def check_map_devices(device_map: Any, target: Target) -> None:
    """Every device ``device_map`` places weights on exists here ("disk" and "cpu" always do)."""
    values = list(device_map.values()) if isinstance(device_map, Mapping) else [device_map]
    indices = sorted(d.index for d in target.probe.devices if d.index is not None)
    for value in values:
        if value in (*DEVICE_MAP_WORDS, "disk"):
            continue
        index: int | None
        if isinstance(value, int) and not isinstance(value, bool):
            if target.backend.memory_by_name:
                raise DeviceError(
                    f"device_map places weights on accelerator {value}, but there is no accelerator here "
                    f"(the device is {target.name}); use {target.name!r}"
                )
            name, index = target.name, value
        else:
            name, index = parse_device(value, "device_map")
        if name == "cpu":
            continue
        if name != target.name:
            raise DeviceError(
                f"device_map places weights on {value!r}, but the device is {target.name}; use {target.name!r}"
            )
        if index is not None and not target.backend.memory_by_name and index not in indices:
            have = ", ".join(f"{target.name}:{i}" for i in indices) or f"no {target.name} device"
            raise DeviceError(f"device_map places weights on {target.name}:{index}, but this machine has {have}")


def check_lora_arguments(r: Any, lora_alpha: Any, lora_dropout: Any, target_modules: Any, checkpointing: Any) -> None:
    """lora_training()'s numbers and names, checked before PEFT builds anything."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise DeviceError(f"r={r!r}: the LoRA rank is a whole number of 1 or more (8, 16, 64, ...)")
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or not 0 < lora_alpha < float("inf"):
        raise DeviceError(f"lora_alpha={lora_alpha!r}: a positive number (often 2 * r)")
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0 <= lora_dropout < 1:
        raise DeviceError(f"lora_dropout={lora_dropout!r}: a probability from 0 up to (not including) 1")
    if target_modules is not None and not (
        isinstance(target_modules, str)
        or (
            isinstance(target_modules, (list, tuple, set))
            and target_modules
            and all(isinstance(t, str) for t in target_modules)
        )
    ):
        raise DeviceError(
            f"target_modules={target_modules!r}: module names (['q_proj', 'v_proj']), 'all-linear', or None for "
            "every linear layer but the output head"
        )
    check_checkpointing(checkpointing)


def check_dtype_override(value: Any, what: str) -> None:
    """A dtype from_pretrained takes: "auto", a torch dtype, or its name ("bfloat16", "torch.float16")."""
    if value == "auto" or type(value).__name__ == "dtype":
        return
    if isinstance(value, str):
        import torch  # the caller builds from_pretrained's arguments: torch is loaded or about to be

        if isinstance(getattr(torch, value.removeprefix("torch."), None), torch.dtype):
            return
    raise DeviceError(f"{what}={value!r}: pass 'auto', a torch dtype (torch.bfloat16) or its name ('bfloat16')")


class Arguments(NamedTuple):
    """resolve_device()'s arguments as given (a NamedTuple: built and hashed in well under a microsecond)."""

    device: Any = None
    task: str = "inference"
    model: Any = None
    prefer: Any = None
    exclude: Any = None
    dtype: Any = "auto"
    attn_implementation: str = "auto"
    device_map: Any = None
    max_memory: Mapping[int | str, Any] | None = None
    quantize: str | None = "auto"
    use_kernels: Any = False
    torch_compile: bool = False
    batch_size: int | None = None
    max_length: int | None = None
    max_new_tokens: int | None = None
    offload: str | None = None
    offload_folder: Any = None
    revision: Any = None
    serving: bool = False
    devices: Any = None
    gradient_checkpointing: Any = None

    def job(self) -> Job:
        """The job these arguments describe (checked first: check_arguments)."""
        folder = str(self.offload_folder) if self.offload_folder is not None else None
        return Job(
            self.task,
            self.batch_size,
            self.max_length,
            self.offload,
            folder,
            max_new_tokens=self.max_new_tokens,
            serving=self.serving,
        )


def check_arguments(args: Arguments) -> None:
    """Raise for a task, quantize, count or offload that cannot be used (check_shapes checks the
    shapes, and reading model= checks the model: whichdevice.model.facts)."""
    if not isinstance(args.task, str) or args.task not in TASKS:
        raise DeviceError(f"task={args.task!r}: use 'inference' or 'training'")
    check_quantize(args.quantize)
    for name in ("batch_size", "max_length", "max_new_tokens"):
        check_count(getattr(args, name), name)
    if args.max_length is not None and args.max_new_tokens is not None and args.max_new_tokens >= args.max_length:
        raise DeviceError(
            f"max_new_tokens={args.max_new_tokens} is not less than max_length={args.max_length}: max_length "
            "counts the prompt too, as generate(max_length=) does; pass max_length=prompt tokens + max_new_tokens"
        )
    check_offload(args.offload, args.offload_folder, args.task)
    check_revision(args.revision, args.model)
    if args.serving is True and args.task != "inference":
        raise ConfigConflictError(
            f"serving=True with task={args.task!r}: serving requests is inference; pass task='inference' "
            "(the default), or leave serving out"
        )


def check_revision(revision: Any, model: Any) -> None:
    """``revision`` is None or a branch, tag or commit of the Hub model id ``model``."""
    if revision is None:
        return
    if not isinstance(revision, str) or not revision.strip() or len(revision) > 256 or not revision.isprintable():
        raise DeviceError(f"revision={revision!r}: give a branch, tag or commit of the model as a string, e.g. 'main'")
    if not isinstance(model, str):
        raise DeviceError(f"revision={revision!r} is for a Hub model id (model='org/name'); pass model= too")


def check_count(value: Any, name: str) -> None:
    """``value`` is None or a positive whole number (a workload size: sequences, tokens)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DeviceError(f"{name}={value!r}: give a whole number of 1 or more, or leave it out (None)")


def check_offload(offload: Any, offload_folder: Any, task: str) -> None:
    """Raise for an offload request that cannot work, naming what to pass instead."""
    if offload is None:
        if offload_folder is not None:
            raise DeviceError(f"offload_folder={offload_folder!r} without offload='disk': pass both, or neither")
        return
    from whichdevice.memory.job import OFFLOADS

    if offload not in OFFLOADS:
        raise DeviceError(f"offload={offload!r}: use 'cpu' or 'disk' (with offload_folder=...), or leave it out")
    if offload == "disk" and not offload_folder:
        raise DeviceError("offload='disk' needs a folder for the weights: pass offload_folder='path/to/folder'")
    if offload == "cpu" and offload_folder is not None:
        raise DeviceError("offload_folder= is for offload='disk'; with offload='cpu' leave it out")
    if task == "training":
        raise ConfigConflictError(
            f"offload={offload!r} with task='training': accelerate's offloaded layers are for inference and "
            "do not train; train LoRA adapters in 4-bit (quantize='auto'), or shard with DeepSpeed ZeRO-Offload"
        )


QUANTIZE_CHOICES = ("auto", "4bit", "8bit", None)


def check_quantize(quantize: Any) -> None:
    """Raise DeviceError for a ``quantize`` value that is not one of QUANTIZE_CHOICES."""
    if isinstance(quantize, bool) or quantize not in QUANTIZE_CHOICES:
        hint = " (quantize=True is ambiguous: write '4bit' or '8bit')" if quantize is True else ""
        raise DeviceError(f"quantize={quantize!r}: use 'auto', '4bit', '8bit' or None{hint}")


def check_device_map(backend: Backend, device_map: Any) -> None:
    """``device_map`` has a shape from_pretrained takes, and a word Accelerate's placement covers here."""
    check_device_map_shape(device_map)
    if device_map in ("auto", "balanced", "balanced_low_0", "sequential") and not backend.device_map_auto:
        raise ConfigConflictError(
            f"device_map={device_map!r} does not work on {backend.name}: Accelerate's automatic "
            f"placement does not cover {backend.hardware}; use device_map={backend.name!r}"
        )


def placement_as_asked(
    device_map: Any, max_memory: Mapping[int | str, Any] | None, target: Target
) -> tuple[Placement, list[TraceStep]]:
    """The caller's device_map (and max_memory), checked against the target's devices, as the placement."""
    from whichdevice.core.records import TraceStep
    from whichdevice.core.sizes import parse_size
    from whichdevice.memory.record import Placement

    check_device_map(target.backend, device_map)
    check_map_devices(device_map, target)
    steps = [TraceStep("placement", f"device_map={device_map!r} as you asked")]
    if max_memory is None:
        return Placement(device_map, note="as you asked"), steps
    budget: dict[int | str, str] = {
        k: f"{parse_size(v, f'max_memory[{k!r}]') // 1024**2}MiB" for k, v in max_memory.items()
    }
    return Placement(device_map, budget, "as you asked"), steps


def argument_alias(name: str, into: dict[str, Any]) -> object:
    """The typing alias ``name`` (``DeviceLike``, ``DtypeLike``, ``ModelLike``, ``Quantize``), made now and
    kept in ``into`` (a module's globals), as a module ``__getattr__`` answers; AttributeError for any other."""
    from typing import Literal, Union

    # the names as forward references: torch and transformers are imported for mypy alone
    forward: dict[str, tuple[object, ...]] = {"DeviceLike": (str, "torch.device"), "DtypeLike": (str, "torch.dtype")}
    forward["ModelLike"] = (str, "os.PathLike[str]", "PretrainedConfig")
    if name == "Quantize":
        made: object = Literal["auto", "4bit", "8bit"]
    elif name in forward:
        made = Union[forward[name]]  # noqa: UP007  # "|" does not take strings
    else:
        raise AttributeError(f"module {into['__name__']!r} has no attribute {name!r}")
    into[name] = made
    return made


def __getattr__(name: str) -> object:
    return argument_alias(name, globals())
