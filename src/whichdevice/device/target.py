"""The hardware a resolution uses: one record, asked by every decider above it.

A :class:`Target` is the backend row, its probe result narrowed to the devices the job uses (``devices=``,
or those this process can use), the device string and its index, how many devices the job may use, the
launched run this process belongs to, and where the choice came from. The questions every folder asks of the
hardware are asked of it (the compute capability, a device's name, the device placement moves the job to)
instead of each folder reading a probe result of its own; device strings are parsed once, where the
user's input is read (device/request.py) or the device string is made (device/detection.py), and
carried here as ``device`` and ``index``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import Backend, DeviceInfo, ProbeResult

if TYPE_CHECKING:
    from whichdevice.launch.context import DistributedContext

__all__ = ["Target"]


@frozen_record
class Target:
    """The backend, its devices as this job uses them, and the device: what every decider asks."""

    backend: Backend
    # The probe result, narrowed to the devices the job uses (device/selection.py).
    probe: ProbeResult
    # "cuda:0", "hpu", "cpu": the device string handed over; ``index`` its index (None: not indexed).
    device: str
    index: int | None
    # The devices the job may use (1 in a launched rank, which owns one).
    count: int
    # The indices the resolution is limited to (devices= asked, or those this process can use); None: all.
    devices: tuple[int, ...] | None = None
    # The launched run this process is a rank of (torchrun, accelerate launch, a scheduler); None: one process.
    distributed: DistributedContext | None = None
    # Where the choice came from: "device", "WHICHDEVICE_DEVICE", "detection", ...
    source: str = "detection"

    @property
    def name(self) -> str:
        """The backend's device string without an index: "cuda", "hpu", "cpu"."""
        return self.backend.name

    @property
    def variant(self) -> str | None:
        """The build's variant ("rocm" for AMD GPUs through the ROCm build of the cuda backend)."""
        return self.probe.variant

    @property
    def simulated(self) -> bool:
        return self.probe.simulated

    @property
    def capability(self) -> tuple[int, int] | None:
        """The lowest compute capability of the devices used (NVIDIA), None where not reported."""
        return self.probe.min_capability

    @property
    def infos(self) -> tuple[DeviceInfo, ...]:
        """What the probe says of each device used, in index order."""
        return self.probe.devices

    def info(self, index: int | None = None) -> DeviceInfo | None:
        """The device at ``index`` (default: this target's device, else the first)."""
        wanted = self.index if index is None else index
        if wanted is None:
            return self.probe.devices[0] if self.probe.devices else None
        return next((d for d in self.probe.devices if d.index == wanted), None)

    def first_name(self) -> str | None:
        """The first device name any device of the target reports ("NVIDIA H100 80GB HBM3"), None where none does."""
        return next((d.name for d in self.probe.devices if d.name), None)

    def moved(self, index: int) -> Target:
        """This target on another of its devices (placement takes one the whole job fits on alone)."""
        return replace(self, device=f"{self.name}:{index}", index=index)

    @classmethod
    def of(cls, backend: Backend, probe: ProbeResult) -> Target:
        """A backend and its probe result as a target on its first device: what a check of a backend that was
        not chosen (a pre-quantized checkpoint's other candidates) asks of it."""
        first = probe.devices[0].index if probe.devices and backend.indexed and not backend.shared_device else None
        device = f"{backend.name}:{first}" if first is not None else backend.name
        return cls(backend, probe, device, first, max(probe.device_count, 1))

    @property
    def distributed_backend(self) -> str | None:
        return self.backend.distributed_backend

    @property
    def launched(self) -> bool:
        """Whether a launcher started this process as one rank of a run."""
        return self.distributed is not None
