"""The CPU's facts are read from /proc/cpuinfo where it has them, without starting a process."""

from __future__ import annotations

import importlib
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# the package re-exports the function under the module's name
facts = importlib.import_module("whichdevice.hardware.probes.cpu_facts")


def _model_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        return None
    return None


@pytest.fixture
def fresh() -> Iterator[None]:
    facts.cpu_facts.cache_clear()
    yield
    facts.cpu_facts.cache_clear()


@pytest.mark.skipif(_model_name() is None, reason="no model name in /proc/cpuinfo (not Linux x86)")
def test_the_model_name_comes_from_cpuinfo_without_uname(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # platform.processor() runs `uname -p` in a subprocess on Linux: 10 ms of a fresh resolution.
    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_process)
    monkeypatch.setattr(platform, "processor", lambda: pytest.fail("platform.processor() was asked"))
    name, flags, memory = facts.cpu_facts()
    assert name == _model_name()
    assert flags <= facts.BF16_CPU_FLAGS
    assert memory is None or memory > 0


def test_without_cpuinfo_the_platform_names_the_cpu(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = open

    def no_cpuinfo(path: object, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        if path == "/proc/cpuinfo":
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr("builtins.open", no_cpuinfo)
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    assert facts.cpu_facts()[0] == "arm"
    facts.cpu_facts.cache_clear()
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert facts.cpu_facts()[0] is None
