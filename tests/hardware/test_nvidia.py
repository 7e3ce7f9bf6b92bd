"""nvidia-smi's output read defensively (whichdevice.hardware.probes.nvidia): every number through one
parser, a row it refuses skipped and said, and never the "installed but broken" message for it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice.hardware.probes import nvidia
from whichdevice.hardware.probes import nvidia_platforms as platforms

GOOD = "NVIDIA GB10, 122502, 12.1, GPU-00000000-0000-0000-0000-000000000001, 580.95, 120000, Default"


def _fake_smi(folder: Path, monkeypatch: pytest.MonkeyPatch, rows: list[str]) -> None:
    """An ``nvidia-smi`` first on PATH that prints ``rows`` for the GPU query and no compute apps."""
    script = folder / "nvidia-smi"
    body = "\n".join(rows)
    script.write_text(f'#!/bin/sh\ncase "$1" in --query-gpu*) printf "%s\\n" "{body}";; esac\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("bad", ["inf", "nan", "-4096", "1e400", "99999999999999999999"])
def test_a_refused_memory_skips_the_row_and_says_so(tmp_path, monkeypatch, bad):
    garbled = GOOD.replace("122502", bad).replace("0001", "0002")
    _fake_smi(tmp_path, monkeypatch, [garbled, GOOD])
    stack = nvidia.smi_devices()
    assert [d.uuid for d in stack.devices] == ["GPU-00000000-0000-0000-0000-000000000001"]
    assert stack.devices[0].memory == 122502 * 1024**2
    (said,) = stack.skipped
    assert "nvidia-smi printed a row whichdevice skipped" in said and bad[:10] in said


def test_a_free_memory_of_inf_is_unknown_not_an_error(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, [GOOD.replace("120000", "inf")])
    (device,) = nvidia.smi_devices().devices
    assert device.free is None and device.memory == 122502 * 1024**2


def test_a_cpu_only_torch_on_arm64_keeps_its_install_line_when_nvidia_smi_garbles(tmp_path, monkeypatch):
    # The ARM64 host with a CPU-only torch (this one's), as the report found it.
    monkeypatch.setattr(platforms, "read_host", lambda: (platforms.ARM64, None))
    _fake_smi(tmp_path, monkeypatch, [GOOD.replace("122502", "inf")])
    result = wd.probe("cuda")
    reason = result.reason or ""
    assert "installed but broken" not in reason and "OverflowError" not in reason
    assert "CPU-only build" in reason and "pip install 'torch>=2.11'" in reason  # the ARM64 server's line
    assert any("nvidia-smi printed a row whichdevice skipped" in w for w in result.warnings)


def test_only_a_failed_import_is_called_a_broken_install(monkeypatch):
    import dataclasses

    from whichdevice.hardware import registry

    def raises(backend):
        raise OverflowError("cannot convert float infinity to integer")

    row = dataclasses.replace(wd.get_backend("npu"), probe_ref=raises)
    registry.register_backend(row, replace=True)
    reason = wd.probe("npu").reason or ""
    assert "raised OverflowError" in reason and "installed but broken" not in reason
    assert "after its packages imported" in reason
