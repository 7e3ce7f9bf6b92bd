"""Under ``ulimit -v``, ``-n`` and ``-f`` the command fails with one line naming the limit, exit 1."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import whichdevice
from steering import STEERING
from whichdevice.core.limits import limit_hit

resource = pytest.importorskip("resource")

SRC = str(Path(whichdevice.__file__).resolve().parents[1])

LIMITS = {
    # name: (rlimit, value, what the one line says)
    "ulimit-v": ("RLIMIT_AS", 400_000 * 1024, "the address-space limit (ulimit -v, now 400000)"),
    "ulimit-n": ("RLIMIT_NOFILE", 9, "too many open files: the per-process limit (ulimit -n, now 9)"),
    "ulimit-f": ("RLIMIT_FSIZE", 0, "the file-size limit (ulimit -f, now 0)"),
}


@pytest.mark.parametrize("args", [("check", "cpu"), ("--json",)], ids=["check", "report-json"])
@pytest.mark.parametrize("limit", list(LIMITS))
def test_the_command_names_the_limit_it_hit(limit: str, args: tuple[str, ...], tmp_path: Path) -> None:
    name, value, says = LIMITS[limit]

    def lower() -> None:
        resource.setrlimit(getattr(resource, name), (value, value))

    # The calibration on (the suite turns it off): it imports torch, which is what a limit stops.
    env = {k: v for k, v in os.environ.items() if k not in STEERING and k != "WHICHDEVICE_CALIBRATION"}
    env |= {"PYTHONPATH": SRC, "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "whichdevice", *args],
        env=env,
        preexec_fn=lower,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
    if "--json" in args and done.stdout.strip():
        error = json.loads(done.stdout)["error"]
        assert error["type"] == "ResourceLimitError" and says in error["message"]


@pytest.mark.parametrize(
    ("exc", "says"),
    [
        (MemoryError(), "out of memory (MemoryError)"),
        (ImportError("libtorch_cpu.so: failed to map segment from shared object"), "ulimit -v"),
        (OSError(errno.EMFILE, "Too many open files"), "ulimit -n"),
        (OSError(errno.ENFILE, "Too many open files in system"), "fs.file-max"),
        (OSError(errno.EFBIG, "File too large"), "ulimit -f"),
        (OSError(errno.ENOSPC, "No space left on device", "/tmp/x"), "no space left on the disk"),
    ],
    ids=["memory", "loader", "emfile", "enfile", "efbig", "enospc"],
)
def test_each_limit_is_named(exc: BaseException, says: str) -> None:
    assert says in (limit_hit(exc) or "")


@pytest.mark.parametrize("exc", [ValueError("x"), OSError(errno.EACCES, "Permission denied"), ImportError("No module")])
def test_other_failures_are_not_called_a_limit(exc: BaseException) -> None:
    assert limit_hit(exc) is None


def test_torchs_allocator_error_is_the_memory_limit() -> None:
    error = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 33554432 bytes. Error code 12 (Cannot allocate memory)"
    )
    said = limit_hit(error)
    assert said is not None and "ulimit -v" in said and "raise the limit (ulimit -v unlimited)" in said
    assert limit_hit(RuntimeError("shape mismatch")) is None
