"""The answer of resolve_device(): what was chosen, the trace of why, and the keyword arguments that hand it over.

:class:`Resolution` is frozen and JSON-safe (``to_dict``); ``model_kwargs()``, ``pipeline_kwargs()`` and
``training_kwargs()`` give the exact keywords ``from_pretrained``, ``pipeline`` and
``TrainingArguments`` take on the installed transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import TYPE_CHECKING, Any

from whichdevice.attention.decode_forward import ensure_registered
from whichdevice.core import packages
from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import TraceStep
from whichdevice.hardware.absent import trace_text
from whichdevice.launch.distributed import process_group_backend
from whichdevice.launch.launch_strategy import partitioned_on_load
from whichdevice.launch.record import Launch
from whichdevice.resolve.deprecated_names import DeprecatedNames
from whichdevice.resolve.flat_names import FlatNames

if TYPE_CHECKING:
    import torch

    from whichdevice.attention.record import Attention
    from whichdevice.device.target import Target
    from whichdevice.memory.largest_record import LargestFit
    from whichdevice.memory.record import Placement
    from whichdevice.precision.record import Precision
    from whichdevice.tuning.record import Tuning

__all__ = ["Resolution"]


@frozen_record
class Resolution(FlatNames, DeprecatedNames):
    """The answer: pass ``model_kwargs()`` to from_pretrained, ``training_kwargs()`` to TrainingArguments.

    Built from the resolver's stage records, one a stage (docs/architecture.md): the ``target`` (the
    backend, its devices as used, the device), its ``precision``, ``attention``, ``placement``, ``tuning``
    and ``launch``, with the ``trace`` of why. The flat names of schema 1.x (``device``, ``dtype_name``,
    ``device_map``, ...) read them; the fields ``tuning`` replaced warn and read it (resolve/deprecated_names.py)."""

    task: str
    target: Target = field(repr=False)
    precision: Precision = field(repr=False)
    attention: Attention = field(repr=False)
    placement: Placement = field(repr=False)
    # What prepare(model) installs (whichdevice.tuning): measured CPU settings, generate's static cache
    # on a GPU, the CPU decode attention; None where nothing is tuned.
    tuning: Tuning | None = None
    launch: Launch = field(default_factory=Launch, repr=False)
    trace: tuple[TraceStep, ...] = field(default=(), repr=False)
    # A Hub model read from its fetched metadata: the commit read, which model_kwargs() pins (revision=)
    # so that from_pretrained loads the files the answer was made from.
    revision: str | None = None

    def __str__(self) -> str:
        return self.device

    def __repr__(self) -> str:
        # The generated repr printed the whole backend record and probe result, pages of it in a REPL.
        return (
            f"Resolution(device={self.device!r}, task={self.task!r}, dtype={self.dtype_name!r}, "
            f"attn_implementation={self.attn_implementation!r}, device_map={self.device_map!r})"
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled in another process (multiprocessing, a DataLoader worker): registered there too, for a
        # script that passes "whichdevice_sdpa" by hand (the keywords name sdpa; prepare() registers it).
        for key, value in state.items():
            object.__setattr__(self, key, value)
        if getattr(state.get("tuning"), "decode_attention", False):
            ensure_registered()

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype chosen for this hardware (None: leave it to transformers)."""
        if self.dtype_name is None:
            return None
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype_name)
        return dtype

    @property
    def simulated(self) -> bool:
        return self.target.simulated

    @property
    def gradient_checkpointing(self) -> bool | None:
        """Whether training checkpoints activations, as the plan priced it and ``training_kwargs()`` hands it
        over; None where nothing was decided (inference, or training without model=)."""
        return self.training_setup.checkpointing if self.training_setup is not None else None

    @property
    def index(self) -> int | None:
        return self.target.index

    # ------------------------------------------------------------------------------ adapters

    def model_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``AutoModel*.from_pretrained`` on the installed transformers.

        ``attn_implementation`` is in them only when asked for, or when whichdevice chose something
        better than transformers' own pick and checked that the model's classes support it
        (``attn_passed``); otherwise transformers picks (sdpa where the class supports it, else eager).
        It is always a name transformers knows (the decode attention is sdpa here; ``prepare`` installs
        it). Under DeepSpeed ZeRO-3 there is no ``device_map``: from_pretrained refuses one there.

        ``overrides`` replace what whichdevice chose (validated: ``device_map="auto"`` on neuron
        or tpu raises, since Accelerate's "auto" does not cover them).
        """
        kwargs: dict[str, Any] = {"device_map": self.device_map}
        if self._partitioned_on_load():
            del kwargs["device_map"]  # from_pretrained refuses a device_map under ZeRO-3 (zero.Init places)
        if self.dtype_name is not None:
            kwargs[_dtype_keyword()] = self.dtype
        if self.attn_passed and self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        if self.max_memory and "device_map" in kwargs:
            kwargs["max_memory"] = dict(self.max_memory)
        if self.offload_folder is not None:
            kwargs["offload_folder"] = self.offload_folder
        if self.quantization is not None:
            kwargs["quantization_config"] = self.quantization.config()
        if self.use_kernels:
            kwargs["use_kernels"] = True
        if self.revision is not None:
            kwargs["revision"] = self.revision
        for key in ("dtype", "torch_dtype"):
            if key in overrides:
                kwargs.pop("dtype", None)
                kwargs.pop("torch_dtype", None)
        self._check_overrides(overrides)
        kwargs.update(overrides)
        return kwargs

    def _partitioned_on_load(self) -> bool:
        plan = self.training_plan
        planned = plan.chosen.key if plan is not None and plan.chosen is not None else None
        launched = self.accelerate.strategy if self.accelerate is not None and self.task == "training" else None
        return partitioned_on_load(planned, launched, self.distributed is not None)

    def _check_overrides(self, overrides: dict[str, Any]) -> None:
        from whichdevice.resolve.arguments import check_device_map, check_dtype_override, check_map_devices

        if "device_map" in overrides:
            check_device_map(self.backend, overrides["device_map"])
            check_map_devices(overrides["device_map"], self.target)
        for key in ("dtype", "torch_dtype"):
            if overrides.get(key) is not None:
                check_dtype_override(overrides[key], key)
        device = overrides.get("device")
        if device is not None and not (isinstance(device, int) and not isinstance(device, bool) and device >= -1):
            from whichdevice.device.request import parse_device

            parse_device(device, "device")  # pipeline(device=): -1 (CPU), an index, a device string or torch.device

    def prepare(self, model: Any) -> Any:
        """Install on ``model`` the runtime settings this resolution measured worth it (``tuning``), and
        return it. ``model``: a transformers model, a PEFT model or a pipeline (its model); anything
        else is a DeviceError. What each setting changes, and what is guaranteed (the prepared model
        computes what the model computes with its current weights, however they are changed; the
        process is left as found), is in docs/tuning.md. Calling it twice is harmless;
        ``unprepare(model)`` takes it all back."""
        from whichdevice.tuning.prepare import prepare

        return prepare(self.tuning, model)

    def unprepare(self, model: Any) -> Any:
        """Take back everything ``prepare`` installed on ``model`` (see docs/tuning.md), and return it."""
        from whichdevice.tuning.prepare import unprepare

        return unprepare(model)

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``model.generate`` (or a text-generation pipeline's call) that this
        resolution measured faster for the job: ``cache_implementation="static"`` on an NVIDIA GPU for a
        job long enough to repay the compile generate then makes; else none (``prepare`` passes them
        to generate calls that set no cache of their own)."""
        return self.tuning.generate_kwargs() if self.tuning is not None else {}

    def generate_batch_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``model.generate_batch`` (transformers' continuous batching) for a
        resolution made with ``serving=True``: ``continuous_batching_config``, a
        ``ContinuousBatchingConfig`` with the fields whichdevice checked (``auto_switch_to_flash=False``
        where FlashAttention does not fit here); ``{}`` where continuous batching does not apply or
        nothing was checked. Each field is passed only where the installed transformers has it."""
        if self.serving is None or not self.serving.applies or not self.serving.config:
            return {}
        import dataclasses

        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        checked = {k: v for k, v in self.serving.config.items() if k in known}
        return {"continuous_batching_config": ContinuousBatchingConfig(**checked)} if checked else {}

    def pipeline_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``transformers.pipeline``. Where the model is loaded on the CPU first
        (``load_peak.remedy == "cpu"``), ``device=`` instead of ``device_map``: pipeline then loads
        it on the CPU and moves it there itself."""
        model_kwargs = self.model_kwargs()
        via_cpu = self.load_peak is not None and self.load_peak.remedy == "cpu"
        kwargs: dict[str, Any] = {"device": self.device} if via_cpu else {}
        if "device_map" in model_kwargs and not via_cpu:  # none under ZeRO-3, which places as it loads
            kwargs["device_map"] = model_kwargs["device_map"]
        model_kwargs.pop("device_map", None)
        key = _dtype_keyword()
        if key in model_kwargs:
            kwargs[key] = model_kwargs.pop(key)
        if "revision" in model_kwargs:  # pipeline() takes it itself and passes it to from_pretrained
            kwargs["revision"] = model_kwargs.pop("revision")
        kwargs["model_kwargs"] = model_kwargs
        self._check_overrides(overrides)
        kwargs.update(overrides)
        return kwargs

    def training_kwargs(self, *, torch_compile: bool | None = None) -> dict[str, Any]:
        """Keyword arguments for ``TrainingArguments`` (or a subclass such as TRL's SFTConfig): device,
        ddp and compile settings, both precision flags, ``bf16`` and ``fp16``, stated either way, and
        ``tf32=True`` where the resolution cleared it (``tf32``)."""
        from whichdevice.launch.trainer_kwargs import training_kwargs_for

        if torch_compile is not None:
            from whichdevice.resolve.arguments import check_flag

            check_flag(torch_compile, "torch_compile")
        compile_ = self.torch_compile if torch_compile is None else torch_compile
        kwargs = training_kwargs_for(self.backend, self.mixed_precision, self.distributed, torch_compile=compile_)
        if self.tf32:
            kwargs["tf32"] = True
        if self.gradient_checkpointing:
            from whichdevice.launch.trainer_kwargs import checkpointing_kwargs

            kwargs.update(checkpointing_kwargs())
        if self.training_plan is not None and self.distributed is not None:
            # Only a launched rank shards: in one process fsdp/deepspeed have no process group to run in.
            kwargs.update(self.training_plan.kwargs())
        return kwargs

    def launch_command(
        self, script: Sequence[str], *, launcher: str = "torchrun", nproc: int | None = None
    ) -> list[str]:
        """The argument list that runs ``script`` once per device of this machine.

        ``res.launch_command(["train.py", "--lr", "1e-4"])`` is ``["torchrun", "--nproc-per-node=4",
        "train.py", "--lr", "1e-4"]`` on a machine with four GPUs; ``launcher="accelerate"`` gives
        ``accelerate launch --num_processes 4`` instead. A visible-devices variable set here is
        written in front (``["env", "CUDA_VISIBLE_DEVICES=2,3", ...]``) so that any shell selects the
        same devices. ``nproc`` overrides the count. Pass it to ``subprocess.run``.
        """
        from whichdevice.device.launch_command import launch_command

        return launch_command(self.target, script, launcher=launcher, nproc=nproc)

    def largest_fit(self) -> LargestFit:
        """The largest ``max_length`` at the given ``batch_size``, and the largest ``batch_size`` at the
        given ``max_length``, that fit the chosen devices (``.longest``, ``.largest_batch``, ``.text()``)."""
        if self.fit_limits is None:
            from whichdevice.core.errors import DeviceError

            raise DeviceError(
                "largest_fit() needs the job: resolve with model=... and batch_size=... or max_length=... "
                "(and without quantize='4bit'/'8bit', whose limits placement does not search)"
            )
        return self.fit_limits

    # --------------------------------------------------------------------------- explanation

    def explain(self, *, verbose: bool = False) -> str:
        """The decision trace as text a person reads top to bottom. The backends that are simply not installed
        share one line ("not installed: neuron, tpu, ..."); ``verbose=True`` gives each its own, with its install
        command (``trace`` and ``to_dict()`` always hold each)."""
        header = f"whichdevice chose {self.device} for {self.task}"
        if self.simulated:
            header += " (SIMULATED hardware)"
        return trace_text(header, self.trace, verbose=verbose)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (``whichdevice --json`` embeds it)."""
        tuning = self.tuning.to_dict() if self.tuning is not None else None
        return {
            "device": self.device,
            "backend": self.backend.name,
            "variant": self.probe.variant,
            "task": self.task,
            "source": self.source,
            "device_count": self.device_count,
            "devices": list(self.devices) if self.devices is not None else None,
            "device_map": self.device_map,
            # Since 1.9: false where model_kwargs() passes no device_map (ZeRO-3 places the weights as they load).
            "device_map_passed": not self._partitioned_on_load(),
            "dtype": self.dtype_name,
            "attn_implementation": self.attn_implementation,
            "attn_implementation_passed": self.attn_passed,
            "max_memory": {str(k): v for k, v in self.max_memory.items()} if self.max_memory else None,
            "offload_folder": self.offload_folder,
            "distributed": self.distributed.to_dict() if self.distributed else None,
            "distributed_backend": process_group_backend(self.backend, self.distributed),
            "env_set": [a.to_dict() for a in self.env_set],
            "quantization": self.quantization.to_dict() if self.quantization else None,
            "use_kernels": self.use_kernels,
            "kernels_key": self.kernels_key,
            "tuning": tuning,
            # The schema's 1.3-1.6 fields, the same as tuning's (kept for 1.x readers).
            **{key: tuning[key] if tuning else default for key, default in _FLAT_TUNING.items()},
            "generate_kwargs": self.generate_kwargs(),
            # Since 1.8: serving=True's continuous batching ({"applies", "continuous_batching_config"}), else null.
            "serving": self.serving.to_dict() if self.serving is not None else None,
            "training_kwargs": _json_safe(self.training_kwargs()) if self.task == "training" else None,
            "training_plan": self.training_plan.to_dict() if self.training_plan else None,
            # Since 1.9: how a training job trains as priced (memory/training_job.py), else null.
            "training": self.training_setup.to_dict() if self.training_setup is not None else None,
            "largest_fit": self.fit_limits.to_dict() if self.fit_limits else None,
            "revision": self.revision,
            "load_peak": self.load_peak.to_dict() if self.load_peak else None,
            "simulated": self.simulated,
            "trace": [s.to_dict() for s in self.trace],
        }


# Report fields from before the tuning record, and their value where nothing is tuned.
_FLAT_TUNING: dict[str, Any] = {
    "single_row": False,
    "packed_for_batch": None,
    "packing_budget_s": None,
    "packing_at_generate": False,
}


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _dtype_keyword() -> str:
    # transformers 4.56 renamed from_pretrained's torch_dtype to dtype; read the installed
    # version from metadata so transformers itself is not imported here.
    version = packages.package_version("transformers")
    return "dtype" if version is None or packages.version_at_least(version, "4.56") else "torch_dtype"
