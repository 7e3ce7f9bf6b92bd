"""Distributed context detection, and real torchrun processes resolving and training over gloo."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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


@pytest.mark.slow
def test_torchrun_two_processes(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--nnodes=1",
        f"--master_port={_free_port()}",
        str(SCRIPT),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = _reports(tmp_path, 2)
    assert sorted(r["local_rank"] for r in reports) == [0, 1]
    assert {r["world_size"] for r in reports} == {2}


@pytest.mark.slow
def test_two_nodes_on_one_machine(tmp_path):
    port = _free_port()
    procs = []
    for node_rank in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=1",
            "--nnodes=2",
            f"--node_rank={node_rank}",
            "--rdzv_backend=static",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(SCRIPT),
            str(tmp_path),
        ]
        procs.append(subprocess.Popen(cmd, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    reports = _reports(tmp_path, 2)
    # One process per node: each is local rank 0 on its node, ranks 0 and 1 overall.
    assert [r["local_rank"] for r in reports] == [0, 0]
    assert [r["rank"] for r in reports] == [0, 1]
