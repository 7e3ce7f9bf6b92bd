"""Records shared by every layer: trace steps, probe results, backend rows, variables a hook set.

They live at the bottom so that no module has to import upward to name them: the registry holds
:class:`Backend` rows, the probes return :class:`ProbeResult`, the resolver's deciders return
:class:`TraceStep` lines with their values, gathered in a :class:`Trace`. Frozen
dataclasses (``@frozen_record``); nothing here touches hardware or imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import field
from typing import Any, TypeVar

from whichdevice.core.frozen import frozen_record

T = TypeVar("T")

__all__ = ["Backend", "DeviceInfo", "EnvAction", "EnvDefault", "ProbeResult", "Trace", "TraceStep", "Visibility"]


@frozen_record
class TraceStep:
    """One line of the decision trace: what was decided (``topic``) and why."""

    topic: str
    message: str
    chosen: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"topic": self.topic, "message": self.message, "chosen": self.chosen}


class Trace(list[TraceStep]):
    """The trace lines of a pipeline. Every decider returns ``(value, steps)``; ``take`` keeps the
    steps here and hands back the value, so a decider never appends to a list it was given."""

    def take(self, step: tuple[T, Iterable[TraceStep]]) -> T:
        value, steps = step
        self.extend(steps)
        return value


@frozen_record
class EnvAction:
    """What a hook did with one variable: "set" it, or "kept" the user's different value."""

    name: str
    value: str
    action: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "value": self.value, "action": self.action, "message": self.message}


@frozen_record
class Visibility:
    """Which physical devices a backend's runtime will show, and from which variable."""

    variable: str | None = None
    raw: str | None = None
    ids: tuple[str, ...] | None = None
    warnings: tuple[str, ...] = ()

    @property
    def restricted(self) -> bool:
        return self.ids is not None

    def count(self, physical: int | None = None) -> int | None:
        """Visible count given ``physical`` devices (None when it cannot be known)."""
        if self.ids is None:
            return physical
        return len(self.ids)

    def physical_id(self, index: int) -> str:
        """The physical device behind visible ``index`` ("3", "GPU-8a1...", or the index itself)."""
        if self.ids is None:
            return str(index)
        return self.ids[index]


@frozen_record
class DeviceInfo:
    """One visible device: index as this process sees it, and the physical device behind it."""

    index: int
    name: str | None = None
    total_memory: int | None = None
    capability: tuple[int, int] | None = None
    generation: str | None = None
    physical_id: str | None = None
    bf16: bool | None = None
    # Bytes free now, where the runtime says so without starting a device context (NVML, psutil);
    # None: unknown, and placement sizes against total_memory instead.
    free_memory: int | None = None
    # The GPU's compute mode as the driver reports it: "default", "exclusive_process",
    # "exclusive_thread" (NVIDIA's legacy mode) or "prohibited"; None where it is not read.
    compute_mode: str | None = None
    # How many other processes hold a context on it (None: unknown).
    other_processes: int | None = None
    # Why this process cannot use it (an exclusive-process GPU another process holds, a prohibited
    # one); None: usable as far as the runtime says. Resolutions leave such a device out.
    unusable: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "total_memory": self.total_memory,
            "capability": ".".join(map(str, self.capability)) if self.capability else None,
            "generation": self.generation,
            "physical_id": self.physical_id,
            "bf16": self.bf16,
            "free_memory": self.free_memory,
            "compute_mode": self.compute_mode,
            "other_processes": self.other_processes,
            "unusable": self.unusable,
        }


