"""Compatibility checks before a run: GPU architecture against the build's kernels, the NVIDIA driver
against the build's CUDA, torch against a vendor plugin's torch; in the report and in `check`."""

from __future__ import annotations

import json

import pytest

import whichdevice as wd
from whichdevice import cli
from whichdevice.core.errors import DeviceError, DeviceUnavailableError
from whichdevice.hardware import probing
from whichdevice.hardware.compatibility import MIN_DRIVER, arch_problem, driver_problem, kernels_cover, plugin_problem
from whichdevice.report import check, gather
from whichdevice.testing import parse_spec, simulate
from whichdevice.testing.readings import RUNTIME_TEXTS

# torch 2.14.1+cu130's torch.cuda.get_arch_list()
CU130 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")


@pytest.mark.parametrize(
    ("capability", "archs", "runs"),
    [
        ((8, 0), CU130, True),
        ((8, 9), CU130, True),  # sm_86 cubins run on 8.9 (same major, newer minor)
        ((12, 1), CU130, True),
        ((7, 0), CU130, False),  # older than every cubin, no PTX
        ((12, 0), ("sm_80", "sm_90"), False),  # a new GPU on an old build
        ((12, 0), ("sm_80", "compute_90"), True),  # PTX is compiled by the driver for newer GPUs
        ((9, 0), ("sm_90a",), True),
        ((9, 1), ("sm_90a",), False),  # arch-specific cubins run on that one architecture only
    ],
)
def test_kernels_cover(capability: tuple[int, int], archs: tuple[str, ...], runs: bool) -> None:
    assert kernels_cover(capability, archs) is runs


def test_arch_problem_says_the_error_and_the_fix() -> None:
    text = arch_problem([(12, 0), (8, 0)], ("sm_80", "sm_90"), "12.6")
    assert text is not None
    for part in ("12.0 (sm_120)", "CUDA 12.6", "sm_80 sm_90", "no kernel image is available", "get_arch_list"):
        assert part in text
    assert "8.0" not in text.split(":")[0]  # the A100 has kernels
    assert arch_problem([(8, 0)], (), "12.6") is None  # arch list not read: nothing to say


def test_driver_table_and_problem() -> None:
    # NVIDIA's minimum drivers under minor version compatibility (CUDA 13.x >= 580, 12.x >= 525).
    assert MIN_DRIVER[13].startswith("580.") and MIN_DRIVER[12].startswith("525.")
    assert driver_problem("580.95.05", "13.0") is None
    assert driver_problem("535.104.05", "12.8") is None
    text = driver_problem("550.54.15", "13.0")
    assert text is not None
    assert "550.54.15" in text and "580.65.06" in text and "CUDA 12.x" in text and "upgrade the NVIDIA driver" in text
    assert driver_problem("470.82.01", "12.1") is not None
    assert driver_problem(None, "13.0") is None and driver_problem("550.54.15", None) is None


def test_plugin_problem() -> None:
    assert plugin_problem("torch-npu", "2.13.0", "2.13.0+cpu", "==2.13.0.*") is None  # the local label is the build
    text = plugin_problem("torch-npu", "2.13.0", "2.12.1", "==2.13.0.*")
    assert text is not None and "pip install 'torch==2.13.0.*'" in text
    # torch_xla says nothing in its metadata; its X.Y goes with torch X.Y
    assert plugin_problem("torch_xla", "2.9.0", "2.9.0", None) is None
    assert "torch==2.9.*" in (plugin_problem("torch_xla", "2.9.0", "2.14.1+cu130", None) or "")
    assert plugin_problem("torch-npu", "2.13.0", "2.12.1", None) is None  # no pin: nothing to check


def test_spec_keys() -> None:
    sim = parse_spec("cuda:2,cc=12.0,arch=sm_80+SM_90+compute_90,driver=550.54.15,cuda=12.6")
    assert sim.arch == ("sm_80", "sm_90", "compute_90") and sim.driver == "550.54.15" and sim.cuda == "12.6"
    assert parse_spec("cuda,driver=None").driver == "none"
    for bad, says in [
        ("cuda,driver=550.54.15", "cuda=13.0"),
        ("cuda,arch=ampere", "not like sm_90"),
        ("cuda,variant=rocm,arch=sm_80", "variant=rocm"),
        ("npu,driver=none", "applies to cuda"),
    ]:
        with pytest.raises(DeviceError, match=says):
            parse_spec(bad)


def test_simulated_no_driver_says_what_torch_says() -> None:
    with simulate("cuda,driver=none"):
        result = probing.probe("cuda")
        with pytest.raises(DeviceUnavailableError) as err:
            wd.resolve_device("cuda")
        answer = check("cuda", simulate=())
    assert not result.available and result.installed
    assert RUNTIME_TEXTS["cuda-no-driver"] in (result.reason or "")
    assert "install the NVIDIA driver" in str(err.value) and "--gpus" in str(err.value)
    assert answer["exit_code"] == 1 and "no NVIDIA driver" in answer["message"]


