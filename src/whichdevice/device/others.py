"""A second usable accelerator: which one transformers' Trainer and accelerate would take, and how to choose.

whichdevice takes the first usable backend in its declared order. On a machine with two kinds of
accelerator the stack does not agree with itself: transformers' TrainingArguments, in a single
process, walks its own order (:data:`TRAINER_ORDER`) and moves the model there; accelerate's
PartialState takes the torch build's accelerator (``torch.accelerator``), then hpu, then neuron. So
the trace and the report say that another accelerator is usable, which one the Trainer would train
on, and the argument that chooses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from whichdevice.core.records import TraceStep

if TYPE_CHECKING:
    from whichdevice.core.records import Backend, ProbeResult

__all__ = ["TRAINER_ORDER", "other_accelerators"]

# TrainingArguments._setup_devices (transformers 5.25 training_args.py), single process, use_cpu
# unset: mps, xpu, mlu, musa, npu, hpu, neuron, tpu, then cuda (cuda:0, else ACCELERATE_TORCH_DEVICE
# or cpu). tests/device/test_others.py reads the installed source to keep this in step.
TRAINER_ORDER = ("mps", "xpu", "mlu", "musa", "npu", "hpu", "neuron", "tpu", "cuda")


def other_accelerators(chosen: Backend, later: list[tuple[Backend, ProbeResult | None]]) -> list[TraceStep]:
    """Trace lines for the backends after ``chosen`` in the order (with their probe results; None: not
    probed, the CPU): a warning for each usable one."""
    usable = []
    steps = []
    for backend, result in later:
        if result is not None and result.available and not result.incompatible:
            usable.append(backend.name)
            steps.append(
                TraceStep(backend.name, f"usable too, not chosen: {chosen.name} comes first in the order", False)
            )
        elif result is None:
            steps.append(TraceStep(backend.name, f"not probed: {chosen.name} comes first in the order", False))
        else:
            why = "; ".join(result.incompatible) or result.reason or "not usable"
            steps.append(TraceStep(backend.name, f"not chosen: {why}", False))
    if usable:
        steps.append(TraceStep("warning", _second_accelerator(chosen.name, usable)))
    return steps


def _second_accelerator(chosen: str, usable: list[str]) -> str:
    names = [chosen, *usable]
    trainer = next((n for n in TRAINER_ORDER if n in names), chosen)
    differs = (
        f"transformers' Trainer in a single process would train on {trainer} (its own order: "
        f"{', '.join(TRAINER_ORDER)}) and move the model there"
        if trainer != chosen
        else f"transformers' Trainer in a single process takes {chosen} too"
    )
    return (
        f"a second accelerator is usable here ({', '.join(usable)}) besides {chosen}, which whichdevice chose: "
        f"{differs}; choose one with device={usable[0]!r} or exclude=[{chosen!r}] (and, for the Trainer, make the "
        "other invisible with its visible-devices variable)"
    )