@frozen_record
class ProbeResult:
    """What one backend's probe found. ``reason`` says why it is not available, and what to do."""

    backend: str
    installed: bool
    available: bool
    device_count: int = 0
    devices: tuple[DeviceInfo, ...] = ()
    versions: Mapping[str, str] = field(default_factory=dict)
    variant: str | None = None
    reason: str | None = None
    warnings: tuple[str, ...] = ()
    env_set: tuple[EnvAction, ...] = ()
    features: frozenset[str] = frozenset()
    os_version: str | None = None
    visible: Visibility | None = None
    simulated: bool = False
    seconds: float = 0.0
    # What the installed stack cannot do on these devices (driver, kernel architectures, a plugin's
    # torch), each with its fix: ``whichdevice check`` fails on any (see compatibility.py).
    incompatible: tuple[str, ...] = ()
    # The machine where that matters for what to install: "jetson", "dgx-spark", "grace", "aarch64"
    # for NVIDIA on ARM64 (hardware/probes/nvidia_platforms.py); None elsewhere.
    platform: str | None = None

    def __bool__(self) -> bool:
        return self.available

    @property
    def min_capability(self) -> tuple[int, int] | None:
        caps = [d.capability for d in self.devices if d.capability is not None]
        return min(caps) if caps else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (used by ``whichdevice --json``)."""
        return {
            "backend": self.backend,
            "installed": self.installed,
            "available": self.available,
            "device_count": self.device_count,
            "devices": [d.to_dict() for d in self.devices],
            "versions": dict(self.versions),
            "variant": self.variant,
            "reason": self.reason,
            "warnings": list(self.warnings),
            "env_set": [a.to_dict() for a in self.env_set],
            "features": sorted(self.features),
            "os_version": self.os_version,
            "visible_devices": (
                {
                    "variable": self.visible.variable,
                    "value": self.visible.raw,
                    "physical_ids": list(self.visible.ids) if self.visible.ids is not None else None,
                }
                if self.visible is not None and self.visible.variable
                else None
            ),
            "simulated": self.simulated,
            "seconds": round(self.seconds, 6),
            "incompatible": list(self.incompatible),
            "platform": self.platform,
        }


ProbeFunction = Callable[["Backend"], "ProbeResult"]


@frozen_record
class EnvDefault:
    """An environment variable a backend needs, set only when the user has not set it."""

    name: str
    value: str
    why: str
    # "import": before the backend's package is imported by its probe; "select": when chosen.
    stage: str = "import"


@frozen_record
class Backend:
    """Everything whichdevice knows about one device string without touching hardware."""

    name: str
    hardware: str
    package: str
    module: str
    probe_ref: str | ProbeFunction = field(repr=False)
    visible_devices_env: tuple[str, ...] = ()
    distributed_backend: str | None = None
    # Other process-group backends that also work here (validated against a user's ddp_backend).
    other_distributed_backends: tuple[str, ...] = ()
    compile_backend: str | None = "inductor"
    device_map_auto: bool = True
    # Accelerate's max_memory names this device's memory by the backend's name ("cpu", "mps"), not
    # by device index: one pool, which a model is never split across.
    memory_by_name: bool = False
    bitsandbytes: bool = False
    # The kernels package's device key (None: Hub kernels have no builds for this backend).
    kernels_key: str | None = None
    # FlashAttention versions transformers runs here (the flash-attn packages, or Hub kernels).
    flash_attention: tuple[int, ...] = ()
    # Versions the backend's own package serves without any flash-attn package (torch_npu's).
    flash_attention_native: tuple[int, ...] = ()
    # False where the flash-attn pip packages have no build for this hardware: an installed one is
    # then no reason to choose FlashAttention here (it is a Hub kernel, opted into).
    flash_attn_builds: bool = True
    # fp16 computes fast here and fp16 mixed-precision training works; False on CPUs and on chips
    # built for bf16 (TPU, Trainium).
    fast_fp16: bool = True
    # True: "cuda:0" names the first device; False: the bare string ("hpu", "mps") is the usual form.
    indexed: bool = True
    # True: one device that every process of the machine shares (the CPU): its device string never
    # carries an index, and the processes of a distributed run do not take one device per rank.
    shared_device: bool = False
    # True: a process addresses one device, its current one, and device strings take no other index
    # (Gaudi's bridge: no "hpu:1"); an index other than 0 is refused in one process, named with the fix.
    one_device_a_process: bool = False
    default_dtype: str = "float32"
    env_defaults: tuple[EnvDefault, ...] = ()
    install_hint: str = ""
    docs: str = ""

    @property
    def install_command(self) -> str:
        """The command that installs this backend's package."""
        return self.install_hint or f"pip install {self.package}"

    @property
    def probe(self) -> ProbeFunction:
        """The probe function, imported on first use (the registry itself imports nothing)."""
        ref = self.probe_ref
        if callable(ref):
            return ref
        module_name, _, attr = ref.partition(":")
        func: ProbeFunction = getattr(importlib.import_module(module_name), attr)
        return func

    def __str__(self) -> str:
        return self.name
