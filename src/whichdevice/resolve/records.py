"""The records the resolver's stages hand on before the answer: what was asked, the backend chosen, and
the stages the busy-device rule runs again (resolve/stages.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from whichdevice.attention.choose import Attention
    from whichdevice.core.job import Job
    from whichdevice.core.records import EnvAction, TraceStep
    from whichdevice.device.request import DeviceRequest
    from whichdevice.device.selection import DevicesAsked
    from whichdevice.device.target import Target
    from whichdevice.launch.accelerate_settings import AccelerateSettings
    from whichdevice.memory.fit import Placement
    from whichdevice.model.facts import ModelFacts
    from whichdevice.model.quantized import CheckpointQuantization
    from whichdevice.precision.decide import Precision
    from whichdevice.resolve.arguments import Arguments

__all__ = ["Chosen", "Fitted", "Request"]


class Request(NamedTuple):
    """What was asked: the arguments as checked, ``model=`` as read, the job the caller described,
    accelerate's settings as read, the device asked for (or detection), and ``devices=`` as parsed."""

    args: Arguments
    model: ModelFacts | None
    job: Job
    device: DeviceRequest
    accelerate: AccelerateSettings
    devices: DevicesAsked | None


class Chosen(NamedTuple):
    """The backend chosen, on its first device (``target``, narrowed in ``fit_stages``), and a
    pre-quantized checkpoint's method with whether transformers loads it dequantized there."""

    target: Target
    quantization: CheckpointQuantization | None = None
    dequantize: bool = False


class Fitted(NamedTuple):
    """The records of the stages that the busy-device rule runs again: the target, the environment its
    backend's hooks set, its precision, attention and placement, and their trace lines."""

    target: Target
    env_set: tuple[EnvAction, ...]
    precision: Precision
    attention: Attention
    placement: Placement
    trace: tuple[TraceStep, ...]
