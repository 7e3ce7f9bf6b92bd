"""The launch as the resolver needs it: the run this process belongs to (refused before training when
it cannot start), and the trace lines that say who launched it and with which process group."""

from __future__ import annotations

from typing import TYPE_CHECKING

from whichdevice.core.records import TraceStep
from whichdevice.launch.distributed import detect_distributed, process_group_backend
from whichdevice.launch.leftovers import launch_leftovers, refuse_leftovers

if TYPE_CHECKING:
    from whichdevice.core.records import Backend
    from whichdevice.launch.context import DistributedContext

__all__ = ["launch_of", "launch_steps"]


def launch_of(backend: Backend, task: str) -> DistributedContext | None:
    """The run this process belongs to, as accelerate will see it with this backend's training settings."""
    # use_cpu=True (what whichdevice passes on the CPU) is the switch that makes accelerate read MPI's variables.
    dist = detect_distributed(cpu=backend.name == "cpu")
    if task != "training":
        return dist
    from whichdevice.launch.checks import check_training_launch, checked_when_resolved  # training only

    # Variables no launcher left together, which transformers would read: refused here, before
    # TrainingArguments fails on them (see whichdevice.launch.leftovers).
    refuse_leftovers(launch_leftovers(cpu=backend.name == "cpu"))
    if checked_when_resolved(dist):
        # A scheduler started the processes: without torch's variables each would train alone on the
        # same data, or fail inside torch. Say what to export instead. (torch's variables alone, a
        # launcher's or set by hand to try a rank, are checked by training_arguments().)
        check_training_launch(dist)
    return dist


def launch_steps(backend: Backend, dist: DistributedContext | None) -> list[TraceStep]:
    leftovers = [TraceStep("warning", f.message) for f in launch_leftovers(cpu=backend.name == "cpu")]
    return leftovers + _launch_steps(backend, dist)


def _launch_steps(backend: Backend, dist: DistributedContext | None) -> list[TraceStep]:
    if dist is None:
        return []
    where = f"rank {dist.rank} of {dist.world_size}, local rank {dist.local_rank} ({dist.local_rank_variable})"
    if not dist.seen:
        return [
            TraceStep(
                "distributed",
                f"{dist.launcher}: {where}; transformers and accelerate do not see this run (they read "
                f"torch's variables): no process group and no ddp_backend, and training is refused until "
                f"you export {' '.join(dist.missing)}",
            )
        ]
    steps = [
        TraceStep(
            "distributed",
            f"{dist.launcher}: {where}; process group backend {process_group_backend(backend, dist)!r}",
        )
    ]
    if dist.missing:
        steps.append(
            TraceStep(
                "warning",
                f"the process group cannot start without {', '.join(m.split('=')[0] for m in dist.missing)}: "
                f"export {' '.join(dist.missing)} (TrainingArguments would fail inside torch without them)",
            )
        )
    return steps
