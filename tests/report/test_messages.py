"""Messages a user reads, mended one by one (issue 28): each test holds one of them to its fix.

They span modules (detection, training arguments, the resolution, model files, the command, the
report), so they sit together here rather than in each module's test file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jsonschema
import pytest

import whichdevice as wd
from steering import STEERING
from whichdevice import report
from whichdevice.testing import simulate


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in STEERING}
    clean.update(env)
    command = [sys.executable, "-m", "whichdevice", *args]
    return subprocess.run(command, env=clean, capture_output=True, text=True, timeout=300, check=False)


def test_excluding_every_backend_says_so_without_an_empty_list() -> None:
    with pytest.raises(wd.DeviceUnavailableError) as info:
        wd.resolve_device(exclude=[b.name for b in wd.backends()])
    message = str(info.value)
    assert "  " not in message and " in  " not in message
    assert "exclude= leaves no backend" in message and "leave 'cpu' out of exclude=" in message


def test_a_precision_warning_points_at_the_callers_line(tmp_path: Path) -> None:
    with simulate("cpu,flags="), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wd.training_arguments(output_dir=str(tmp_path), fp16=True)  # the line the warning must name
    ours = [w for w in caught if "fp16=True on cpu" in str(w.message)]
    assert ours, [str(w.message) for w in caught]
    assert ours[0].filename == __file__, f"the warning points at {ours[0].filename}:{ours[0].lineno}"


def test_install_hints_have_no_nested_parentheses() -> None:
    for backend in wd.backends():
        hint = backend.install_command
        assert "(" not in hint and ")" not in hint, f"{backend.name}: {hint!r} goes inside '(...)' in messages"
    with simulate("cpu"):
        reason = wd.probe("neuron").reason or ""
    assert "((" not in reason and "))" not in reason and "(from" not in reason, reason


def test_a_resolution_repr_is_one_short_line() -> None:
    res = wd.resolve_device("cpu")
    text = repr(res)
    assert text.startswith("Resolution(device='cpu'") and "\n" not in text and len(text) < 200
    for part in (f"dtype={res.dtype_name!r}", f"device_map={res.device_map!r}", "attn_implementation="):
        assert part in text
    assert "probe_ref" not in text and "ProbeResult" not in text


def test_a_hub_id_that_is_not_cached_gets_the_download_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(wd.DeviceError) as info:
        wd.resolve_device(model="gpt2")
    assert "hf download gpt2" in str(info.value)
    with pytest.raises(wd.DeviceError) as info:
        wd.resolve_device(model="org/it's")  # quoted for the shell, not pasted raw
    assert "hf download 'org/it'\"'\"'s'" in str(info.value) or "hf download" not in str(info.value)


@pytest.mark.parametrize(
    "args", [("--task", "training"), ("--device", "cpu"), ("--simulate-report", "machine.json")], ids=str
)
def test_calibrate_refuses_options_it_would_ignore(args: tuple[str, ...]) -> None:
    proc = _run("calibrate", *args)
    assert proc.returncode == 2, proc.stderr
    assert f"calibrate takes no {args[0]}" in proc.stderr


def test_calibrate_json_is_valid_against_the_schema(tmp_path: Path) -> None:
    proc = _run("calibrate", "--json", XDG_CACHE_HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["kind"] == "calibration" and data["schema_version"] == report.SCHEMA_VERSION
    jsonschema.Draft202012Validator(report.load_schema()).validate(data)


def test_the_report_headline_agrees_with_the_training_arguments_line() -> None:
    proc = _run("--simulate", "cuda:1", "--task", "training")
    assert proc.returncode == 0, proc.stderr
    headline = next(line for line in proc.stdout.splitlines() if line.startswith("whichdevice "))
    arguments = next(line for line in proc.stdout.splitlines() if "TrainingArguments" in line)
    assert "bf16=True" in arguments
    assert "float32 weights, bf16 mixed precision" in headline, headline
    assert "see docs/glossary.md" in proc.stdout
