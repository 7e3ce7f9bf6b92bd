"""Whether this process is one rank of a run that transformers will see, who launched it, and what is missing.

One rule, accelerate's own (``PartialState``, accelerate 1.16 state.py and utils/environment.py): a
run is distributed for transformers when ``LOCAL_RANK`` is set or, training on the CPU
(``use_cpu=True``), when ``WORLD_SIZE`` or an MPI library's size variable counts more than one
process. Its process group starts from torch's ``env://`` variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) unless one is already initialised (Ray Train starts its own).
Scheduler variables (a SLURM step, Open MPI, PMI, MVAPICH) that count several processes are
evidence of intent, not a launch: when transformers would not see the run, or its process group
could not start, training is refused with the exports to add.

Variables no launcher left together are leftovers, not a launch (``launch_leftovers``): a
``LOCAL_RANK`` without ``MASTER_ADDR``/``MASTER_PORT``/``TORCHELASTIC_RUN_ID`` and without a second
process (every torch launcher sets those), an MPI size without its rank (mpirun sets both), a
SLURM task count without a step (srun sets ``SLURM_STEP_ID``; the batch script is one process).
Training is refused, before TrainingArguments is built, when transformers would read them;
otherwise they are ignored with a warning in the trace.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from whichdevice.core import envview
from whichdevice.core.errors import DeviceError, shown
from whichdevice.core.frozen import NamedTuple
from whichdevice.core.numbers import parse_number

if TYPE_CHECKING:
    from whichdevice.core.records import Backend
    from whichdevice.launch.context import DistributedContext

__all__ = [
    "ENV_VARIABLES",
    "SCHEDULERS",
    "DistributedContext",
    "detect_distributed",
    "not_distributed_marker_removed",
    "process_group_backend",
]


def __getattr__(name: str) -> Any:
    # The record lives in launch/context.py, built only for a launched process; named here as before.
    if name == "DistributedContext":
        from whichdevice.launch.context import DistributedContext

        return DistributedContext
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Names(NamedTuple):
    """Where one launcher keeps local rank, rank, world size and processes per node."""

    local_rank: str
    rank: str
    world_size: str
    local_world_size: str


class Scheduler(NamedTuple):
    """A job scheduler or MPI library whose variables count the processes it started."""

    name: str  # as the trace says it
    start: str  # the command that starts one process per task, for the exports example
    names: _Names


TORCH = _Names("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
# SLURM's step variables (srun sets them; a batch script or salloc shell is one process in an
# allocation). accelerate reads the three MPI ones on the CPU only, after torch's and in this order
# (accelerate 1.16 utils/environment.py, get_cpu_distributed_information); SLURM's never.
SCHEDULERS = (
    Scheduler(
        "SLURM", "srun", _Names("SLURM_LOCALID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE")
    ),
    Scheduler("MPI (PMI)", "mpiexec", _Names("MPI_LOCALRANKID", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS")),
    Scheduler(
        "Open MPI",
        "mpirun",
        _Names(
            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"
        ),
    ),
    Scheduler(
        "MVAPICH",
        "mpirun",
        _Names("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ),
)
_ACCELERATE_CPU = (TORCH, *(s.names for s in SCHEDULERS if s.name != "SLURM"))
# accelerate's CPU path asks "more than one process?" of these, the first one set (state.py).
_ACCELERATE_CPU_SIZES = (*(n.world_size for n in _ACCELERATE_CPU[1:]), TORCH.world_size)
# Who exported torch's variables: each launcher sets its marker variables in every worker.
_MARKERS = (
    ("Ray Train", ("NODE_RANK", "ACCELERATE_TORCH_DEVICE")),  # ray/train/torch/config.py
    ("accelerate launch", ("TORCHELASTIC_RUN_ID", "ACCELERATE_DYNAMO_BACKEND")),  # accelerate/utils/launch.py
    ("torchrun", ("TORCHELASTIC_RUN_ID",)),  # torch/distributed/elastic/agent/server
    ("DeepSpeed launcher", ("CROSS_RANK", "LOCAL_SIZE")),  # deepspeed/launcher/launch.py
)
_OTHER = ("MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID", "SLURM_NTASKS")
# What every torch launcher (torchrun, accelerate launch, DeepSpeed's, Ray Train) sets in each worker
# beside the ranks: without any of them, and without a second process, the ranks are left over.
_LAUNCHED = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
_BY_HAND = "torch's variables, set by hand"
# The variables this module reads (the memo key holds them; see whichdevice.resolve.memo).
ENV_VARIABLES = tuple(
    dict.fromkeys([*TORCH, *_OTHER, *(v for s in SCHEDULERS for v in s.names), *(v for _, m in _MARKERS for v in m)])
)


def _int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    # SLURM's tasks per node can read "4(x2)" or "4,2": the count on the first node leads.
    text = raw.strip().split("(", 1)[0].split(",", 1)[0] if name.startswith("SLURM_") else raw.strip()
    # ASCII digits only (parse_number): int() would take "١" or "1_0", and raise past 4,300 digits.
    number = parse_number(name, text)
    negative = text.startswith("-") and parse_number(name, text[1:]).value is not None
    if number.value is None and not negative:
        raise DeviceError(
            f"{number.problem}; the launcher sets it (torchrun, srun, mpirun), so unset it if you exported it by hand"
        )
    if number.value is None or number.value < minimum:
        raise DeviceError(f"{name}={shown(raw)} must be {minimum} or more; unset it or fix the launch command")
    return number.value


def _first(env: Mapping[str, str], names: tuple[str, ...], minimum: int) -> tuple[int | None, str]:
    """The first of ``names`` that is set, and its name (the first name when none is)."""
    for name in names:
        value = _int(env, name, minimum)
        if value is not None:
            return value, name
    return None, names[0]


def _scheduler(env: Mapping[str, str]) -> tuple[Scheduler, int, str] | None:
    """The scheduler whose variables count more than one process here: it, the count, the count's variable."""
    for scheduler in SCHEDULERS:
        if env.get(scheduler.names.rank) is None:
            continue  # its launcher sets the rank in every process: a size alone is left over
        size_var = scheduler.names.world_size
        size = _int(env, size_var, 1)
        if size is None and scheduler.name == "SLURM" and env.get("SLURM_STEP_ID") is not None:
            size_var = "SLURM_NTASKS"  # a step whose srun did not say its own count
            size = _int(env, size_var, 1)
        if size is not None and size > 1:
            return scheduler, size, size_var
    return None


