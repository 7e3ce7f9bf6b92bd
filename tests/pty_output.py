"""Reading what a child process writes to a pseudo-terminal, for the tests of what a terminal shows."""

from __future__ import annotations

import os
import select
import subprocess
import time


def read_until_closed(leader: int, proc: subprocess.Popen[bytes], timeout: float = 300) -> bytes:
    """Everything written to the terminal whose ``leader`` end is given, until every writer closed
    it or ``proc`` ended; ``proc`` is killed after ``timeout`` seconds."""
    out = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not select.select([leader], [], [], 1.0)[0]:
            if proc.poll() is not None:
                break
            continue
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        out += chunk
    else:
        proc.kill()
    return bytes(out)
