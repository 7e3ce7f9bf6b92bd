"""Which GPUs this process can use: compute modes, the processes that hold a GPU, and the trial in a child.

The rules are pure (hardware/probes/compute_mode.py); the readers are exercised against a real
nvidia-smi stand-in on PATH and a CPU torch made to look like a CUDA build, and the trial child runs
for real (on a CPU build its torch says CUDA is not compiled in).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice.hardware.probes import cuda_trial, nvidia
from whichdevice.hardware.probes.common import DeviceReading
from whichdevice.hardware.probes.compute_mode import needs_trial, unusable_reason
from whichdevice.hardware.probes.nvidia import COMPUTE_MODES, NvidiaStack
from whichdevice.testing import simulate
from whichdevice.testing.readings import BUSY_GPU_TEXT

GiB = 1024**3


# ----------------------------------------------------------------------------------- the rules


@pytest.mark.parametrize(
    ("reading", "usable", "words"),
    [
        (DeviceReading(compute_mode="default", other_processes=3), True, ()),
        (DeviceReading(compute_mode=None, other_processes=3), True, ()),
        (DeviceReading(compute_mode="prohibited"), False, ("Prohibited", "-c DEFAULT")),
        (DeviceReading(compute_mode="exclusive_process", trial=""), True, ()),
        (DeviceReading(compute_mode="exclusive_process", other_processes=1, trial=""), True, ()),
        (DeviceReading(compute_mode="exclusive_process", own_context=True, other_processes=0), True, ()),
        (DeviceReading(compute_mode="exclusive_process", other_processes=0), True, ()),
        (DeviceReading(compute_mode="exclusive_process"), True, ()),
        (
            DeviceReading(compute_mode="exclusive_process", other_processes=1),
            False,
            ("exclusive-process", "1 other process", "NVML lists 1"),
        ),
        (
            DeviceReading(compute_mode="exclusive_process", other_processes=0, trial=BUSY_GPU_TEXT),
            False,
            ("another process holds it", "child process", "busy or unavailable"),
        ),
        (DeviceReading(compute_mode="exclusive_thread", other_processes=2), False, ("2 other processes",)),
    ],
)
def test_which_gpus_this_process_can_use(reading: DeviceReading, usable: bool, words: tuple[str, ...]) -> None:
    reason = unusable_reason(reading)
    assert (reason is None) is usable
    for word in words:
        assert reason is not None and word in reason


def test_only_exclusive_gpus_this_process_does_not_hold_are_tried() -> None:
    assert needs_trial(DeviceReading(compute_mode="exclusive_process"))
    assert needs_trial(DeviceReading(compute_mode="exclusive_thread", other_processes=0))
    assert not needs_trial(DeviceReading(compute_mode="exclusive_process", own_context=True))
    assert not needs_trial(DeviceReading(compute_mode="exclusive_process", trial=""))
    assert not needs_trial(DeviceReading(compute_mode="default"))
    assert not needs_trial(DeviceReading(compute_mode="prohibited"))
    assert not needs_trial(DeviceReading())


# ------------------------------------------------------------------------- simulated machines


def test_a_held_exclusive_gpu_is_listed_and_marked_unusable() -> None:
    with simulate("cuda:4,held=79GiB/1GiB,compute=default/exclusive"):
        result = wd.probe("cuda")
    assert result.available and result.device_count == 4
    modes = [d.compute_mode for d in result.devices]
    assert modes == ["default", "exclusive_process", "default", "default"]
    assert [d.other_processes for d in result.devices] == [1, 1, 0, 0]
    assert [d.free_memory for d in result.devices] == [1 * GiB, 79 * GiB, 80 * GiB, 80 * GiB]
    assert result.devices[0].unusable is None  # busy, but in the default mode it takes a context
    reason = result.devices[1].unusable
    assert reason is not None and "busy or unavailable" in reason and "child process" in reason
    assert result.devices[1].to_dict()["unusable"] == reason


def test_a_free_exclusive_gpu_is_usable() -> None:
    with simulate("cuda:2,compute=exclusive"):
        result = wd.probe("cuda")
    assert [d.unusable for d in result.devices] == [None, None]
    assert [d.compute_mode for d in result.devices] == ["exclusive_process"] * 2


def test_visible_devices_select_among_the_simulated_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    with simulate("cuda:4,compute=default/prohibited"):
        result = wd.probe("cuda")
    assert [d.physical_id for d in result.devices] == ["1", "2"]
    assert result.devices[0].unusable is not None and "Prohibited" in result.devices[0].unusable
    assert result.devices[1].unusable is None


def test_every_gpu_unusable_makes_cuda_unavailable_and_detection_goes_on() -> None:
    with simulate("cuda:2,compute=exclusive,held=1GiB", "cpu"):
        result = wd.probe("cuda")
        res = wd.resolve_device()
    assert not result.available and result.reason is not None
    assert "every visible GPU is unusable" in result.reason and "cuda:1 (1)" in result.reason
    assert res.device == "cpu"
    assert any(s.topic == "cuda" and "every visible GPU is unusable" in s.message for s in res.trace)


# --------------------------------------------------------------------------------- the readers


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_nvidia_smi_gives_the_compute_mode_and_the_holders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in nvidia-smi on PATH answering the two queries the reader makes, in nvidia-smi's CSV.
    me = os.getpid()
    _executable(
        tmp_path / "nvidia-smi",
        f"""#!{sys.executable}
