"""Launcher variables no launcher left together: refused or ignored before TrainingArguments (issue 16, class 9)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice.launch.leftovers import ENV_VARIABLES, launch_leftovers
from whichdevice.resolve import memo
from whichdevice.testing import simulate

GROUP = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}

# Leftovers transformers would read: training is refused, with the variables to unset.
# (environment, trains on the CPU, the words the error must contain)
REFUSED = [
    ({"LOCAL_RANK": "0"}, True, ("LOCAL_RANK=0", "unset LOCAL_RANK`", "torchrun")),
    ({"LOCAL_RANK": "0"}, False, ("unset LOCAL_RANK`",)),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, True, ("unset LOCAL_RANK WORLD_SIZE`",)),
    ({"LOCAL_RANK": "0", "RANK": "0"}, True, ("unset LOCAL_RANK RANK`",)),
    (
        {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        True,
        ("unset LOCAL_RANK RANK WORLD_SIZE LOCAL_WORLD_SIZE`",),
    ),
    ({"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, False, ("unset LOCAL_RANK WORLD_SIZE`",)),
    # a stray LOCAL_RANK in an sbatch script: the batch step is one process too
    ({"LOCAL_RANK": "0", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}, True, ("unset LOCAL_RANK`",)),
    # MPI sizes without their rank: accelerate's CPU path reads them
    ({"OMPI_COMM_WORLD_SIZE": "4"}, True, ("OMPI_COMM_WORLD_RANK is not", "unset OMPI_COMM_WORLD_SIZE`", "mpirun")),
    ({"PMI_SIZE": "8"}, True, ("PMI_RANK is not", "unset PMI_SIZE`", "mpiexec")),
    ({"MV2_COMM_WORLD_SIZE": "2"}, True, ("unset MV2_COMM_WORLD_SIZE`",)),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, True, ("unset OMPI_COMM_WORLD_SIZE`",)),
]


def _set(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(("env", "cpu", "words"), REFUSED, ids=[f"{e}-{'cpu' if c else 'gpu'}" for e, c, _ in REFUSED])
@pytest.mark.usefixtures("restore_accelerate_variables")
def test_leftovers_transformers_reads_are_refused_before_training_arguments(
    env: dict[str, str], cpu: bool, words: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _set(monkeypatch, env)
    with simulate("cpu" if cpu else "cuda:1", others="absent"):
        with pytest.raises(wd.ConfigConflictError) as raised:
            wd.resolve_device(task="training")
        with pytest.raises(wd.ConfigConflictError) as again:
            wd.training_arguments(str(tmp_path), report_to="none")
        # also with a resolution made for inference, where the same variables are only a warning
        inference = wd.resolve_device()
        assert "left over" in inference.explain()
        with pytest.raises(wd.ConfigConflictError):
            wd.training_arguments(str(tmp_path), resolution=inference, report_to="none")
    for word in words:
        assert word in str(raised.value), str(raised.value)
    assert str(again.value) == str(raised.value)


def test_without_the_check_transformers_fails_on_a_stray_local_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # What the refusal replaces: the raw error from inside TrainingArguments.
    from accelerate.state import PartialState
    from transformers import TrainingArguments

    monkeypatch.setenv("LOCAL_RANK", "0")
    before = dict(os.environ)
    try:
        with pytest.raises(ValueError, match="env:// rendezvous") as raised:
            TrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    finally:
        PartialState._reset_state()  # the failed start leaves accelerate's shared state half set
        for name in set(os.environ) - set(before):  # and the variables it exported on the way
            del os.environ[name]
    assert not isinstance(raised.value, wd.DeviceError)


# Leftovers nothing reads: ignored, with a warning; TrainingArguments is built for one process.
# (environment, trains on the CPU, words of the warning)
IGNORED = [
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, True, ("SLURM_NTASKS=4", "not started by srun", "srun python")),
    (
        {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "42", "SLURM_NNODES": "1"},
        True,
        ("batch script's one process",),
    ),
    ({"SLURM_NTASKS": "16", "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "train"}, True, ("SLURM_NTASKS=16",)),
    ({"SLURM_NTASKS": "2(x2)", "SLURM_PROCID": "0"}, True, ("SLURM_NTASKS=2",)),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, False, ("OMPI_COMM_WORLD_RANK is not", "runs alone")),
    ({"PMI_SIZE": "2"}, False, ("PMI_RANK is not",)),
]


@pytest.mark.parametrize(("env", "cpu", "words"), IGNORED, ids=[f"{e}-{'cpu' if c else 'gpu'}" for e, c, _ in IGNORED])
@pytest.mark.usefixtures("restore_accelerate_variables")
def test_leftovers_nothing_reads_are_ignored_with_a_warning(
    env: dict[str, str], cpu: bool, words: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _set(monkeypatch, env)
    with simulate("cpu" if cpu else "cuda:1"):
        res = wd.resolve_device(task="training")
        warnings = [s.message for s in res.trace if s.topic == "warning"]
        assert res.distributed is None
        assert "ddp_backend" not in res.training_kwargs()
        if cpu:  # a real TrainingArguments, for one process
            args = wd.training_arguments(str(tmp_path), report_to="none")
            assert args.world_size == 1 and args.ddp_backend is None
            assert str(args.parallel_mode).endswith("NOT_PARALLEL")
    assert any(all(w in m for w in words) for m in warnings), warnings


# Real launches: nothing is left over.
LAUNCHES = [
    {"LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", **GROUP},
    {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", **GROUP},  # torchrun --nproc-per-node=1
    {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"},
    {"LOCAL_RANK": "0", "WORLD_SIZE": "2"},  # several processes by hand: check_training_launch names the exports
    {"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1"},  # srun
    {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"},
    {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
    {"LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"},  # mpirun, LOCAL_RANK by hand
    {"PMI_SIZE": "1"},
    {},
]


@pytest.mark.parametrize("env", LAUNCHES, ids=str)
@pytest.mark.parametrize("cpu", [True, False])
def test_real_launches_are_not_leftovers(env: dict[str, str], cpu: bool) -> None:
    assert launch_leftovers(env, cpu=cpu) == ()


def test_a_scheduler_size_without_its_rank_is_not_a_launch() -> None:
    from whichdevice.launch.distributed import detect_distributed

    assert detect_distributed({"OMPI_COMM_WORLD_SIZE": "4"}) is None
    assert detect_distributed({"SLURM_STEP_NUM_TASKS": "4"}) is None
    assert detect_distributed({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0"}) is not None


def test_leftover_variables_are_part_of_the_memo_key() -> None:
    assert set(ENV_VARIABLES) <= set(memo.memo_variables())


def test_long_values_are_not_echoed_whole() -> None:
    (found,) = launch_leftovers({"LOCAL_RANK": "0" * 5000})
    assert len(found.message) < 1000


TORCHRUN_RANK_1 = {
    "LOCAL_RANK": "1",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "TORCHELASTIC_RUN_ID": "x",
    **GROUP,
}


def test_a_stray_mpi_size_behind_torchruns_world_size_is_what_accelerate_ignores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accelerate.utils.environment import get_cpu_distributed_information

    env = {**TORCHRUN_RANK_1, "OMPI_COMM_WORLD_SIZE": "2"}
    _set(monkeypatch, env)
    # accelerate's own CPU path: the world size and rank come from torchrun's variables.
    info = get_cpu_distributed_information()
    assert (info.rank, info.world_size) == (1, 2)
    (found,) = launch_leftovers(env, cpu=True)
    assert not found.read and "accelerate counts the processes from WORLD_SIZE=2 and never reads it" in found.message
    res = wd.resolve_device("cpu", task="training")
    assert res.distributed is not None and (res.distributed.rank, res.distributed.world_size) == (1, 2)
    assert res.training_kwargs()["ddp_backend"] == "gloo"
    # Without torchrun's WORLD_SIZE, accelerate would count 2 processes from it: still refused.
    assert launch_leftovers({"OMPI_COMM_WORLD_SIZE": "2"}, cpu=True)[0].read


@pytest.mark.parametrize("device", ["cpu", None])
@pytest.mark.usefixtures("restore_accelerate_variables")
def test_local_rank_minus_one_means_not_distributed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device: str | None
) -> None:
    # accelerate (state.py: int(os.environ.get("LOCAL_RANK", -1)) != -1) and TrainingArguments read -1 as unset.
    monkeypatch.setenv("LOCAL_RANK", "-1")
    res = wd.resolve_device(device, task="training")
    assert res.distributed is None and "ddp_backend" not in res.training_kwargs()
    assert launch_leftovers(cpu=True) == ()
    args = wd.training_arguments(str(tmp_path), report_to="none")
    assert args.parallel_mode.name == "NOT_PARALLEL" and str(args.device) == "cpu"


@pytest.mark.usefixtures("restore_accelerate_variables")
def test_a_leftover_accelerate_torch_device_is_refused_with_the_unset_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before: the trace warned and TrainingArguments was built; the Trainer then moved the model to xpu:0.
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "xpu:0")
    with pytest.raises(wd.ConfigConflictError) as err:
        wd.training_arguments(str(tmp_path), report_to="none")
    text = str(err.value)
    assert "ACCELERATE_TORCH_DEVICE='xpu:0'" in text and "does not have" in text
    assert "`unset ACCELERATE_TORCH_DEVICE`" in text
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    assert str(wd.training_arguments(str(tmp_path), report_to="none").device) == "cpu"
