"""The readings of a device runtime, before any rule is applied: what each probe's reader fills.

Kept apart from :mod:`whichdevice.hardware.probes.common` so that a resolve on a machine whose torch
has no GPU runtime at all (a CPU-only build, no vendor package) never imports them: each module a
fresh resolve imports costs it a few tenths of a millisecond, and the probes that read a runtime are
the only users (``docs/performance.md``, the import profile).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field

from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import EnvAction

__all__ = ["DeviceReading", "RuntimeReadings"]


@frozen_record
class DeviceReading:
    """What a runtime says about one device (a visible one, or one of a management library's list)."""

    name: str | None = None
    memory: int | None = None
    capability: tuple[int, int] | None = None
    uuid: str | None = None
    bf16: bool | None = None
    free: int | None = None
    # The compute mode the driver reports ("default", "exclusive_process", "exclusive_thread",
    # "prohibited"; None: not read), how many other processes hold a context on the device (None:
    # not read), whether this process holds one, and what a trial context made in a child process
    # said (None: not tried; "": it was made; else the error text).
    compute_mode: str | None = None
    other_processes: int | None = None
    own_context: bool = False
    trial: str | None = None


@frozen_record
class RuntimeReadings:
    """Raw readings of a device runtime, before any rule is applied.

    ``devices`` holds one entry per device the runtime shows (after its visible-devices variable);
    ``physical_count`` is how many the machine has before that selection, where something says so;
    ``env`` holds the variables the reader read that are set; ``env_set`` what its hooks did.
    """

    installed: bool = True
    import_error: str | None = None
    env_set: tuple[EnvAction, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    available: bool = False
    devices: tuple[DeviceReading, ...] = ()
    physical_count: int | None = None
    versions: Mapping[str, str] = field(default_factory=dict)
    # The torch the backend's plugin package declares it needs ("==2.13.0.*"; None: says nothing).
    requires_torch: str | None = None
