"""The child that tries a vendor import dies with its parent, even while the import hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import whichdevice

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

SRC = str(Path(whichdevice.__file__).resolve().parents[1])


def _children(parent: int) -> list[int]:
    """Processes whose parent is ``parent`` and that run the trial's script."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"import importlib, json, os, sys" in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_to_the_parent_ends_the_trial_child_of_a_hanging_import(tmp_path: Path) -> None:
    package = tmp_path / "torch_npu"
    package.mkdir()
    marker = tmp_path / "importing"
    (package / "__init__.py").write_text(f"import time\nopen({str(marker)!r}, 'w').close()\ntime.sleep(1000)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WHICHDEVICE_", "TORCH_DEVICE_BACKEND"))}
    env |= {"PYTHONPATH": os.pathsep.join([SRC, str(tmp_path)]), "WHICHDEVICE_PROBE_TIMEOUT": "600"}
    parent = subprocess.Popen(
        [sys.executable, "-c", "import whichdevice as wd; wd.probe('npu')"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not children and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
            children = _children(parent.pid)
        assert children, "the trial child never started"
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # until the child hangs in the vendor import, not before
        assert marker.exists(), "the trial child never reached the vendor import"
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, children)), f"trial child {children} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in children:  # the session the child leads: nothing else reaches it
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)
