"""The launch lines whichdevice suggests are quoted for a shell: pasting one runs only that launch."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

import whichdevice as wd
from steering import STEERING
from whichdevice.core.errors import ConfigConflictError
from whichdevice.testing import simulate

HOSTILE = "0,1,$(touch PWNED);id"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in STEERING:
        monkeypatch.delenv(name, raising=False)


def _pasted(command: str, cwd: Path) -> list[str]:
    """The words a shell makes of ``command`` when a person pastes it (after ``printf``, so nothing starts)."""
    done = subprocess.run(
        ["bash", "-c", "printf '%s\\n' " + command], cwd=cwd, capture_output=True, text=True, timeout=30, check=True
    )
    return done.stdout.splitlines()


def test_the_traced_launch_line_runs_nothing_from_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", HOSTILE)
    with simulate("cuda:8"):
        res = wd.resolve_device(task="training")
    line = next(s.message for s in res.trace if "launch one process per device" in s.message)
    command = re.search(r"`([^`]*)`", line)
    assert command is not None
    words = _pasted(command.group(1), tmp_path)
    assert words == res.launch_command(["train.py"])
    assert f"CUDA_VISIBLE_DEVICES={HOSTILE}" in words and not (tmp_path / "PWNED").exists()


def test_the_refusal_of_a_second_device_quotes_its_commands(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", HOSTILE)
    with simulate("cuda:8"), pytest.raises(ConfigConflictError) as info:
        wd.resolve_device("cuda:1", task="training")
    command = re.search(r"`([^`]*)`", str(info.value))
    assert command is not None
    assert _pasted(command.group(1), tmp_path)[:2] == ["env", f"CUDA_VISIBLE_DEVICES={HOSTILE}"]
    assert not (tmp_path / "PWNED").exists()
    assert shlex.split(str(info.value).split("alone visible: ", 1)[1])[0] == "CUDA_VISIBLE_DEVICES=1"


def test_accelerates_config_file_as_a_fifo_or_a_device_is_said_not_skipped(tmp_path: Path) -> None:
    import os

    from whichdevice.launch.accelerate_settings import read_accelerate_settings

    folder = tmp_path / "hf" / "accelerate"
    folder.mkdir(parents=True)
    os.mkfifo(folder / "default_config.yaml")
    settings = read_accelerate_settings({"HF_HOME": str(tmp_path / "hf")})
    assert settings.config is None and settings.config_problem is not None
    assert "is a named pipe (FIFO), not a file" in settings.config_problem
    assert "reads the launch from the variables alone" in settings.config_problem