def test_check_fails_on_a_new_gpu_with_an_old_build() -> None:
    spec = "cuda:2,cc=12.0,arch=sm_80+sm_90,cuda=12.6"
    answer = check("cuda", simulate=(spec,))
    assert answer["exit_code"] == 1 and not answer["ok"]
    assert "no kernel image is available" in answer["message"] and "sm_120" in answer["message"]
    # Asked for explicitly, the resolution refuses too, naming the build to install.
    with simulate(spec), pytest.raises(DeviceUnavailableError) as err:
        wd.resolve_device("cuda")
    assert "sm_120" in str(err.value) and "get_arch_list" in str(err.value) and "cpu" in str(err.value)
    assert check("cuda", simulate=("cuda:2,cc=9.0,arch=sm_80+sm_90,cuda=12.6",))["exit_code"] == 0


def test_driver_too_old_in_report_and_check(capsys: pytest.CaptureFixture[str]) -> None:
    spec = "cuda,driver=550.54.15,cuda=13.0"
    report = gather(simulate=(spec,))
    row = next(r for r in report["backends"] if r["name"] == "cuda")
    assert row["versions"]["nvidia-driver"] == "550.54.15" and row["versions"]["cuda"] == "13.0"
    assert row["incompatible"] and "580.65.06" in row["incompatible"][0]
    assert any(w["source"] == "compatibility:cuda" for w in report["warnings"])
    assert cli.main(["check", "cuda", "--simulate", spec, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert "older than this torch build's CUDA 13.0 needs" in out["message"]
    assert check("cuda", simulate=("cuda,driver=580.95.05,cuda=13.0",))["exit_code"] == 0


def test_plugin_built_for_another_torch() -> None:
    packages = {"torch": "2.12.1", "torch-npu": "2.13.0"}
    with simulate("npu:2", packages=packages):
        result = probing.probe("npu")
    assert result.available and "torch==2.13.0.*" in result.incompatible[0]
    with simulate("npu:2", packages={"torch": "2.13.0", "torch-npu": "2.13.0"}):
        assert probing.probe("npu").incompatible == ()
    # A broken import says the mismatch is the likely cause, and the CANN toolkit when it names one.
    with simulate("npu,broken", packages=packages):
        reason = probing.probe("npu").reason or ""
    assert RUNTIME_TEXTS["npu-no-cann"] in reason and "torch==2.13.0.*" in reason and "CANN" in reason


def test_no_gpu_reason_is_one_sentence_without_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    from whichdevice.report import render_text

    with simulate("cuda:0"):
        reason = probing.probe("cuda").reason or ""
    assert reason.endswith("build and finds no NVIDIA GPU: run on a machine (or container) that has one")
    text = render_text(gather(simulate=("cuda,driver=none",)), color=False, width=1000)
    line = next(x for x in text.splitlines() if x.strip().startswith("! cuda"))
    assert "no NVIDIA driver" in line and "(install:" not in line  # torch is installed: no hint to install it
    # A visible-devices variable that names a GPU the machine lacks: the probe says so, then the variable.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with simulate("cuda:2"), pytest.raises(DeviceUnavailableError) as err:
        wd.resolve_device("cuda")
    assert "finds no NVIDIA GPU among the visible devices; CUDA_VISIBLE_DEVICES='5' names device(s) 5" in str(err.value)


BLACKWELL_ON_OLD_BUILD = "cuda:1,cc=12.0,name=NVIDIA RTX PRO 6000 Blackwell,mem=96GiB,arch=sm_80+sm_90"


@pytest.mark.parametrize(
    ("spec", "says"),
    [(BLACKWELL_ON_OLD_BUILD, "no kernel image is available"), ("cuda:1,cc=8.0,driver=470.0,cuda=12.4", "525.60.13")],
)
def test_detection_skips_a_backend_the_stack_cannot_run(spec: str, says: str) -> None:
    with simulate(spec):
        res = wd.resolve_device()
        with pytest.raises(DeviceUnavailableError) as err:
            wd.resolve_device("cuda:0")
    assert res.backend.name == "cpu"
    step = next(s for s in res.trace if s.topic == "cuda")
    assert step.chosen is False and says in step.message
    assert says in str(err.value) and "This machine can use: cpu" in str(err.value)


def test_a_plugin_built_for_another_torch_is_not_chosen() -> None:
    with simulate("npu:2", packages={"torch": "2.12.1", "torch-npu": "2.13.0"}):
        res = wd.resolve_device()
        with pytest.raises(DeviceUnavailableError, match=r"torch==2\.13\.0\.\*"):
            wd.resolve_device("npu")
    assert res.backend.name == "cpu"
