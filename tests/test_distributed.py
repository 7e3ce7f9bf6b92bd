"""Distributed context detection, and real torchrun processes resolving and training over gloo."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from whichdevice import DeviceError
from whichdevice.distributed import detect_distributed

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}, ("torchrun", 0, 0, 1)),
        ({"LOCAL_RANK": "1", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, ("torchrun", 1, 3, 4)),
        ({"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, None),  # a plain batch job
        (
            {"SLURM_LOCALID": "1", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)"},
            ("slurm", 1, 5, 8),
        ),
        (
            {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"},
            ("mpi", 0, 2, 4),
        ),
    ],
)
def test_detect_distributed(env, expected):
    ctx = detect_distributed(env)
    if expected is None:
        assert ctx is None
    else:
        assert (ctx.launcher, ctx.local_rank, ctx.rank, ctx.world_size) == expected


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' is not a whole number"),
        ({"LOCAL_RANK": "-1"}, "must be 0 or more"),
        ({"LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "smaller than LOCAL_WORLD_SIZE"),
        ({"LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "not below LOCAL_WORLD_SIZE=2"),
        ({"LOCAL_RANK": "0", "RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
    ],
)
def test_bad_distributed_environment(env, match):
    with pytest.raises(DeviceError, match=match):
        detect_distributed(env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WHICHDEVICE_DEVICE", None)
    return env


def _reports(out: Path, n: int) -> list[dict]:
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    for r in reports:
        assert r["device"] == "cpu" and r["backend"] == "cpu"
        assert r["ddp_backend"] == r["args_ddp_backend"] == "gloo"
        assert r["process_group"] == "gloo" and r["pg_world_size"] == n
        # accelerate names the CPU "cpu:0" in a process group; it is the same device.
        assert r["args_device"] in ("cpu", "cpu:0") and r["steps"] == 3
    # DDP kept the replicas in step.
    assert len({round(r["checksum"], 6) for r in reports}) == 1
    return reports


def _torchrun(out: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *options, str(SCRIPT), str(out)]


def _launch_together(tmp_path: Path, commands_for_port, timeout: float = 240) -> None:
    """Start the launchers at once and wait for all of them (and their workers).

    Output goes to files, not pipes: a process blocked on a full pipe that nobody reads stalls its
    peers in the collective, and the test would hang instead of failing. When one launcher fails
    the others are stopped. A port taken by another socket between ``_free_port()`` and the
    launcher binding it is the one failure retried, with a new port.
    """
    for attempt in range(3):
        commands = commands_for_port(_free_port())
        logs = [tmp_path / f"launcher{attempt}-{i}.log" for i in range(len(commands))]
        procs = []
        for cmd, log in zip(commands, logs, strict=True):
            with log.open("w") as out:
                # A session of its own, so that stopping a launcher also stops its workers.
                procs.append(
                    subprocess.Popen(
                        cmd, env=_clean_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # leftover workers too, even of a launcher that exited
            p.wait()
        if all(p.returncode == 0 for p in procs):
            return
        text = [log.read_text(errors="replace") for log in logs]
        if any("address already in use" in t.lower() for t in text):
            continue
        why = f"launchers still running after {timeout:.0f} s; " if time.monotonic() >= deadline else ""
        tails = [f"launcher {i} exit {procs[i].returncode}:\n{t[-2500:]}" for i, t in enumerate(text)]
        pytest.fail(why + "; ".join(tails))
    pytest.fail("the master port was taken three times in a row")


@pytest.mark.slow
def test_torchrun_two_processes(tmp_path):
    def commands(port: int) -> list[list[str]]:
        return [_torchrun(tmp_path, "--nproc_per_node=2", "--nnodes=1", f"--master_port={port}")]

    _launch_together(tmp_path, commands)
    reports = _reports(tmp_path, 2)
    assert sorted(r["local_rank"] for r in reports) == [0, 1]
    assert {r["world_size"] for r in reports} == {2}


@pytest.mark.slow
def test_two_nodes_on_one_machine(tmp_path):
    def commands(port: int) -> list[list[str]]:
        static = ("--nproc_per_node=1", "--nnodes=2", "--rdzv_backend=static", "--master_addr=127.0.0.1")
        return [_torchrun(tmp_path, *static, f"--master_port={port}", f"--node_rank={rank}") for rank in (0, 1)]

    _launch_together(tmp_path, commands)
    reports = _reports(tmp_path, 2)
    # One process per node: each is local rank 0 on its node, ranks 0 and 1 overall.
    assert [r["local_rank"] for r in reports] == [0, 0]
    assert [r["rank"] for r in reports] == [0, 1]
