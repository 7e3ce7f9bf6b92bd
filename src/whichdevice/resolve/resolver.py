"""The resolver: device, device_map, dtype, attention and distributed settings, with the reasons.

``resolve_device()`` reads probe results (never hardware directly), so it runs the same on real and
simulated machines. ``_resolve`` is the pipeline, one step per line; each step returns its value and
its trace lines, and its rules live in the folders below this one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal, Union, cast

from whichdevice.attention.decode_forward import ensure_registered
from whichdevice.core.envview import import_side_effects_undone, pinned
from whichdevice.core.records import Trace, TraceStep
from whichdevice.device.request import ENV_DEVICE, TASKS, Task, parse_device
from whichdevice.hardware import probing
from whichdevice.hardware.store import current_store
from whichdevice.resolve.arguments import Arguments, check_flag
from whichdevice.resolve.memo import environment_mapping, memo_key, read_environment
from whichdevice.resolve.resolution import Resolution
from whichdevice.resolve.stages import (
    backend_stage,
    fit_stages,
    kernels_stage,
    launch_stage,
    on_idle_devices,
    request_stage,
    tuning_stage,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

__all__ = ["ENV_DEVICE", "TASKS", "Resolution", "TraceStep", "parse_device", "resolve_device"]

# What resolve_device() takes, as its checks accept it (resolve/arguments.py, model/facts.py): anything
# else is refused there with the form to write instead.
Quantize = Literal["auto", "4bit", "8bit"]
DeviceLike = Union[str, "torch.device"]
DtypeLike = Union[str, "torch.dtype"]
ModelLike = Union[str, "os.PathLike[str]", "PretrainedConfig"]


def resolve_device(
    device: DeviceLike | None = None,
    *,
    task: Task = "inference",
    model: ModelLike | None = None,
    prefer: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    dtype: DtypeLike | None = "auto",
    attn_implementation: str = "auto",
    device_map: str | Mapping[str, int | str] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    quantize: Quantize | None = "auto",
    use_kernels: bool | Literal["auto"] = False,
    torch_compile: bool = False,
    batch_size: int | None = None,
    max_length: int | None = None,
    max_new_tokens: int | None = None,
    offload: Literal["cpu", "disk"] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    serving: bool = False,
    devices: int | str | Sequence[int] | None = None,
    gradient_checkpointing: bool | None = None,
    refresh: bool = False,
) -> Resolution:
    """Resolve the device and settings for ``task`` ("inference" or "training") on this machine.

    ``device`` beats ``WHICHDEVICE_DEVICE``, which beats detection. ``model`` (a local path, a Hub id:
    its config and safetensors headers fetched, never its weights, at ``revision``; or a config) sizes
    the job and checks attention against its classes. ``batch_size``, ``max_length`` (prompt included)
    and ``max_new_tokens`` describe the job where known; ``offload`` lets a model that fits no device
    spill to the CPU (then disk); ``devices`` (a count, indices, -1 or "0,2") limits it to those devices;
    ``serving=True`` is many requests through continuous batching;
    ``use_kernels="auto"`` turns Hub kernels on where they can work; ``gradient_checkpointing`` (training:
    None decides, on where the job fits only with it). Every argument: docs/api.md.
    A repeated call with the same arguments and environment returns the same Resolution.
    """
    if refresh is not False:
        check_flag(refresh, "refresh")
        probing.clear_cache()
    args = Arguments(
        device=device,
        task=task,
        model=model,
        prefer=prefer,
        exclude=exclude,
        dtype=dtype,
        attn_implementation=attn_implementation,
        device_map=device_map,
        max_memory=max_memory,
        quantize=quantize,
        use_kernels=use_kernels,
        torch_compile=torch_compile,
        batch_size=batch_size,
        max_length=max_length,
        max_new_tokens=max_new_tokens,
        offload=offload,
        offload_folder=offload_folder,
        revision=revision,
        serving=serving,
        devices=devices,
        gradient_checkpointing=gradient_checkpointing,
    )
    environment = read_environment()
    key = memo_key(args, environment)
    store = current_store()
    if key is not None:
        cached = store.resolutions.get(key)
        if cached is not None:
            return _attention_registered(cast(Resolution, cached))
    # Resolved under the reading the key was made from: another thread's change lands in the next key.
    # Reading model= may import the architecture's module, which sets TORCHINDUCTOR_CACHE_DIR: undone.
    with pinned(environment_mapping(environment)), import_side_effects_undone():
        res = _resolve(args)
    if key is not None:
        store.resolutions[key] = res
    return _attention_registered(res)


def _attention_registered(res: Resolution) -> Resolution:
    # The keywords name sdpa and prepare() installs the decode attention, registering it. Registered here
    # as well, so that a script that passes the name "whichdevice_sdpa" to from_pretrained by hand (what
    # res.attn_implementation said before schema 1.9) still loads in this process. It costs nothing extra:
    # it is only chosen for a model= whose classes were read (transformers imported already), or when asked.
    if res.tuning is not None and res.tuning.decode_attention:
        ensure_registered()
    return res


def _resolve(args: Arguments) -> Resolution:
    trace = Trace()
    # 1. The request: the arguments checked, model= read once, the job, the device asked for.
    asked = trace.take(request_stage(args))
    # 2. The backend: asked for or detected, moved on where a pre-quantized checkpoint's method runs only later.
    chosen = trace.take(backend_stage(asked))
    # 3-6. The target (devices, device), then precision, attention and placement on it.
    fit = fit_stages(asked, chosen, asked.devices)
    # Busy devices: training that fits no strategy on every device, since other processes fill some, is
    # fitted again (3-6) on the idle ones; the line that says so leads the trace.
    fit, passed_over = on_idle_devices(asked, chosen, fit)
    trace.extend(fit.trace)
    # 7. Kernels and serving on the placed model, then what prepare() installs.
    attention = trace.take(kernels_stage(asked, fit))
    tuning = trace.take(tuning_stage(asked, chosen, fit, attention))
    # 8. The launch this process belongs to, and accelerate's settings.
    launch = trace.take(launch_stage(asked, fit))
    # The answer, built from the stage records.
    hub = asked.model.hub if asked.model is not None else None
    revision = hub.commit if hub is not None else None
    steps = (*passed_over, *trace)
    return Resolution(args.task, fit.target, fit.precision, attention, fit.placement, tuning, launch, steps, revision)
