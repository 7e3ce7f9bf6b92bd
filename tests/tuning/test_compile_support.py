"""Whether torch.compile can build CUDA code here, read as torch decides it: triton installed, every
GPU at compute capability 7.0 or more, TORCH_COMPILE_DISABLE not 1."""

from __future__ import annotations

import pytest

from whichdevice.core.packages import simulated_packages
from whichdevice.core.records import DeviceInfo, ProbeResult
from whichdevice.tuning.compile_support import cannot_compile_here


def _gpus(*capabilities: tuple[int, int] | None) -> ProbeResult:
    devices = tuple(DeviceInfo(index=i, name="GPU", capability=c) for i, c in enumerate(capabilities))
    return ProbeResult("cuda", True, True, device_count=len(devices), devices=devices, variant="cuda")


def test_triton_and_a_recent_gpu_compile() -> None:
    with simulated_packages({"triton": "simulated"}):
        assert cannot_compile_here(_gpus((9, 0), (8, 0))) is None


def test_the_oldest_gpu_decides_and_an_unknown_one_refuses() -> None:
    with simulated_packages({"triton": "simulated"}):
        mixed = cannot_compile_here(_gpus((9, 0), (6, 1)))
        unknown = cannot_compile_here(_gpus(None))
    assert mixed is not None and "a GPU here has compute capability 6.1" in mixed
    assert unknown is not None and "an unknown compute capability" in unknown


def test_without_triton_it_names_the_package() -> None:
    with simulated_packages({"triton": None}):
        why = cannot_compile_here(_gpus((9, 0)))
    assert why is not None and "pip install triton" in why


@pytest.mark.parametrize(("value", "off"), [("1", True), ("0", False), ("", False), ("true", False)])
def test_torch_compile_disable_is_read_as_torch_reads_it(
    monkeypatch: pytest.MonkeyPatch, value: str, off: bool
) -> None:
    # torch/_dynamo/config.py: disable = os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", value)
    with simulated_packages({"triton": "simulated"}):
        why = cannot_compile_here(_gpus((9, 0)))
    assert (why is not None and "TORCH_COMPILE_DISABLE=1" in why) is off
