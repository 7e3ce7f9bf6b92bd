"""Where weights of a known size fit: one device, several split with device_map="auto", or nowhere."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from whichdevice.core.job import Job
from whichdevice.core.sizes import format_bytes

__all__ = ["FIT_FRACTION", "SPLIT_FRACTION", "Placement", "plan_placement"]


# A model "fits" one device when its weights take at most this share of the memory; the rest is
# for activations, the KV cache and the runtime's own allocations.
FIT_FRACTION = 0.8


# When a model must be split, each device offers this share to accelerate's max_memory.
SPLIT_FRACTION = 0.9


@dataclass(frozen=True)
class Placement:
    """Where the weights go: ``device_map`` and, when split, ``max_memory``."""

    device_map: str | dict[str, Any]
    max_memory: dict[int | str, str] | None
    note: str
    fits: bool = True


def plan_placement(
    weights: int,
    device: str,
    capacities: dict[int | str, int],
    *,
    budget_given: bool,
    can_split: bool,
    backend: str,
    what: str = "the weights",
) -> Placement:
    """Place ``weights`` bytes: on ``device`` when it fits there, split with "auto" when it needs
    several of ``capacities`` (device key -> bytes), else a Placement with ``fits=False``.
    ``what`` names the bytes in the notes (the job's memory can be more than the weights)."""
    fraction = 1.0 if budget_given else FIT_FRACTION
    need = format_bytes(weights)
    first_key = next(iter(capacities))
    first = capacities[first_key]
    if weights <= first * fraction:
        return Placement(
            device,
            None,
            f"{what} ({need}) fit on {device} ({format_bytes(first)}"
            + (" budget)" if budget_given else f", {int(FIT_FRACTION * 100)}% usable)"),
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
        else f"{device} ({format_bytes(first * fraction)} usable)"
    )
    return Placement(device, None, f"{what} ({need}) do not fit {where}", fits=False)


@dataclass(frozen=True)
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
            f"{placed.note}; 'balanced_low_0' keeps {self.device.split(':')[0]}:0 light for generate()'s "
            "inputs and logits, as transformers advises for generation"
        )
        return replace(
            placed,
            device_map="balanced_low_0",
            max_memory=budget,
            note=note.replace("device_map='auto'", "device_map='balanced_low_0'"),
        )
