"""benchmarks/hardware_check.py: the spec it derives describes the machine, and it runs here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import whichdevice as wd
from steering import STEERING
from whichdevice.testing import simulate

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "hardware_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hardware_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "spec",
    [
        "cuda:8,cc=9.0,mem=141GiB,name=NVIDIA H200",
        "cuda:2,cc=8.0,free=2GiB/80GiB,driver=580.65.06,cuda=13.0,arch=sm_80+sm_90",
        "cuda:4,compute=default/exclusive/prohibited,held=0/1GiB",
        "cuda:2,compute=exclusive,held=78GiB/0,free=2GiB/80GiB",
        "cuda:2,variant=rocm",
        "hpu:8,gen=gaudi3",
        "npu:4,bf16=no",
        "xpu:2",
        "mps,macos=13.6",
        "tpu:4",
        "cpu,flags=avx512_bf16",
        "cpu,flags=",
        "cpu,flags=amx_bf16+avx512_bf16,free=10GiB",
    ],
)
def test_the_derived_spec_simulates_the_same_probe_result(spec: str) -> None:
    hardware_check = _load()
    name = spec.split(",")[0].split(":")[0]
    with simulate(spec):
        first = wd.probe(name)
    derived = hardware_check.spec_for(first)
    with simulate(derived):
        again = wd.probe(name)
    assert again.to_dict() | {"seconds": 0} == first.to_dict() | {"seconds": 0}, derived


def test_the_check_runs_here_and_writes_its_json_and_summary(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    command = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--only", "resolution", "--only", "simulation"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "hardware_check.json").read_text(encoding="utf-8"))
    assert [s["name"] for s in data["sections"]] == ["probe", "resolution", "simulation"]
    assert {s["status"] for s in data["sections"]} == {"ok"}
    summary = (tmp_path / "hardware_check.txt").read_text(encoding="utf-8")
    assert summary == proc.stdout
    assert "matches this machine field by field" in summary
    assert "the real report replayed: the same resolution, trace and warnings" in summary
