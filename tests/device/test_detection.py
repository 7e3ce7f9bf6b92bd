"""Detection that finds nothing names what would change that: the probe time limit, or exclude=."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import whichdevice as wd
from steering import STEERING
from whichdevice.core.errors import DeviceUnavailableError
from whichdevice.testing import simulate


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in STEERING:
        monkeypatch.delenv(name, raising=False)


def test_a_time_limit_too_short_for_any_probe_is_named() -> None:
    # Real probes in a fresh process: a simulation answers at once, and this one caches its probes.
    # The CPU probe reads /proc/cpuinfo in well under a millisecond and may finish before the waiting
    # thread gets the GIL back to see the limit passed; a sleep (which lets go of the GIL) makes it
    # take longer than the limit every time.
    env = {k: v for k, v in os.environ.items() if k not in STEERING} | {"WHICHDEVICE_PROBE_TIMEOUT": "1e-9"}
    code = (
        "import time\n"
        "import whichdevice as wd\n"
        "import whichdevice.hardware.probes.cpu as cpu\n"
        "real = cpu.read_cpu\n"
        "cpu.read_cpu = lambda backend: (time.sleep(0.2), real(backend))[1]\n"
        "try:\n    wd.resolve_device()\nexcept wd.DeviceError as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    message = done.stdout
    assert "did not finish within the time limit of 1e-09 s (WHICHDEVICE_PROBE_TIMEOUT)" in message
    assert "cpu" in message.split("the probes of ", 1)[1] and "raise it (WHICHDEVICE_PROBE_TIMEOUT=60)" in message
    # Nothing was excluded, so exclude= is not the fix.
    assert "exclude=" not in message


def test_excluding_cpu_still_says_to_leave_it_in() -> None:
    with simulate("cuda,unavailable"), pytest.raises(DeviceUnavailableError) as info:
        wd.resolve_device(exclude=["cpu"])
    assert "leave 'cpu' out of exclude= to fall back to it" in str(info.value)
    assert "time limit" not in str(info.value)


def test_a_gaudi_index_is_refused_for_inference_as_the_hpu_page_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/backends/hpu.md: `hpu` takes no index, each process owning one device (issue 58: hpu:1 was accepted)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "backends" / "hpu.md").read_text(encoding="utf-8")
    assert "| device string | `hpu` (no index" in page
    with simulate("hpu:8"):
        with pytest.raises(wd.ConfigConflictError) as err:
            wd.resolve_device("hpu:1")
        here, current = wd.resolve_device("hpu"), wd.resolve_device("hpu:0")
    message = str(err.value)
    assert "pass device='hpu'" in message and "HABANA_VISIBLE_MODULES=1 python your_script.py" in message
    assert (here.device, current.device) == ("hpu", "hpu:0")
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "4,5,6,7")
    with simulate("hpu:8"), pytest.raises(wd.ConfigConflictError) as err:
        wd.resolve_device("hpu:2", refresh=True)
    assert "HABANA_VISIBLE_MODULES=6 python" in str(err.value)  # the module behind visible index 2