import sys
if any(a.startswith("--query-compute-apps") for a in sys.argv):
    print("GPU-aaa, 4242")
    print("GPU-bbb, {me}")
    print("GPU-bbb, 777")
else:
    print("NVIDIA A100-SXM4-80GB, 81920, 8.0, GPU-aaa, 580.65.06, 1024, Exclusive_Process")
    print("NVIDIA A100-SXM4-80GB, 81920, 8.0, GPU-bbb, 580.65.06, 40960, Default")
    print("NVIDIA A100-SXM4-80GB, 81920, 8.0, GPU-ccc, 580.65.06, 81920, Prohibited")
""",
    )
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    stack = nvidia.smi_devices()
    assert stack.driver == "580.65.06"
    assert [d.compute_mode for d in stack.devices] == ["exclusive_process", "default", "prohibited"]
    assert [d.other_processes for d in stack.devices] == [1, 1, 0]
    assert [d.own_context for d in stack.devices] == [False, True, False]
    assert stack.devices[0].free == 1024 * 1024**2


def test_compute_mode_names_are_nvml_names() -> None:
    # nvidia-smi prints NVML's names capitalised; simulate's compute= takes the same.
    assert set(COMPUTE_MODES.values()) == {"default", "exclusive_thread", "prohibited", "exclusive_process"}
    pynvml = pytest.importorskip("pynvml")
    assert {getattr(pynvml, f"NVML_COMPUTEMODE_{name.upper()}"): name for name in COMPUTE_MODES.values()} == (
        COMPUTE_MODES
    )


def test_the_driver_is_not_asked_without_its_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvidia, "_DRIVER_LIBRARY", {sys.platform: "libcuda-that-is-not-here.so.1"})
    assert nvidia.driver_compute_modes(3) == (None, None, None)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """This CPU torch made to look like a CUDA build with 4 GPUs behind NVML; the trials asked for."""
    import torch

    def count() -> int:  # as torch counts: the GPUs CUDA_VISIBLE_DEVICES leaves
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return 4 if visible is None else len(visible.split(","))

    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", count, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", count)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    gpus = [
        DeviceReading("NVIDIA A100-SXM4-80GB", 80 * GiB, (8, 0), f"GPU-{i}", free=80 * GiB, compute_mode=mode, **extra)
        for i, (mode, extra) in enumerate(
            [
                ("default", {"other_processes": 0}),
                ("exclusive_process", {"other_processes": 0}),
                ("exclusive_process", {"other_processes": 0, "own_context": True}),
                ("exclusive_process", {"other_processes": 0}),
            ]
        )
    ]
    monkeypatch.setattr(nvidia, "nvml_devices", lambda: NvidiaStack(tuple(gpus), "580.65.06"))
    tried: list[list[int]] = []

    def trial(indices: list[int], timeout: float = 0) -> dict[int, str | None]:
        tried.append(list(indices))
        return {i: BUSY_GPU_TEXT if i == 1 else "" for i in indices}

    monkeypatch.setattr(cuda_trial, "try_contexts", trial)
    return tried


def test_the_reader_tries_only_exclusive_gpus_it_does_not_hold(fake_cuda: list[list[int]]) -> None:
    result = wd.probe("cuda")
    assert fake_cuda == [[1, 3]]
    assert [d.unusable is None for d in result.devices] == [True, False, True, True]


def test_the_trial_follows_the_visible_numbering(fake_cuda: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    result = wd.probe("cuda")
    # visible 0 is physical 3 and visible 1 physical 1: the child numbers them as torch here does
    assert fake_cuda == [[0, 1]]
    assert [d.physical_id for d in result.devices] == ["3", "1"]
    assert result.devices[1].unusable is not None


# ---------------------------------------------------------------------------------- the child


def test_the_trial_runs_in_a_child_and_leaves_cuda_alone_here() -> None:
    import torch

    said = cuda_trial.try_contexts([0])
    assert set(said) == {0}
    if not torch.backends.cuda.is_built():
        assert said[0] is not None and "not compiled with CUDA" in said[0]
    assert not torch.cuda.is_initialized()


def test_a_trial_that_gives_no_answer_is_no_evidence() -> None:
    assert cuda_trial.try_contexts([0, 1], timeout=0.001) == {0: None, 1: None}
    assert cuda_trial.try_contexts([]) == {}


def test_after_the_users_cuda_init_the_driver_gives_the_mode_and_no_exclusive_gpu_is_taken(
    fake_cuda: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With CUDA started in the process, the probe asks the driver for the modes (no context made),
    asks torch for free memory only where that takes no exclusive GPU, and tries the others in a child."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    props = types.SimpleNamespace(name="NVIDIA A100-SXM4-80GB", total_memory=80 * GiB, major=8, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    asked: list[int] = []

    def mem_get_info(index: int) -> tuple[int, int]:
        asked.append(index)
        return (70 * GiB, 80 * GiB)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: i == 2, raising=False)
    modes = ("default", "exclusive_process", "exclusive_process", "prohibited")
    monkeypatch.setattr(nvidia, "driver_compute_modes", lambda count: modes[:count])
    result = wd.probe("cuda", refresh=True)
    assert asked == [0, 2]  # cuda:2 is this process's own: asking makes no new context
    assert fake_cuda == [[1]]  # the exclusive GPU this process does not hold, tried in a child
    assert [d.compute_mode for d in result.devices] == list(modes)
    assert [d.free_memory for d in result.devices] == [70 * GiB, None, 70 * GiB, None]
    assert [d.unusable is None for d in result.devices] == [True, False, True, False]
