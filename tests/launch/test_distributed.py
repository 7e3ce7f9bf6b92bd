"""Distributed context detection, and real torchrun processes resolving and training over gloo."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

import whichdevice as wd
from launches import Command
from launches import launch_together as _launch_together
from tiny_models import tiny_config
from whichdevice import DeviceError
from whichdevice.launch.checks import check_training_launch
from whichdevice.launch.distributed import ENV_VARIABLES, detect_distributed
from whichdevice.testing import simulate

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ddp_train.py"


TORCHRUN = {"LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}
GROUP = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
# What srun sets in task 1 of a two-task step (no RANK/WORLD_SIZE/LOCAL_RANK).
SRUN = {
    "SLURM_JOB_ID": "42",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "node01",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


@pytest.mark.parametrize(
    ("env", "cpu", "expected"),
    [
        ({}, False, None),
        ({"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, False, None),  # a plain batch job
        # python train.py in a batch script of a 2-task allocation: one process, as for transformers.
        ({"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "42"}, True, None),
        ({**TORCHRUN, **GROUP}, False, ("torchrun", 1, 3, 4, True)),
        ({**TORCHRUN, **GROUP, "ACCELERATE_DYNAMO_BACKEND": "NO"}, False, ("accelerate launch", 1, 3, 4, True)),
        (
            {**TORCHRUN, **GROUP, "NODE_RANK": "1", "ACCELERATE_TORCH_DEVICE": "cpu"},
            True,
            ("Ray Train", 1, 3, 4, True),
        ),
        (
            {"LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_SIZE": "2", "CROSS_RANK": "1", **GROUP},
            False,
            ("DeepSpeed launcher", 1, 3, 4, True),
        ),
        ({**TORCHRUN, **GROUP, **SRUN}, False, ("torchrun in a SLURM job", 1, 3, 4, True)),
        ({**SRUN, **GROUP}, False, ("SLURM (srun)", 1, 1, 2, False)),
        ({**SRUN, **GROUP}, True, ("SLURM (srun)", 1, 1, 2, False)),
        # RANK and WORLD_SIZE by hand but no LOCAL_RANK: accelerate's CPU path runs, with local rank 0.
        (
            {**SRUN, **GROUP, "RANK": "1", "WORLD_SIZE": "2"},
            True,
            ("SLURM (srun), torch's variables set by hand", 0, 1, 2, True),
        ),
        (
            {**SRUN, **GROUP, "RANK": "1", "WORLD_SIZE": "2"},
            False,
            ("SLURM (srun), torch's variables set by hand", 1, 1, 2, False),
        ),
        ({**OMPI, **GROUP}, True, ("Open MPI (mpirun)", 1, 1, 2, True)),
        ({**OMPI, **GROUP}, False, ("Open MPI (mpirun)", 1, 1, 2, False)),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", **GROUP},
            True,
            ("MPI (PMI) (mpiexec)", 1, 1, 2, True),
        ),
    ],
)
def test_detect_distributed(env, cpu, expected):
    ctx = detect_distributed(env, cpu=cpu)
    if expected is None:
        assert ctx is None
    else:
        assert (ctx.launcher, ctx.local_rank, ctx.rank, ctx.world_size, ctx.seen) == expected


@pytest.mark.parametrize(
    "env",
    [
        {**OMPI},
        {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
        {**OMPI, "RANK": "1", "WORLD_SIZE": "2"},
        {**SRUN, "RANK": "1", "WORLD_SIZE": "2"},
        {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1"},
    ],
)
def test_cpu_ranks_are_the_ones_accelerate_reads(monkeypatch, env):
    """accelerate's own reading of the CPU launch variables is whichdevice's (drift is caught here)."""
    from accelerate.utils.environment import get_cpu_distributed_information

    for name in (*ENV_VARIABLES, "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    theirs = get_cpu_distributed_information()
    ctx = detect_distributed(env, cpu=True)
    assert ctx is not None and ctx.seen
    assert (ctx.rank, ctx.world_size, ctx.local_rank) == (theirs.rank, theirs.world_size, theirs.local_rank)


def test_scheduler_without_torch_variables_names_the_exports():
    ctx = detect_distributed(SRUN)
    assert ctx is not None and not ctx.seen
    assert ctx.missing[:3] == ("LOCAL_RANK=$SLURM_LOCALID", "RANK=$SLURM_PROCID", "WORLD_SIZE=$SLURM_STEP_NUM_TASKS")
    assert ctx.missing[3].startswith("MASTER_ADDR=$(scontrol show hostnames")
    with pytest.raises(DeviceError) as err:
        check_training_launch(ctx)
    text = str(err.value)
    assert "SLURM (srun) started 2 processes" in text and "each process would train alone" in text
    assert "srun bash -c 'export LOCAL_RANK=$SLURM_LOCALID RANK=$SLURM_PROCID" in text and "torchrun" in text


@pytest.mark.parametrize(
    ("env", "cpu", "missing"),
    [
        ({**OMPI}, True, ("MASTER_ADDR=<host name of rank 0>",)),  # accelerate defaults MASTER_PORT on the CPU
        (
            {"LOCAL_RANK": "0", "WORLD_SIZE": "2"},
            False,
            ("RANK=<rank>", "MASTER_ADDR=<host name of rank 0>", "MASTER_PORT=29500"),
        ),
        ({"LOCAL_RANK": "0", "WORLD_SIZE": "2", **GROUP}, True, ("RANK=<rank>",)),
        ({**TORCHRUN, **GROUP}, False, ()),
    ],
)
def test_process_group_needs(env, cpu, missing):
    ctx = detect_distributed(env, cpu=cpu)
    assert ctx is not None and ctx.seen and ctx.missing == missing
    if missing:
        with pytest.raises(DeviceError, match="cannot start without") as err:
            check_training_launch(ctx)
        assert f"export {' '.join(missing)}" in str(err.value)
    else:
        check_training_launch(ctx)


def test_an_initialised_process_group_needs_no_variables(tmp_path):
    """Ray Train (or a script) started the group: nothing is missing, whatever MASTER_* say."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ctx = detect_distributed({"LOCAL_RANK": "0"}, cpu=True)
    finally:
        dist.destroy_process_group()
    assert ctx is not None and ctx.seen and ctx.missing == ()


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' is not a whole number"),
        ({"LOCAL_RANK": "-2"}, "must be 0 or more"),
        # int() takes these; no launcher writes them (issue 57): ASCII digits only, at most 7.
        ({"LOCAL_RANK": "١"}, "LOCAL_RANK='١' is not a whole number written in the digits 0-9"),
        ({"LOCAL_RANK": "0", "WORLD_SIZE": "1_0"}, "WORLD_SIZE='1_0' is not a whole number"),
        ({"LOCAL_RANK": "0", "WORLD_SIZE": "9" * 5000}, "WORLD_SIZE='9999.*has 5000 digits"),
        ({"LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "smaller than LOCAL_WORLD_SIZE"),
        ({"LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "not below LOCAL_WORLD_SIZE=2"),
        ({"LOCAL_RANK": "0", "RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
        ({**SRUN, "SLURM_PROCID": "2"}, "SLURM_PROCID=2 is not below SLURM_STEP_NUM_TASKS=2"),
    ],
)
def test_bad_distributed_environment(env, match):
    with pytest.raises(DeviceError, match=match):
        detect_distributed(env)


# ------------------------------------------------------------------ through resolve_device


@pytest.fixture
def launch_env(monkeypatch):
    for name in ENV_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_env(env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_env


def test_srun_step_training_is_refused_with_the_exports(launch_env):
    launch_env({**SRUN, **GROUP})
    for spec in ("cuda:2", "cpu"):
        with simulate(spec), pytest.raises(DeviceError, match=r"export LOCAL_RANK=\$SLURM_LOCALID"):
            wd.resolve_device(task="training")


def test_srun_step_inference_keeps_a_device_per_task(launch_env):
    launch_env({**SRUN, **GROUP})
    with simulate("cuda:2"):
        res = wd.resolve_device()
    assert res.device == "cuda:1" and "ddp_backend" not in res.training_kwargs()
    assert "do not see this run" in res.explain()


def test_slurm_without_local_rank(launch_env):
    """RANK and WORLD_SIZE by hand, LOCAL_RANK forgotten: fine on the CPU, refused on a GPU."""
    launch_env({**SRUN, **GROUP, "RANK": "1", "WORLD_SIZE": "2"})
    with simulate("cuda:2"), pytest.raises(DeviceError, match=r"export LOCAL_RANK=\$SLURM_LOCALID;"):
        wd.resolve_device(task="training")
    with simulate("cpu"):
        res = wd.resolve_device(task="training")
    assert res.distributed.local_rank == 0  # what accelerate uses: it reads no SLURM variable
    assert res.training_kwargs()["ddp_backend"] == "gloo"


def test_world_size_without_local_rank_on_a_gpu(launch_env):
    launch_env({"RANK": "1", "WORLD_SIZE": "2", **GROUP})
    with simulate("cuda:2"), pytest.raises(DeviceError, match=r"WORLD_SIZE=2 says 2 processes, but LOCAL_RANK"):
        wd.resolve_device(task="training")


def test_mpirun_without_master_addr_is_refused(launch_env):
    launch_env(OMPI)
    with simulate("cpu"), pytest.raises(DeviceError, match=r"export MASTER_ADDR=<host name of rank 0>"):
        wd.resolve_device(task="training")


@pytest.mark.parametrize("name", ["hpu", "neuron"])
def test_gaudi_and_trainium_ranks_use_their_current_device(launch_env, name):
    """accelerate uses torch.device("hpu", current_device()) per rank; no rank splits a model over the node."""
    launch_env({**TORCHRUN, **GROUP})
    big = tiny_config(num_hidden_layers=20, hidden_size=4096, intermediate_size=16384, vocab_size=32000)
    with simulate(f"{name}:8,mem=6GiB"):
        res = wd.resolve_device(task="training", model=tiny_config())
        # About 9.5 GiB in bf16: device_map="auto" over the node for one process, refused for a rank.
        with pytest.raises(wd.DoesNotFitError, match=f"do not fit {name} "):
            wd.resolve_device(model=big, quantize=None)
    assert res.device == name and res.device_map == name
    assert f"torch.device('{name}', current_device())" in res.explain()


def test_accelerate_torch_device_is_followed(launch_env):
    launch_env({**TORCHRUN, **GROUP, "NODE_RANK": "0", "ACCELERATE_TORCH_DEVICE": "cuda:0"})
    with simulate("cuda:2"):
        res = wd.resolve_device(task="training")
    assert res.device == "cuda:0" and "Ray Train" in res.explain()


# ------------------------------------------------------------------ the launch matrix
# Each row starts two CPU processes (one for the allocation row) that run scripts/ddp_train.py:
# resolve, training_arguments(), 3 Trainer steps, and a report per rank.


def _script(out: Path) -> list[str]:
    return [sys.executable, str(SCRIPT), str(out)]


def _torchrun(out: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *options, str(SCRIPT), str(out)]


def _reports(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def _trained_together(out: Path, launcher: str, n: int = 2) -> list[dict]:
    """The per-rank checks of a run that trained across ranks."""
    reports = _reports(out, n)
    for r in reports:
        assert "error" not in r, r.get("message")
        assert r["launcher"] == launcher
        assert r["device"] == "cpu" and r["backend"] == "cpu"
        assert r["ddp_backend"] == r["args_ddp_backend"] == r["process_group"] == "gloo"
        assert r["world_size"] == r["args_world_size"] == r["pg_world_size"] == n
        # accelerate names the CPU "cpu:0" in a process group (Ray Train's ACCELERATE_TORCH_DEVICE
        # keeps "cpu"): the same device, compared by type as docs/distributed.md says.
        assert r["args_device"] in ("cpu", "cpu:0") and r["ddp_wrapped"] and r["steps"] == 3
    assert sorted(r["rank"] for r in reports) == list(range(n))
    # DistributedSampler gave each rank its own half of the 16 samples...
    shards = [set(r["shard"]) for r in reports]
    assert not set.intersection(*shards) and len(set.union(*shards)) == 16
    # ...and DDP kept the replicas in step.
    assert len({round(r["checksum"], 6) for r in reports}) == 1
    return reports


@pytest.mark.slow
def test_torchrun_static(tmp_path):
    def commands(port: int) -> list[Command]:
        return [_torchrun(tmp_path, "--nproc-per-node=2", "--nnodes=1", f"--master-port={port}")]

    _launch_together(tmp_path, commands)
    reports = _trained_together(tmp_path, "torchrun")
    assert sorted(r["local_rank"] for r in reports) == [0, 1]


@pytest.mark.slow
def test_torchrun_elastic_two_nodes(tmp_path):
    """Two torchrun agents (two "nodes" on this machine) meeting at a c10d rendezvous."""

    def commands(port: int) -> list[Command]:
        elastic = ("--nproc-per-node=1", "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-id=wd", "--max-restarts=0")
        return [
            _torchrun(tmp_path, *elastic, f"--rdzv-endpoint=127.0.0.1:{port}", f"--local-addr={host}")
            for host in ("127.0.0.1", "localhost")
        ]

    _launch_together(tmp_path, commands)
    reports = _trained_together(tmp_path, "torchrun")
    # One process per node: each is local rank 0 on its node, ranks 0 and 1 overall.
    assert [r["local_rank"] for r in reports] == [0, 0]


@pytest.mark.slow
def test_accelerate_launch(tmp_path):
    """accelerate launch --multi_gpu: its torchrun path, which also runs on CPU processes."""

    def commands(port: int) -> list[Command]:
        options = ["--multi_gpu", "--num_processes=2", "--num_machines=1", f"--main_process_port={port}"]
        options += ["--mixed_precision=no", "--dynamo_backend=no"]
        launch = [sys.executable, "-m", "accelerate.commands.launch", *options, str(SCRIPT), str(tmp_path)]
        # No accelerate config file of the user's: HF_HOME points at an empty folder.
        return [(launch, {"HF_HOME": str(tmp_path / "hf")})]

    _launch_together(tmp_path, commands)
    _trained_together(tmp_path, "accelerate launch")


def _srun_task(rank: int, port: int, torch_variables: bool) -> dict[str, str]:
    """What srun sets in task ``rank`` of a 2-task step; MASTER_* as a job script exports them."""
    env = {**SRUN, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(port)
    if torch_variables:
        # The exports whichdevice's refusal names.
        env.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")
    return env


@pytest.mark.slow
def test_srun_step_with_torch_variables(tmp_path):
    _launch_together(tmp_path, lambda port: [(_script(tmp_path), _srun_task(r, port, True)) for r in (0, 1)])
    _trained_together(tmp_path, "SLURM (srun), torch's variables set by hand")


@pytest.mark.slow
def test_srun_step_without_torch_variables(tmp_path):
    _launch_together(tmp_path, lambda port: [(_script(tmp_path), _srun_task(r, port, False)) for r in (0, 1)])
    for r in _reports(tmp_path, 2):
        assert r["error"] == "DeviceError"
        assert "SLURM (srun) started 2 processes" in r["message"]
        assert "export LOCAL_RANK=$SLURM_LOCALID RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_STEP_NUM_TASKS" in r["message"]


@pytest.mark.slow
def test_one_process_in_a_two_task_allocation(tmp_path):
    """python train.py in the batch script of `sbatch --ntasks=2`: one process, as plain TrainingArguments."""
    allocation = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    _launch_together(tmp_path, lambda port: [(_script(tmp_path), allocation)])
    (r,) = _reports(tmp_path, 1)
    assert "error" not in r, r.get("message")
    assert r["launcher"] is None and r["ddp_backend"] is None and r["process_group"] is None
    assert r["args_world_size"] == 1 and not r["ddp_wrapped"] and len(r["shard"]) == 16 and r["steps"] == 3


@pytest.mark.slow
def test_open_mpi_variables(tmp_path):
    """What mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT sets: accelerate's CPU path reads it."""

    def commands(port: int) -> list[Command]:
        group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        ranks = [{k: v.replace("1", str(r)) if "RANK" in k else v for k, v in OMPI.items()} for r in (0, 1)]
        return [(_script(tmp_path), {**ranks[r], **group}) for r in (0, 1)]

    _launch_together(tmp_path, commands)
    _trained_together(tmp_path, "Open MPI (mpirun)")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("WHICHDEVICE_TEST_RAY") != "1", reason="Ray Train is large: it runs in `nox -s tests-ray`"
)
def test_ray_train(tmp_path):
    if importlib.util.find_spec("ray") is None:  # importing ray here would change os.environ
        pytest.skip("ray[train] is not installed")
    command = [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "ray_train.py"), str(tmp_path)]
    _launch_together(tmp_path, lambda port: [command], timeout=400)
    reports = _trained_together(tmp_path, "Ray Train")
    assert {r["args_device"] for r in reports} == {"cpu"}  # Ray's ACCELERATE_TORCH_DEVICE


# --------------------------------------------------------------- leftovers (issue 16, class 9)


@pytest.mark.parametrize(
    "env",
    [
        {"OMPI_COMM_WORLD_SIZE": "4"},
        {"PMI_SIZE": "4"},
        {"MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0"},
        {"SLURM_STEP_NUM_TASKS": "4"},
        {"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"},
    ],
    ids=str,
)
def test_a_scheduler_count_without_its_rank_is_not_a_run(env):
    # Every scheduler sets the rank in each process it starts: a count alone is a leftover.
    assert detect_distributed(env) is None


def test_torch_variables_by_hand_name_both_fixes(monkeypatch):
    env = {"LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DeviceError) as err:
        check_training_launch(detect_distributed())
    text = str(err.value)
    assert "export RANK=<rank>" in text and "`unset LOCAL_RANK WORLD_SIZE`" in text


@pytest.mark.parametrize("port", ["abc", "0", "70000", "-1", "٢٩٥٠٠"])
def test_a_master_port_that_is_not_a_port_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch, port: str) -> None:
    # Before: torch's rendezvous raised int()'s bare ValueError.
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", port)
    with simulate("cuda:2"), pytest.raises(DeviceError, match=r"MASTER_PORT=.* is not a TCP port.*MASTER_PORT=29500"):
        wd.resolve_device(task="training")


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"SLURM_PROCID": "7", "SLURM_NTASKS": "2"}, "SLURM_PROCID=7 is not below SLURM_NTASKS=2"),
        (
            {"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"},
            "SLURM_PROCID=3 is not below SLURM_STEP_NUM_TASKS=2",
        ),
        ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' must be 1 or more"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "0", "SLURM_STEP_ID": "0"}, "SLURM_STEP_NUM_TASKS='0'"),
    ],
    ids=["procid-past-ntasks", "procid-past-step-tasks", "ntasks-zero", "step-tasks-zero"],
)
def test_slurm_variables_that_contradict_each_other_are_refused(env: dict[str, str], says: str) -> None:
    with pytest.raises(DeviceError) as info:
        detect_distributed(env)
    assert says in str(info.value)
    assert "unset" in str(info.value)


def test_a_batch_script_s_slurm_numbers_stay_a_single_process() -> None:
    assert detect_distributed({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"}) is None
