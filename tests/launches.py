"""Real launches for tests: processes started together (torchrun, accelerate launch, a scheduler's
variables), their output in files, stopped together when one fails."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from whichdevice.launch.distributed import ENV_VARIABLES

__all__ = ["Command", "clean_env", "free_port", "launch_together"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARIABLES and not k.startswith(("SLURM_", "OMPI_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WHICHDEVICE_DEVICE", None)
    return {**env, **(extra or {})}


Command = list[str] | tuple[list[str], dict[str, str]]


def launch_together(tmp_path: Path, commands_for_port, timeout: float = 240) -> None:
    """Start the processes at once and wait for all of them (and their workers).

    A command is an argument list, or (argument list, variables to add to its environment).
    Output goes to files, not pipes: a process blocked on a full pipe that nobody reads stalls its
    peers in the collective, and the test would hang instead of failing. When one process fails
    the others are stopped. A port taken by another socket between ``free_port()`` and the
    launcher binding it is the one failure retried, with a new port.
    """
    for attempt in range(3):
        commands: list[Command] = commands_for_port(free_port())
        logs = [tmp_path / f"launcher{attempt}-{i}.log" for i in range(len(commands))]
        procs = []
        for command, log in zip(commands, logs, strict=True):
            cmd, extra = command if isinstance(command, tuple) else (command, {})
            with log.open("w") as out:
                # A session of its own, so that stopping a launcher also stops its workers.
                procs.append(
                    subprocess.Popen(
                        cmd, env=clean_env(extra), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
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
