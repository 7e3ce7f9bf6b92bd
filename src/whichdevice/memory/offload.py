"""Offload on request (CPU memory, then disk), and what a job that fits nowhere would need instead.

whichdevice never offloads unasked: a model that spills to the CPU runs many times slower, and a
user who did not expect it reads that as a hang. With ``offload="cpu"`` or ``"disk"`` the devices
keep what they can and accelerate puts the rest in ``max_memory["cpu"]``, then ``offload_folder``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from whichdevice.core.errors import ConfigConflictError, DoesNotFitError
from whichdevice.core.job import Job
from whichdevice.core.records import TraceStep
from whichdevice.core.sizes import format_bytes
from whichdevice.memory.job import JobMemory
from whichdevice.memory.record import FIT_FRACTION, SPLIT_FRACTION, Placement
from whichdevice.model.size import ModelSize

if TYPE_CHECKING:
    from whichdevice.core.records import Backend
    from whichdevice.model.shape import ModelShape

__all__ = ["offload_placement", "remedies", "with_ways_out"]

_MiB = 1024**2


def offload_placement(
    weights: int,
    extra: int,
    backend: Backend,
    caps: dict[int | str, int],
    budget_given: bool,
    job: Job,
    cpu: int,
) -> tuple[Placement, list[TraceStep]]:
    """device_map="auto" with the devices' budgets, ``max_memory["cpu"]`` and, for disk, the folder,
    with the trace line that says how much goes where."""
    if backend.memory_by_name and job.offload == "cpu":
        raise ConfigConflictError(
            f"offload='cpu' on {backend.name}: the model is in the memory CPU offload would use already; "
            "use offload='disk' with offload_folder=..."
        )
    fraction = 1.0 if budget_given else SPLIT_FRACTION
    total = sum(caps.values())
    if extra >= total * fraction:
        # The KV cache and activations live on the devices; offload moves weights only.
        raise DoesNotFitError(
            f"offload={job.offload!r} moves weights only, and the job's other memory ({format_bytes(extra)}) "
            f"alone needs more than the {backend.name} devices offer ({format_bytes(int(total * fraction))}); "
            "lower max_length or batch_size, or use more devices"
        )
    budget = {k: max(0, int(c * fraction - extra * c / total)) for k, c in caps.items()}
    if not backend.memory_by_name:
        budget["cpu"] = int(cpu * SPLIT_FRACTION)
    on_devices = sum(v for k, v in budget.items() if k != "cpu")
    spill = max(0, weights - on_devices)
    if job.offload == "cpu" and weights > sum(budget.values()):
        raise DoesNotFitError(
            f"the weights ({format_bytes(weights)}) do not fit even with offload='cpu': the devices keep "
            f"{format_bytes(on_devices)} and the CPU has {format_bytes(budget['cpu'])} to spare; use "
            "offload='disk' with offload_folder=..., or quantize='auto'"
        )
    where = "the CPU" if job.offload == "cpu" else f"the CPU, then {job.offload_folder}"
    note = (
        f"with offload={job.offload!r} as you asked: {backend.name} keeps {format_bytes(on_devices)} and about "
        f"{format_bytes(spill)} of the weights go to {where} (slow: offloaded layers are copied in on every forward "
        "pass)"
    )
    max_memory: dict[int | str, str] = {k: f"{v // _MiB}MiB" for k, v in budget.items()}
    folder = job.offload_folder if job.offload == "disk" else None
    return Placement("auto", max_memory, note, offload_folder=folder), [
        TraceStep("placement", f"device_map='auto' {note}")
    ]


def remedies(
    shape: ModelShape | None,
    size: ModelSize,
    memory: JobMemory,
    backend: Backend,
    caps: dict[int | str, int],
    dtype: str,
    job: Job,
) -> str:
    """The ways out of an inference job's DoesNotFitError, each with what it would need (a training
    job's: memory/training_fit.py)."""
    weights = size.bytes_in(dtype)
    need = weights + memory.bytes
    one = next(iter(caps.values()))
    ways = []
    if one and not backend.memory_by_name:
        count = math.ceil(need / (one * SPLIT_FRACTION))
        how = "sharded with FSDP or DeepSpeed ZeRO-3" if job.task == "training" else "with device_map='auto'"
        ways.append(f"{count} {backend.name} devices like this one ({format_bytes(one)} each), {how}")
    if job.task != "training" and job.offload is None:
        spill = format_bytes(max(0, need - int(one * FIT_FRACTION)))
        ways.append(f"offload='cpu' or offload='disk' (a slow run: about {spill} would leave the device)")
    return f". The whole job needs {memory.describe(weights)}; ways out: " + "; ".join(ways) if ways else ""


def with_ways_out(
    err: DoesNotFitError,
    sized: tuple[ModelShape | None, ModelSize, JobMemory, Backend],
    caps: dict[int | str, int],
    dtype: str,
    job: Job,
    largest: Any,
) -> DoesNotFitError:
    """The error, with what would fit instead: other dtypes, devices, offload, and the largest job here."""
    shape, size, memory, backend = sized
    said = f". On these devices, {largest.text()}" if largest is not None else ""
    return DoesNotFitError(f"{err}{remedies(shape, size, memory, backend, caps, dtype, job)}{said}")