def _launcher(env: Mapping[str, str], scheduler: Scheduler | None) -> str:
    for name, marker in _MARKERS:
        if all(env.get(v) is not None for v in marker):
            return name if scheduler is None else f"{name} in a {scheduler.name} job"
    if scheduler is None:
        return _BY_HAND
    by_hand = env.get(TORCH.local_rank) is not None or env.get(TORCH.world_size) is not None
    return f"{scheduler.name} ({scheduler.start})" + (", torch's variables set by hand" if by_hand else "")


def _process_group_started() -> bool:
    # Never imports torch: whoever started a group has imported torch.distributed.
    module = sys.modules.get("torch.distributed")
    return bool(module is not None and module.is_available() and module.is_initialized())


# (value, the variable it came from) for local rank, rank, world size, processes per node
_Read = list[tuple[int | None, str]]


def not_distributed_marker_removed(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` without a ``LOCAL_RANK`` of -1: accelerate and transformers read -1 as "not distributed"
    (``int(os.environ.get("LOCAL_RANK", -1)) != -1``, accelerate 1.16 state.py; TrainingArguments'
    own ``local_rank`` defaults to -1), so scripts and launchers that export it mean a single process."""
    if env.get(TORCH.local_rank, "").strip() != "-1":
        return env
    return {k: v for k, v in env.items() if k != TORCH.local_rank}


def detect_distributed(environ: Mapping[str, str] | None = None, *, cpu: bool = False) -> DistributedContext | None:
    """The run this process belongs to, or None for a single process.

    ``cpu``: the process trains on the CPU (``use_cpu=True``), where accelerate also reads MPI's
    variables. The numbers are the ones accelerate will use. Variables that say "several processes"
    but that accelerate does not read give a context with ``seen=False`` (see ``check_training_launch``).
    """
    env = not_distributed_marker_removed(envview.environ() if environ is None else environ)
    _check_slurm(env)
    found = _scheduler(env)
    scheduler = found[0] if found is not None else None
    # accelerate's rule: LOCAL_RANK on every device; on the CPU also MPI's variables, after torch's.
    sources = _ACCELERATE_CPU if cpu else (TORCH,)
    read: _Read = [_first(env, tuple(n[i] for n in sources), 1 if i >= 2 else 0) for i in range(4)]
    if read[3][0] is None and env.get("LOCAL_SIZE") is not None:
        read[3] = (_int(env, "LOCAL_SIZE", 1), "LOCAL_SIZE")  # DeepSpeed's launcher
    seen = env.get(TORCH.local_rank) is not None or (cpu and (_first(env, _ACCELERATE_CPU_SIZES, 1)[0] or 1) > 1)
    if not seen:
        if found is None and (read[2][0] or 1) <= 1:
            return None
        # Not a run for accelerate: the scheduler's numbers (for the device and the message), or
        # the first device, which is what accelerate uses without a process group.
        fill: _Read = (
            [(_int(env, found[0].names[i], 0), found[0].names[i]) for i in range(2)]
            + [(found[1], found[2]), (_int(env, found[0].names[3], 1), found[0].names[3])]
            if found is not None
            else [(0, TORCH.local_rank), *read[1:]]
        )
        read = [mine if mine[0] is not None else theirs for mine, theirs in zip(read, fill, strict=True)]
    (local_rank, _), (rank, _), (world, _), (local_world, _) = read
    variables = tuple(name for _, name in read)
    from whichdevice.launch.context import DistributedContext  # built only for a launched process

    context = DistributedContext(
        _launcher(env, scheduler),
        local_rank or 0,
        rank if rank is not None else (local_rank or 0),
        world or 1,
        local_world,
        variables,
        seen,
        _missing(env, variables, scheduler, seen, cpu),
        scheduler.name if scheduler is not None else None,
        env.get("ACCELERATE_TORCH_DEVICE"),
    )
    _check_consistent(context, env, rank is None or world is None)
    return context


def _missing(
    env: Mapping[str, str], variables: tuple[str, ...], scheduler: Scheduler | None, seen: bool, cpu: bool
) -> tuple[str, ...]:
    """The exports (``NAME=value``) without which no process group starts, from the scheduler's own values."""
    if _process_group_started():
        return ()
    if not seen:
        needed: tuple[str, ...] = TORCH[:3]
    elif cpu:
        # accelerate's CPU path reads MPI's ranks itself; torch's RANK only matters without them.
        from_mpi = any(env.get(n.rank) is not None for n in _ACCELERATE_CPU[1:])
        several = (_first(env, _ACCELERATE_CPU_SIZES, 1)[0] or 1) > 1
        needed = (TORCH.rank,) if several and not from_mpi else ()
    else:
        needed = (TORCH.rank, TORCH.world_size)
    out = [
        f"{name}=${source}" if source != name else f"{name}=<{field.replace('_', ' ')}>"
        for field, name, source in zip(TORCH._fields, TORCH, variables, strict=True)
        if name in needed and env.get(name) is None
    ]
    if env.get("MASTER_ADDR") is None and not (cpu and seen and _mpi_backend(env)):
        slurm = scheduler is not None and scheduler.name == "SLURM"
        out.append(
            "MASTER_ADDR="
            + ('$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' if slurm else "<host name of rank 0>")
        )
    if env.get("MASTER_PORT") is None and not (cpu and seen):
        out.append("MASTER_PORT=29500")  # accelerate's CPU path defaults it to 29500; env:// does not
    return tuple(out)


def _mpi_backend(env: Mapping[str, str]) -> bool:
    """Whether accelerate's CPU path will use torch's "mpi" backend, which needs no rendezvous address."""
    if not any(env.get(n.rank) is not None for n in _ACCELERATE_CPU[1:]):
        return False
    import torch.distributed

    return bool(torch.distributed.is_mpi_available())


def _check_slurm(env: Mapping[str, str]) -> None:
    """SLURM's own numbers agree with each other (SLURM never writes a task count of 0, nor a task
    number past the count), whether or not they count several processes here."""
    counts = [(name, _int(env, name, 1)) for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")]
    count_var, count = next(((n, c) for n, c in counts if c is not None), ("SLURM_NTASKS", None))
    rank = _int(env, "SLURM_PROCID", 0)
    if count is not None and rank is not None and rank >= count:
        raise DeviceError(
            f"SLURM_PROCID={rank} is not below {count_var}={count}: SLURM numbers its tasks from 0 to {count - 1}, "
            "so these did not come from one SLURM job; unset the SLURM_ variables exported by hand or left over "
            "from another job (`env | grep ^SLURM_`), or start the program with srun inside the job"
        )


def _check_consistent(ctx: DistributedContext, env: Mapping[str, str], partial: bool) -> None:
    local_var, rank_var, world_var, local_world_var = ctx.variables
    rank_is = f"{rank_var}={ctx.rank}" if env.get(rank_var) is not None else f"{rank_var} (unset: {ctx.rank})"
    world_is = f"{world_var}={ctx.world_size}" if env.get(world_var) is not None else f"{world_var} (unset: 1)"
    lws = ctx.local_world_size
    if lws is not None and ctx.world_size < lws:
        raise DeviceError(
            f"{world_is} is smaller than {local_world_var}={lws}: a run cannot have "
            "fewer processes in total than on one node; check the launch command"
        )
    if lws is not None and ctx.local_rank >= lws:
        raise DeviceError(
            f"{local_var}={ctx.local_rank} is not below {local_world_var}={lws}; local ranks run from 0 to {lws - 1}"
        )
    port = env.get("MASTER_PORT")
    if port is not None and parse_number("MASTER_PORT", port, minimum=1, maximum=65535).value is None:
        # torch's env:// rendezvous does int(MASTER_PORT) and fails with a bare ValueError.
        raise DeviceError(
            f"MASTER_PORT={port[:20]!r} is not a TCP port (a whole number from 1 to 65535); torch's rendezvous "
            "would fail with int()'s error. Set it to a free port (MASTER_PORT=29500), or unset it and let "
            "torchrun or accelerate launch set it"
        )
    if ctx.rank >= ctx.world_size:
        fix = (
            f"; a launcher sets all of them, so set {world_var} too or unset {local_var} if you exported it by hand"
            if partial
            else ""
        )
        raise DeviceError(f"{rank_is} is not below {world_is}; ranks run from 0 to {ctx.world_size - 1}{fix}")


def process_group_backend(backend: Backend, context: DistributedContext | None) -> str | None:
    """The torch.distributed backend for ``backend`` in this launch (None: not a run transformers sees).

    The registry's value, except where the installed torch says otherwise: ranks read from an MPI
    library's variables on a backend whose row also takes "mpi" (the CPU) use it when this torch was
    built with MPI, and "xccl" (Intel GPUs) needs torch 2.7, before which oneCCL's "ccl" served.
    """
    if context is None or not context.seen or backend.distributed_backend is None:
        return None
    # Started by an MPI library (not by torchrun inside an MPI job).
    from_mpi = context.scheduler not in (None, "SLURM") and context.launcher.startswith(str(context.scheduler))
    if from_mpi and "mpi" in backend.other_distributed_backends:
        import torch.distributed

        if torch.distributed.is_mpi_available():
            return "mpi"
    if backend.distributed_backend == "xccl":
        from whichdevice.core.packages import package_version, version_before

        version = package_version("torch")
        if version is not None and version != "simulated" and version_before(version, "2.7"):
            return "ccl"
    return backend.distributed_backend
