"""The names a Resolution had before it was built from stage records (schema 1.x), read from those records.

``Resolution`` holds one record a stage (resolve/resolution.py); ``res.device``, ``res.dtype_name``,
``res.device_map`` and the rest stay what they were, read-only, from the record that decides each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from whichdevice.attention.record import Attention, Serving
    from whichdevice.core.records import Backend, EnvAction, ProbeResult
    from whichdevice.device.target import Target
    from whichdevice.launch.accelerate_settings import AccelerateSettings
    from whichdevice.launch.context import DistributedContext
    from whichdevice.launch.record import Launch
    from whichdevice.memory.largest_record import LargestFit
    from whichdevice.memory.load_peak import LoadPeak
    from whichdevice.memory.quantization_plan import QuantizationPlan
    from whichdevice.memory.record import Placement
    from whichdevice.memory.training_records import TrainingPlan, TrainingSetup
    from whichdevice.precision.record import Precision

__all__ = ["FlatNames"]


class FlatNames:
    """Read-only properties over the stage records a Resolution holds."""

    target: Target
    precision: Precision
    attention: Attention
    placement: Placement
    launch: Launch

    @property
    def device(self) -> str:
        return self.target.device

    @property
    def backend(self) -> Backend:
        return self.target.backend

    @property
    def probe(self) -> ProbeResult:
        """The backend's probe result, narrowed to the devices this resolution uses."""
        return self.target.probe

    @property
    def device_count(self) -> int:
        return self.target.count

    @property
    def devices(self) -> tuple[int, ...] | None:
        """The device indices (as this process numbers them) the resolution is limited to: devices= asked,
        or those this process can use (DeviceInfo.unusable); None: every visible device."""
        return self.target.devices

    @property
    def source(self) -> str:
        return self.target.source

    @property
    def distributed(self) -> DistributedContext | None:
        return self.target.distributed

    @property
    def dtype_name(self) -> str | None:
        """The dtype the weights load in (None: leave it to transformers)."""
        return self.placement.weights

    @property
    def mixed_precision(self) -> str | None:
        """TrainingArguments' mixed precision ("bf16", "fp16" or None), chosen to agree with dtype_name."""
        return self.precision.mixed

    @property
    def tf32(self) -> bool | None:
        """True where training_kwargs() hands tf32=True over (fp32 training on a GPU with TF32, an
        architecture cleared for it: precision/tf32.py); None: not handed over."""
        return self.precision.tf32

    @property
    def attn_implementation(self) -> str | None:
        return self.attention.name

    @property
    def attn_passed(self) -> bool:
        """Whether model_kwargs() passes attn_implementation: asked for, or chosen over transformers' own pick."""
        return self.attention.passed

    @property
    def use_kernels(self) -> bool:
        return self.attention.use_kernels

    @property
    def kernels_key(self) -> str | None:
        return self.attention.kernels_key

    @property
    def serving(self) -> Serving | None:
        """resolve_device(serving=True): whether continuous batching applies and the ContinuousBatchingConfig
        fields checked for it (attention/serving.py); None for a job that serves no requests."""
        return self.attention.serving

    @property
    def device_map(self) -> str | dict[str, Any]:
        return self.placement.device_map

    @property
    def max_memory(self) -> dict[int | str, str] | None:
        return self.placement.max_memory

    @property
    def offload_folder(self) -> str | None:
        """Where accelerate puts the weights that fit neither the devices nor the CPU (offload="disk")."""
        return self.placement.offload_folder

    @property
    def quantization(self) -> QuantizationPlan | None:
        return self.placement.quantization

    @property
    def training_plan(self) -> TrainingPlan | None:
        """Training on several devices: every strategy's memory and the one chosen (memory/strategy.py)."""
        return self.placement.plan

    @property
    def training_setup(self) -> TrainingSetup | None:
        """task="training" with model=: how the job trains as placement priced it (full, LoRA or QLoRA, the
        dtypes, the optimizer, gradient checkpointing: memory/training_job.py); None otherwise."""
        return self.placement.setup

    @property
    def fit_limits(self) -> LargestFit | None:
        """For model= with batch_size=/max_length=: the longest length and largest batch that fit
        (memory/largest.py)."""
        return self.placement.limits

    @property
    def load_peak(self) -> LoadPeak | None:
        """With model= on one device: the load's own peak there (transformers' allocator warm-up,
        memory/load_peak.py) and its remedy where only the load does not fit ("cpu": load, then move)."""
        return self.placement.load

    @property
    def env_set(self) -> tuple[EnvAction, ...]:
        return self.launch.env_set

    @property
    def accelerate(self) -> AccelerateSettings | None:
        """accelerate's variables and config file as this resolution read them (training_arguments()
        follows the same reading); None for a Resolution built by hand."""
        return self.launch.accelerate

    @property
    def torch_compile(self) -> bool:
        return self.launch.torch_compile
