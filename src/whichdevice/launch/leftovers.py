"""Launcher variables that no launcher left together: a leftover export, not a run of several processes.

Every launcher sets its variables as a set, in each process it starts: torchrun, accelerate launch,
DeepSpeed's launcher and Ray Train set ``MASTER_ADDR`` and ``MASTER_PORT`` beside the ranks
(torchrun also ``TORCHELASTIC_RUN_ID``); mpirun and mpiexec set a process's rank with the size;
srun starts a step (``SLURM_STEP_ID``, ``SLURM_STEP_NUM_TASKS``), while a batch script runs once,
as one process, with the allocation's ``SLURM_NTASKS``. A part of a set without the rest was
exported by hand or inherited from an earlier shell. When transformers reads it (accelerate's
``PartialState`` reads ``LOCAL_RANK`` everywhere, MPI's sizes on the CPU), TrainingArguments would
start a process group that cannot start: training is refused with the variables to unset.
Otherwise it is ignored, with a warning that says so.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from whichdevice.core.errors import ConfigConflictError
from whichdevice.core.frozen import NamedTuple
from whichdevice.core.numbers import parse_number
from whichdevice.launch.distributed import (
    _LAUNCHED,
    SCHEDULERS,
    TORCH,
    _process_group_started,
    not_distributed_marker_removed,
)

__all__ = ["ENV_VARIABLES", "Leftover", "launch_leftovers", "refuse_accelerate_device", "refuse_leftovers"]

# The sizes accelerate's CPU path reads, in its order (get_cpu_distributed_information).
_CPU_WORLD_SIZES = (TORCH.world_size, *(s.names.world_size for s in SCHEDULERS if s.name != "SLURM"))

_SLURM = next(s for s in SCHEDULERS if s.name == "SLURM")
# srun sets these in each task of a step; the batch script (sbatch) and an salloc shell have none.
_SLURM_STEP = ("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS")
_SLURM_TASKS = "SLURM_NTASKS"  # the allocation's task count, in every process of the job

ENV_VARIABLES = tuple(
    dict.fromkeys(
        [
            *TORCH,
            *_LAUNCHED,
            *_SLURM_STEP,
            _SLURM_TASKS,
            *(v for s in SCHEDULERS for v in s.names),
            "ACCELERATE_TORCH_DEVICE",
        ]
    )
)


class Leftover(NamedTuple):
    """Launcher variables set without the launch they belong to."""

    variables: tuple[str, ...]  # the ones to unset
    message: str  # what they are, what whichdevice does with them, and the fix
    read: bool  # transformers/accelerate read them: TrainingArguments would fail while they are set


def _count(env: Mapping[str, str], name: str) -> int | None:
    # None where malformed: the distributed checks name it.
    return parse_number(name, env.get(name, "").strip().split("(", 1)[0].split(",", 1)[0]).value


def _torch(env: Mapping[str, str]) -> Leftover | None:
    if env.get(TORCH.local_rank) is None or any(env.get(v) is not None for v in _LAUNCHED):
        return None
    world = _count(env, TORCH.world_size)
    if (world is not None and world > 1) or _started_by_scheduler(env) or _process_group_started():
        return None  # several processes: what is missing for them is check_training_launch's to say
    stray = tuple(v for v in TORCH if env.get(v) is not None)
    shown = " ".join(f"{v}={env[v][:20]}" for v in stray) + (" is" if len(stray) == 1 else " are")
    return Leftover(
        stray,
        f"{shown} set, but none of what a launcher sets with it ({', '.join(_LAUNCHED)}) and no second "
        f"process: it is left over from an earlier export or shell. transformers would take this process "
        f"for one rank of a distributed run and fail to start its process group. Run `unset {' '.join(stray)}` "
        "to train in one process, or start the script with torchrun or accelerate launch, which set them all",
        True,
    )


def _at_least_zero(value: int | None) -> bool:
    return value is not None and value >= 0


def _started_by_scheduler(env: Mapping[str, str]) -> bool:
    for scheduler in SCHEDULERS:
        size = _count(env, scheduler.names.world_size)
        if scheduler is _SLURM and size is None and env.get("SLURM_STEP_ID") is not None:
            size = _count(env, _SLURM_TASKS)
        if env.get(scheduler.names.rank) is not None and size is not None and size > 1:
            return True
    return False


def _mpi(env: Mapping[str, str], cpu: bool) -> list[Leftover]:
    out = []
    for scheduler in SCHEDULERS:
        names = scheduler.names
        size = _count(env, names.world_size)
        if scheduler is _SLURM or size is None or size <= 1 or env.get(names.rank) is not None:
            continue
        # accelerate's CPU path takes the process count from the first of WORLD_SIZE, PMI_SIZE,
        # OMPI_COMM_WORLD_SIZE, MV2_COMM_WORLD_SIZE set to 0 or more (get_int_from_env in
        # get_cpu_distributed_information, accelerate 1.16 utils/environment.py): a size behind one
        # that is set (torchrun's WORLD_SIZE) is never read. Nothing but that CPU path reads MPI's sizes.
        first = next((n for n in _CPU_WORLD_SIZES if _at_least_zero(_count(env, n))), None)
        read = cpu and first == names.world_size
        if read:
            effect = "accelerate would count the processes from it and fail to start a process group"
        elif cpu and first is not None:
            effect = f"accelerate counts the processes from {first}={env[first]} and never reads it"
        else:
            effect = "transformers does not read it, so this process runs alone"
        out.append(
            Leftover(
                (names.world_size,),
                f"{names.world_size}={env[names.world_size]} is set but {names.rank} is not: {scheduler.start} "
                f"sets both in every process it starts, so it is left over; {effect}. Run `unset "
                f"{names.world_size}`, or start the processes with {scheduler.start}",
                read,
            )
        )
    return out


def _slurm_batch(env: Mapping[str, str]) -> Leftover | None:
    tasks = _count(env, _SLURM_TASKS)
    if tasks is None or tasks <= 1 or any(env.get(v) is not None for v in _SLURM_STEP):
        return None
    return Leftover(
        (_SLURM_TASKS,),
        f"{_SLURM_TASKS}={tasks} is the job's allocation, but this process was not started by srun "
        f"({_SLURM_STEP[0]} is unset): it is the batch script's one process, and runs alone. To use the "
        f"{tasks} tasks, start it with `srun python train.py` (one process per task; see docs/distributed.md "
        "for the exports) or `srun --ntasks-per-node=1 torchrun --nproc-per-node=<per node> train.py`",
        False,
    )


def launch_leftovers(environ: Mapping[str, str] | None = None, *, cpu: bool = False) -> tuple[Leftover, ...]:
    """Launcher variables in ``environ`` (default ``os.environ``) that no launcher left together.

    ``cpu``: the process trains on the CPU, where accelerate also reads MPI's sizes.
    """
    env = not_distributed_marker_removed(os.environ if environ is None else environ)
    found = [_torch(env), *_mpi(env, cpu), _slurm_batch(env)]
    return tuple(f for f in found if f is not None)


def refuse_leftovers(leftovers: tuple[Leftover, ...]) -> None:
    """Raise ConfigConflictError, naming the variables to unset, for leftovers transformers would read."""
    read = [f for f in leftovers if f.read]
    if read:
        raise ConfigConflictError("; ".join(f.message for f in read))


def refuse_accelerate_device(chosen: str, environ: Mapping[str, str] | None = None) -> None:
    """Refuse ``ACCELERATE_TORCH_DEVICE`` naming another kind of device than ``chosen`` (a backend name).

    accelerate's PartialState takes it as its device whenever it is set, use_cpu or not (accelerate
    1.16 state.py, ``torch.device(env_device)``), so the Trainer would move the model there: left over
    from a Ray Train worker or an export, it fails at the Trainer's first step.
    """
    env = os.environ if environ is None else environ
    given = env.get("ACCELERATE_TORCH_DEVICE")
    if given is None or given.partition(":")[0].strip() == chosen:
        return
    from whichdevice.hardware import probing
    from whichdevice.hardware.registry import backends

    kind = given.partition(":")[0].strip()
    known = any(b.name == kind for b in backends())
    missing = not known or not probing.probe(kind).available
    where = " (which this machine does not have)" if missing else ""
    instead = "" if missing else f", or pass device={kind!r} to train there"
    raise ConfigConflictError(
        f"ACCELERATE_TORCH_DEVICE={given[:20]!r} is set: accelerate trains on that device{where} whatever "
        f"TrainingArguments says, but this run is on {chosen}. Run `unset ACCELERATE_TORCH_DEVICE`{instead}"
    )
