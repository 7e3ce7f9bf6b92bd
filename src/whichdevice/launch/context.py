"""The record of a multi-process run: where this process sits in it (``res.distributed``).

Apart from :mod:`whichdevice.launch.distributed`, which reads the launchers' variables on every resolve:
a process that no launcher started never imports it (each module a fresh resolve imports costs it a
few tenths of a millisecond; docs/performance.md, the import profile). ``distributed.DistributedContext``
still names it.
"""

from __future__ import annotations

from whichdevice.core.frozen import frozen_record

# typing costs several ms to import; mypy and ruff treat a module-level TYPE_CHECKING = False the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["DistributedContext"]


@frozen_record
class DistributedContext:
    """Where this process sits in a multi-process run, and whether transformers will see the run."""

    launcher: str
    local_rank: int
    rank: int
    world_size: int
    local_world_size: int | None
    # The variables the four numbers above were read from.
    variables: tuple[str, ...]
    # accelerate will set up (or join) a process group; False: only a scheduler's variables say "several".
    seen: bool = True
    # What to export before a process group can start ("MASTER_ADDR=<host name of rank 0>", ...).
    missing: tuple[str, ...] = ()
    # The scheduler whose variables count the processes, if any ("SLURM", "Open MPI", ...).
    scheduler: str | None = None
    # ACCELERATE_TORCH_DEVICE (Ray Train sets it): the device accelerate will use, as given.
    accelerate_device: str | None = None

    @property
    def local_rank_variable(self) -> str:
        return self.variables[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "launcher": self.launcher,
            "local_rank": self.local_rank,
            "rank": self.rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "seen_by_transformers": self.seen,
            "missing": list(self.missing),
        }
