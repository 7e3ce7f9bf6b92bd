"""The distributed context of this process, read from what torchrun, accelerate, SLURM or MPI set."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from whichdevice.errors import DeviceError

if TYPE_CHECKING:
    from whichdevice.records import Backend

__all__ = ["ENV_VARIABLES", "LAUNCHER_VARIABLES", "DistributedContext", "detect_distributed", "process_group_backend"]

# (launcher, local rank, global rank, world size, local world size) variable names, most specific
# first: torchrun and accelerate launch export the first set, srun the SLURM_* set, mpirun OMPI_*.
LAUNCHER_VARIABLES = (
    ("torchrun", "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    ("mpi", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("slurm", "SLURM_LOCALID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"),
)
# The variables this module reads (the memo key holds them; see whichdevice.memo).
ENV_VARIABLES = tuple(name for launcher in LAUNCHER_VARIABLES for name in launcher[1:])


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in a multi-process run."""

    launcher: str
    local_rank: int
    rank: int
    world_size: int
    local_world_size: int | None
    variables: tuple[str, ...]

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
        }


def _int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    text = raw.strip()
    # SLURM_NTASKS_PER_NODE can read "4(x2)": the count is the leading number.
    if name == "SLURM_NTASKS_PER_NODE":
        text = text.split("(", 1)[0]
    try:
        value = int(text)
    except ValueError:
        raise DeviceError(
            f"{name}={raw!r} is not a whole number; the launcher sets it (torchrun, srun, mpirun), "
            f"so unset it if you exported it by hand"
        ) from None
    if value < minimum:
        raise DeviceError(f"{name}={raw!r} must be {minimum} or more; unset it or fix the launch command")
    return value


def detect_distributed(environ: Mapping[str, str] | None = None) -> DistributedContext | None:
    """The context when this process is one of several launched together, else None.

    torchrun and ``accelerate launch`` count as distributed as soon as they set ``LOCAL_RANK``
    (even with one process, because TrainingArguments then sets up a process group). SLURM and MPI
    count only with more than one task, since their variables are present in every batch job.
    """
    env = os.environ if environ is None else environ
    for launcher, local_var, rank_var, world_var, local_world_var in LAUNCHER_VARIABLES:
        local_rank = _int(env, local_var, 0)
        if local_rank is None:
            continue
        world = _int(env, world_var, 1)
        if launcher != "torchrun" and (world is None or world <= 1):
            continue
        rank = _int(env, rank_var, 0)
        local_world = _int(env, local_world_var, 1)
        # What an unset variable defaults to, said as such in the errors below.
        rank_is = f"{rank_var}={rank}" if rank is not None else f"{rank_var} (unset: {local_var}={local_rank})"
        world_is = f"{world_var}={world}" if world is not None else f"{world_var} (unset: 1)"
        partial = rank is None or world is None
        world = world if world is not None else 1
        rank = rank if rank is not None else local_rank
        if local_world is not None and world < local_world:
            raise DeviceError(
                f"{world_is} is smaller than {local_world_var}={local_world}: a run cannot have "
                "fewer processes in total than on one node; check the launch command"
            )
        if local_world is not None and local_rank >= local_world:
            raise DeviceError(
                f"{local_var}={local_rank} is not below {local_world_var}={local_world}; local ranks "
                f"run from 0 to {local_world - 1}"
            )
        if rank >= world:
            fix = (
                f"; a launcher sets all of them, so set {world_var} too or unset {local_var} if you exported it by hand"
                if partial
                else ""
            )
            raise DeviceError(f"{rank_is} is not below {world_is}; ranks run from 0 to {world - 1}{fix}")
        return DistributedContext(
            launcher,
            local_rank,
            rank,
            world,
            local_world,
            (local_var, rank_var, world_var, local_world_var),
        )
    return None


def process_group_backend(backend: Backend, context: DistributedContext | None) -> str | None:
    """The torch.distributed backend for ``backend`` in this launch (None: not distributed).

    The registry's value, except where the installed torch says otherwise: a run started by
    mpirun on a backend whose row also takes "mpi" (the CPU) uses it when this torch was built
    with MPI, and "xccl" (Intel GPUs) needs torch 2.7, before which oneCCL's "ccl" served.
    """
    if context is None or backend.distributed_backend is None:
        return None
    if context.launcher == "mpi" and "mpi" in backend.other_distributed_backends:
        import torch.distributed

        if torch.distributed.is_mpi_available():
            return "mpi"
    if backend.distributed_backend == "xccl":
        from whichdevice.packages import package_version, version_before

        version = package_version("torch")
        if version is not None and version != "simulated" and version_before(version, "2.7"):
            return "ccl"
    return backend.distributed_backend
