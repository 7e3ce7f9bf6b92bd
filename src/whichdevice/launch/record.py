"""The launch stage's answer: what this process runs the resolution under, besides the devices.

The launched run itself (torchrun's or accelerate's ranks) is part of the target (device/target.py),
since it decides the device; this record holds what the resolution hands over or reports for the
process: the environment the backend's hooks set, accelerate's own settings as read, and whether
``training_kwargs()`` asks Trainer to compile.
"""

from __future__ import annotations

from dataclasses import field
from typing import TYPE_CHECKING

from whichdevice.core.frozen import frozen_record

if TYPE_CHECKING:
    from whichdevice.core.records import EnvAction
    from whichdevice.launch.accelerate_settings import AccelerateSettings

__all__ = ["Launch"]


@frozen_record
class Launch:
    """``env_set``: what the chosen backend's env hooks did; ``accelerate``: accelerate's variables and
    config file as this resolution read them (training_arguments() follows the same reading; None for
    one built by hand); ``torch_compile``: what resolve_device(torch_compile=) asked for."""

    env_set: tuple[EnvAction, ...] = ()
    accelerate: AccelerateSettings | None = field(default=None, repr=False, compare=False)
    torch_compile: bool = False
