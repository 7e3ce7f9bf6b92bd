"""Before training starts: whether the launch this process belongs to can train as one run.

The variables are read in distributed.py; here a run transformers would not see, or whose process
group cannot start, is refused with the exports to add.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from whichdevice.core import envview
from whichdevice.core.errors import DeviceError
from whichdevice.launch.distributed import _BY_HAND, SCHEDULERS, TORCH

if TYPE_CHECKING:
    from whichdevice.launch.context import DistributedContext

__all__ = ["check_training_launch", "checked_when_resolved"]


def checked_when_resolved(context: DistributedContext | None) -> bool:
    """Whether resolve_device(task="training") runs check_training_launch for this run: one a
    scheduler started, or one transformers does not see. torch's variables alone (a launcher's, or
    set by hand to try a rank) are checked by training_arguments() only."""
    return context is not None and (not context.seen or context.scheduler is not None)


def check_training_launch(context: DistributedContext | None) -> None:
    """Raise DeviceError, with the exports to add, when this run cannot train as one.

    For the moment before TrainingArguments is built: a run that transformers does not see trains
    each process alone on the same data, and one whose process group cannot start fails inside
    torch ("Default process group has not been initialized", "MASTER_ADDR expected").
    """
    if context is None or (context.seen and not context.missing):
        return
    exports = " ".join(context.missing)
    if context.seen:
        by_hand = [v for v in TORCH if envview.environ().get(v) is not None] if context.launcher == _BY_HAND else []
        stray = f"; or, if {' '.join(by_hand)} are left over from an earlier export, `unset {' '.join(by_hand)}`"
        raise DeviceError(
            f"{context.launcher}: rank {context.rank} of {context.world_size}, but its process group cannot "
            f"start without {', '.join(m.split('=')[0] for m in context.missing)} (torch's env:// rendezvous "
            f"reads them). Set them in each process: `export {exports}`; torchrun and accelerate launch set them"
            + (stray if by_hand else "")
        )
    n = context.world_size
    if context.scheduler is None:
        raise DeviceError(
            f"{context.variables[2]}={n} says {n} processes, but LOCAL_RANK is unset, so transformers and "
            f"accelerate do not see a run: each process would train alone. Set `export {exports}` in each "
            "process, or start them with torchrun or accelerate launch, which set all of them"
        )
    start = next(s.start for s in SCHEDULERS if s.name == context.scheduler)
    raise DeviceError(
        f"{context.launcher} started {n} processes, but transformers and accelerate read "
        f"torch's variables, which are not all set here: each process would train alone on the same data. "
        f"Set them in each process: `{start} bash -c 'export {exports}; python train.py'`, or start the "
        "processes with torchrun, one launcher per node (`srun --ntasks-per-node=1 torchrun "
        "--nnodes=$SLURM_NNODES --nproc-per-node=<processes per node> --rdzv-backend=c10d "
        "--rdzv-endpoint=<host name of rank 0>:29500 train.py`); see docs/distributed.md"
    )
