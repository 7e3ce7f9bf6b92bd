"""The answer of resolve_device(): what was chosen, the trace of why, and the keyword arguments that hand it over.

:class:`Resolution` is frozen and JSON-safe (``to_dict``); ``model_kwargs()``, ``pipeline_kwargs()`` and
``training_kwargs()`` give the exact keywords ``from_pretrained``, ``pipeline`` and
``TrainingArguments`` take on the installed transformers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from whichdevice.attention.decode import ATTENTION_NAME, ensure_registered
from whichdevice.core import packages
from whichdevice.core.errors import ConfigConflictError, printable
from whichdevice.core.records import Backend, EnvAction, ProbeResult, TraceStep
from whichdevice.launch.distributed import DistributedContext, process_group_backend

if TYPE_CHECKING:
    import torch

    from whichdevice.launch.accelerate_settings import AccelerateSettings
    from whichdevice.memory.largest import LargestFit
    from whichdevice.memory.quantization import QuantizationPlan
    from whichdevice.memory.strategy import TrainingPlan
    from whichdevice.precision.packing_plan import PackingPlan

__all__ = ["Resolution", "check_device_map"]


@dataclass(frozen=True)
class Resolution:
    """The answer: pass ``model_kwargs()`` to from_pretrained, ``training_kwargs()`` to TrainingArguments."""

    device: str
    backend: Backend
    task: str
    device_count: int
    device_map: str | dict[str, Any]
    dtype_name: str | None
    attn_implementation: str | None
    probe: ProbeResult = field(repr=False)
    max_memory: dict[int | str, str] | None = None
    distributed: DistributedContext | None = None
    env_set: tuple[EnvAction, ...] = ()
    trace: tuple[TraceStep, ...] = field(default=(), repr=False)
    source: str = "detection"
    quantization: QuantizationPlan | None = None
    use_kernels: bool = False
    kernels_key: str | None = None
    torch_compile: bool = False
    # A CPU bf16 load whose batch-1 decode steps were measured faster through torch's own GEMV kernel:
    # prepare(model) hooks them (whichdevice.precision.single_row).
    single_row: bool = False
    # A CPU load whose decode steps at the job's batch (2 or more) were measured faster with the linear
    # weights packed ahead in oneDNN's layout, packing counted against the job's length: the batch
    # prepare(model) packs them for (whichdevice.precision.packed_weights); None: not packed.
    packed_for_batch: int | None = None
    # The seconds that packing may take and leave the job PACK_MARGIN faster (the estimate's budget):
    # prepare(model) stops a packing whose own rate prices the whole copy past it (keeping the layers
    # packed by then). None: no limit.
    packing_budget_s: float | None = None
    # The estimate's figures behind the packing; where the job's new tokens were not told, prepare(model)
    # hooks generate to decide by each call's own (whichdevice.precision.packing_plan).
    packing: PackingPlan | None = field(default=None, repr=False)
    # An inference job on an NVIDIA GPU long enough to repay generate's compile of a static cache's
    # decode step (whichdevice.resolve.generation): generate_kwargs() passes cache_implementation="static".
    static_cache: bool = False
    # Whether model_kwargs() passes attn_implementation: asked for, or chosen over transformers' own pick.
    attn_passed: bool = False
    # TrainingArguments' mixed precision ("bf16", "fp16" or None), chosen to agree with dtype_name.
    mixed_precision: str | None = None
    # Where accelerate puts the weights that fit neither the devices nor the CPU (offload="disk").
    offload_folder: str | None = None
    # Training on several devices: every strategy's memory and the one chosen (memory/strategy.py).
    training_plan: TrainingPlan | None = field(default=None, repr=False)
    # For model= with batch_size=/max_length=: the longest length and largest batch that fit (memory/largest.py).
    fit_limits: LargestFit | None = field(default=None, repr=False)
    # accelerate's variables and config file as this resolution read them (training_arguments()
    # follows the same reading); None for a Resolution built by hand.
    accelerate: AccelerateSettings | None = field(default=None, repr=False, compare=False)
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
        # Unpickled in another process (multiprocessing, a DataLoader worker): the decode attention
        # must be registered there too before res.attn_implementation reaches from_pretrained.
        for key, value in state.items():
            object.__setattr__(self, key, value)
        if state.get("attn_implementation") == ATTENTION_NAME:
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
        return self.probe.simulated

    @property
    def index(self) -> int | None:
        _, _, idx = self.device.partition(":")
        return int(idx) if idx else None

    # ------------------------------------------------------------------------------ adapters

    def model_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``AutoModel*.from_pretrained`` on the installed transformers.

        ``attn_implementation`` is in them only when asked for, or when whichdevice chose something
        better than transformers' own pick and checked that the model's classes support it
        (``attn_passed``); otherwise transformers picks (sdpa where the class supports it, else eager).

        ``overrides`` replace what whichdevice chose (validated: ``device_map="auto"`` on neuron
        or tpu raises, since Accelerate's "auto" does not cover them).
        """
        kwargs: dict[str, Any] = {"device_map": self.device_map}
        plan = self.training_plan
        if plan is not None and plan.chosen is not None and plan.chosen.key == "zero3" and self.distributed:
            del kwargs["device_map"]  # from_pretrained refuses a device_map under ZeRO-3 (zero.Init places)
        if self.dtype_name is not None:
            kwargs[_dtype_keyword()] = self.dtype
        if self.attn_passed and self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        if self.attn_implementation == ATTENTION_NAME:
            ensure_registered()
        if self.max_memory:
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

    def _check_overrides(self, overrides: dict[str, Any]) -> None:
        from whichdevice.resolve.arguments import check_dtype_override, check_map_devices

        if "device_map" in overrides:
            check_device_map(self.backend, overrides["device_map"])
            check_map_devices(overrides["device_map"], self.backend, self.probe)
        for key in ("dtype", "torch_dtype"):
            if overrides.get(key) is not None:
                check_dtype_override(overrides[key], key)
        device = overrides.get("device")
        if device is not None and not (isinstance(device, int) and not isinstance(device, bool) and device >= -1):
            from whichdevice.device.request import parse_device

            parse_device(device, "device")  # pipeline(device=): -1 (CPU), an index, a device string or torch.device

    def prepare(self, model: Any) -> Any:
        """Apply to a loaded ``model`` the runtime settings this resolution measured, and return it.

        On a CPU whose batch-1 bf16 decode steps were measured faster through torch's own GEMV kernel
        (``single_row``), forward passes of one token row run with oneDNN off, restored after each.
        Where decode steps at the job's batch were measured faster with the weights packed ahead
        (``packed_for_batch``), the linear weights get a packed copy beside them, made only while it
        fits in half the memory available, and stopped (the layers packed by then kept) once its own rate
        prices the whole copy above what the job's tokens repay (``packing_budget_s``; the INFO log says what
        was packed, or why not). Where the job's new tokens were not told (``packing_at_generate``),
        nothing is packed yet: ``model.generate`` is hooked, and the first call whose own prompt and
        new tokens repay the packing packs. Where a compiled static cache pays for the job (``static_cache``),
        the model's ``generation_config.cache_implementation`` becomes ``"static"`` unless it is set
        already, so that generate and pipelines use it. The trace's "generation" lines quote why.
        Otherwise nothing changes. Calling it twice is harmless; a pipeline's model is ``pipe.model``."""
        if self.single_row:
            from whichdevice.precision.single_row import install_single_row

            install_single_row(model)
        if self.packing_at_generate and self.packing is not None and self.dtype_name is not None:
            from whichdevice.precision.packing_plan import install_packing_at_generate

            if install_packing_at_generate(model, self.dtype_name, self.packing):
                logging.getLogger("whichdevice").info("prepare: generate packs at the first call its tokens repay")
        elif self.packed_for_batch is not None and self.dtype_name is not None:
            from whichdevice.precision.packed_weights import install_packed_weights

            _, done = install_packed_weights(model, self.dtype_name, self.packed_for_batch, self.packing_budget_s)
            logging.getLogger("whichdevice").info("prepare: %s", done)
        config = getattr(model, "generation_config", None) if self.static_cache else None
        if config is not None and getattr(config, "cache_implementation", None) is None:
            config.cache_implementation = "static"
        return model

    @property
    def packing_at_generate(self) -> bool:
        """Whether prepare(model) leaves the packing to model.generate's calls (new tokens not told)."""
        return self.packing is not None and not self.packing.told and self.packed_for_batch is not None

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``model.generate`` (or a text-generation pipeline's call) that this
        resolution measured faster for the job: ``cache_implementation="static"`` on an NVIDIA GPU for a
        job long enough to repay the compile generate then makes (``static_cache``); else none."""
        return {"cache_implementation": "static"} if self.static_cache else {}

    def pipeline_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``transformers.pipeline``."""
        model_kwargs = self.model_kwargs()
        kwargs: dict[str, Any] = {"device_map": model_kwargs.pop("device_map")}
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
        ddp and compile settings, and both precision flags, ``bf16`` and ``fp16``, stated either way."""
        from whichdevice.launch.trainer_kwargs import training_kwargs_for

        if torch_compile is not None:
            from whichdevice.resolve.arguments import check_flag

            check_flag(torch_compile, "torch_compile")
        compile_ = self.torch_compile if torch_compile is None else torch_compile
        kwargs = training_kwargs_for(self.backend, self.mixed_precision, self.distributed, torch_compile=compile_)
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
        from whichdevice.launch.accelerate_settings import launch_command

        return launch_command(self.backend, self.probe, script, launcher=launcher, nproc=nproc)

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

    def explain(self) -> str:
        """The decision trace as text a person reads top to bottom."""
        header = f"whichdevice chose {self.device} for {self.task}"
        if self.simulated:
            header += " (SIMULATED hardware)"
        width = max((len(s.topic) for s in self.trace), default=8)
        # A step quotes what devices, files and variables said: escaped, so one line stays one line.
        lines = [printable(header)]
        for step in self.trace:
            mark = {True: "+", False: "-", None: " "}[step.chosen]
            lines.append(f"  {mark} {step.topic.ljust(width)}  {printable(step.message)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (``whichdevice --json`` embeds it)."""
        return {
            "device": self.device,
            "backend": self.backend.name,
            "variant": self.probe.variant,
            "task": self.task,
            "source": self.source,
            "device_count": self.device_count,
            "device_map": self.device_map,
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
            "single_row": self.single_row,
            "packed_for_batch": self.packed_for_batch,
            "packing_budget_s": None if self.packing_budget_s is None else round(self.packing_budget_s, 3),
            "packing_at_generate": self.packing_at_generate,
            "generate_kwargs": self.generate_kwargs(),
            "training_kwargs": _json_safe(self.training_kwargs()) if self.task == "training" else None,
            "training_plan": self.training_plan.to_dict() if self.training_plan else None,
            "largest_fit": self.fit_limits.to_dict() if self.fit_limits else None,
            "revision": self.revision,
            "simulated": self.simulated,
            "trace": [s.to_dict() for s in self.trace],
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


def check_device_map(backend: Backend, device_map: Any) -> None:
    from whichdevice.resolve.arguments import check_device_map_shape

    check_device_map_shape(device_map)
    if device_map in ("auto", "balanced", "balanced_low_0", "sequential") and not backend.device_map_auto:
        raise ConfigConflictError(
            f"device_map={device_map!r} does not work on {backend.name}: Accelerate's automatic "
            f"placement does not cover {backend.hardware}; use device_map={backend.name!r}"
        )
