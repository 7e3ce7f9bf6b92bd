"""Where weights of a known size fit: one device, several split with device_map="auto", or nowhere."""

from __future__ import annotations

from dataclasses import field, replace
from typing import Any

from whichdevice.core.frozen import frozen_record
from whichdevice.core.job import Job
from whichdevice.core.sizes import format_bytes
from whichdevice.memory.record import FIT_FRACTION, SPLIT_FRACTION, Placement


def __getattr__(name: str) -> Any:
    # LargestFit lives in memory/largest_record.py (memory/largest.py builds it); named here as before.
    if name == "LargestFit":
        from whichdevice.memory.largest_record import LargestFit

        return LargestFit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CUDA_CONTEXT",
    "FIT_FRACTION",
    "SPLIT_FRACTION",
    "Margin",
    "Placement",
    "plan_placement",
    "priced_margin",
]


# What a process's CUDA context takes from the GPU before any tensor: 287,047,680 bytes with lazy module
# loading (pytorch/pytorch#86509, which made it the default), "around 400MB" once a model runs
# (pytorch/pytorch#109888); kernels loaded as training calls them (cuBLAS, attention) add to it.
CUDA_CONTEXT = 512 * 1024**2
# The caching allocator's own overhead on what a job allocates and frees each step: it rounds blocks up
# and keeps split blocks it cannot coalesce. Its reserve reached 1.27x the active bytes in published
# FSDP-LoRA runs (meta-llama/llama-cookbook#41: 19.36 GB reserved for 15.22 GB active), but it frees
# cached blocks and retries before it fails, so only a share of that gap is lost for good.
FRAGMENTATION = 0.10


@frozen_record
class Margin:
    """What a device keeps back from a job: a share of it (``fraction``: the default, where nothing is
    known of the runtime's own needs), or priced overheads: ``fixed`` bytes (a CUDA context) and a
    share of the job's memory besides its weights (``of_job``: the allocator's fragmentation)."""

    fraction: float = FIT_FRACTION
    fixed: int = 0
    of_job: float = 0.0
    said: str = ""
    short: str = ""  # ``said`` in a few words, for an error that must stay short

    def usable(self, capacity: int, extra: int) -> int:
        return max(0, int(capacity * self.fraction) - self.fixed - int(extra * self.of_job))

    def held_back(self, capacity: int, extra: int) -> str:
        """What the device keeps back from a job with ``extra`` bytes besides its weights, in a few words."""
        if self.said:
            return f"less {format_bytes(capacity - self.usable(capacity, extra))} for {self.short or self.said}"
        return f"{100 - int(self.fraction * 100)}% kept back"

    def note(self, capacity: int, extra: int) -> str:
        if self.said:
            return f"{format_bytes(self.usable(capacity, extra))} usable: {format_bytes(capacity)} less {self.said}"
        return f"{format_bytes(capacity)}, {int(self.fraction * 100)}% usable"


def priced_margin(backend: str, variant: str | None, task: str) -> Margin:
    """A training job on an NVIDIA or AMD GPU has its overheads priced (the runtime and the allocator are
    torch's own, with published figures); everything else keeps the default share, which fails safe."""
    if task != "training" or backend != "cuda":
        return Margin()
    context = "the HIP context" if variant == "rocm" else "the CUDA context"
    return Margin(
        1.0,
        CUDA_CONTEXT,
        FRAGMENTATION,
        f"{context} ({format_bytes(CUDA_CONTEXT)}) and {int(FRAGMENTATION * 100)}% of the job's memory besides the "
        "weights for the allocator's fragmentation",
        f"{context} and the allocator",
    )


def plan_placement(
    weights: int,
    device: str,
    capacities: dict[int | str, int],
    *,
    budget_given: bool,
    can_split: bool,
    backend: str,
    what: str = "the weights",
    margin: Margin | None = None,
    extra: int = 0,
) -> Placement:
    """Place ``weights`` bytes: on ``device`` when it fits there, split with "auto" when it needs
    several of ``capacities`` (device key -> bytes), else a Placement with ``fits=False``.
    ``what`` names the bytes in the notes (the job's memory can be more than the weights); ``margin``
    what one device keeps back (``extra``: the job's memory besides the weights, which it may price)."""
    margin = margin or Margin()
    need = format_bytes(weights)
    first_key = next(iter(capacities))
    first = capacities[first_key]
    room = first if budget_given else margin.usable(first, extra)
    if weights <= room:
        return Placement(
            device,
            None,
            f"{what} ({need}) fit on {device} ("
            + (f"{format_bytes(first)} budget)" if budget_given else f"{margin.note(first, extra)})"),
        )
    split_fraction = 1.0 if budget_given else SPLIT_FRACTION
    total = sum(capacities.values()) * split_fraction
    if can_split and len(capacities) > 1 and weights <= total:
        max_memory = {key: f"{int(cap * split_fraction // (1024**2))}MiB" for key, cap in capacities.items()}
        return Placement(
            "auto",
            max_memory,
            f"{what} ({need}) do not fit one {backend} device ({format_bytes(first)}); split over "
            f"{len(capacities)} devices with device_map='auto' ({format_bytes(total)} usable)",
        )
    where = (
        f"{len(capacities)} {backend} devices ({format_bytes(total)} usable)"
        if len(capacities) > 1 and can_split
        else f"{device} ({format_bytes(room)} usable"
        + (f": {format_bytes(first)} less {margin.said})" if margin.said and not budget_given else ")")
    )
    return Placement(device, None, f"{what} ({need}) do not fit {where}", fits=False)


@frozen_record
class JobFit:
    """The devices a model goes on, how plan_placement is to fit weights into them, and the job's
    memory besides the weights (``extra``)."""

    device: str
    caps: dict[int | str, int]
    budget_given: bool
    can_split: bool
    backend: str
    extra: int = 0
    job: Job = field(default_factory=Job)
    margin: Margin = field(default_factory=Margin)

    def usable(self, key: int | str | None = None) -> int:
        """What the first device (or ``key``) offers this job: its budget, or its capacity less the margin."""
        cap = self.caps[key if key is not None else next(iter(self.caps))]
        return cap if self.budget_given else self.margin.usable(cap, self.extra)

    def plan(self, weights: int) -> Placement:
        what = "the weights and the job's memory" if self.extra else "the weights"
        placed = plan_placement(
            weights + self.extra,
            self.device,
            self.caps,
            budget_given=self.budget_given,
            can_split=self.can_split,
            backend=self.backend,
            what=what,
            margin=self.margin,
            extra=self.extra,
        )
        if not (placed.fits and placed.device_map == "auto"):
            return placed
        # max_memory bounds the weights only: each device keeps its share of the rest free.
        fraction = 1.0 if self.budget_given else SPLIT_FRACTION
        total = sum(self.caps.values())
        budget = {
            k: f"{max(0, int(c * fraction - self.extra * c / total)) // 1024**2}MiB" for k, c in self.caps.items()
        }
        if not self.job.generation:
            return replace(placed, max_memory=budget)
        note = (
            f"{placed.note}; 'balanced_low_0' keeps {self.backend}:0 light for generate()'s "
            "inputs and logits, as transformers advises for generation"
        )
        return replace(
            placed,
            device_map="balanced_low_0",
            max_memory=budget,
            note=note.replace("device_map='auto'", "device_map='balanced_low_0'"),
        )
