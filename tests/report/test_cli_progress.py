"""The command's progress on stderr: a slow step shows on a terminal, never in --json or on a pipe."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

from pty_output import read_until_closed
from steering import STEERING

# The command, run as the real one (descriptors guarded), with the CPU probe made slow: over the
# second after which a step shows, whatever this machine's speed.
SLOW_PROBE = """
import sys, time
from whichdevice.hardware import probing
real = probing._run
delay = float(sys.argv[1])
def slow(backend, *args, **kwargs):
    if backend.name == "cpu":
        time.sleep(delay)
    return real(backend, *args, **kwargs)
probing._run = slow
from whichdevice import cli
sys.argv = ["whichdevice", *sys.argv[2:]]
sys.exit(cli.main())
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    env["TERM"] = "xterm"
    return env


def run_with_stderr_on_tty(delay: float, *args: str) -> tuple[int, str, str]:
    """Exit code, stdout (a pipe) and what reached stderr (a pseudo-terminal)."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_PROBE, str(delay), *args],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=follower,
        )
        os.close(follower)
        follower = -1
        err = read_until_closed(leader, proc)
        out = proc.stdout.read().decode() if proc.stdout else ""
        return proc.wait(timeout=60), out, err.decode(errors="replace")
    finally:
        if follower != -1:
            os.close(follower)
        os.close(leader)


def test_a_slow_step_shows_on_a_terminal_and_is_cleared() -> None:
    code, out, err = run_with_stderr_on_tty(1.6)
    assert code == 0 and "RESOLUTION FOR INFERENCE" in out
    assert "\r\x1b[Kwhichdevice: probing cpu ..." in err
    assert err.endswith("\r\x1b[K")  # the line is gone before the command ends
    assert "probing cpu" not in out


def test_json_shows_no_progress_even_on_a_terminal() -> None:
    code, out, err = run_with_stderr_on_tty(1.6, "--json")
    assert code == 0 and out.lstrip().startswith("{")
    assert "probing" not in err and "\x1b[K" not in err


def test_a_pipe_gets_no_progress() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SLOW_PROBE, "1.6"], env=_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0 and "RESOLUTION FOR INFERENCE" in proc.stdout
    assert "probing" not in proc.stderr and "\x1b[K" not in proc.stderr
