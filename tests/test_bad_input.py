"""The bad-input matrix: every wrong device string, environment, setting and package a user can hit.

Each case names the exception (``DeviceError`` or a subclass; on the command line exit code 2 for a
wrong request, 1 for hardware or packages that cannot do it) and the text that tells the user the
fix. Values a runtime silently misreads (``CUDA_VISIBLE_DEVICES=0,,2``) are not errors: they give the
device count the runtime would and a warning that names the fix, in the probe result, the trace and
the report. Hardware comes from ``whichdevice.testing.simulate``; packages from stubs on sys.path
and a patched version lookup. A dozen cases also run through the real ``whichdevice`` command.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import whichdevice as wd
from whichdevice import cli, report
from whichdevice.attention import kernels as kernels_support
from whichdevice.core import packages
from whichdevice.core.errors import (
    ConfigConflictError,
    DeviceError,
    DeviceUnavailableError,
    PackageVersionError,
    UnknownDeviceError,
)
from whichdevice.hardware.registry import backends
from whichdevice.testing import simulate
from whichdevice.training import arguments as training

# Variables that steer device choice: unset for every test here, so the host cannot change a case.
STEERING = sorted(
    {
        *(var for b in backends() for var in b.visible_devices_env),
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "HABANA_VISIBLE_MODULES",
        "HABANA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "WHICHDEVICE_DEVICE",
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "SLURM_LOCALID",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_NTASKS_PER_NODE",
    }
)

# What the command line answers for each kind of error: 2 the request is wrong, 1 it cannot be done here.
EXIT = {
    UnknownDeviceError: 2,
    ConfigConflictError: 2,
    DeviceError: 2,
    DeviceUnavailableError: 1,
    PackageVersionError: 1,
}

UUID = "GPU-8a1c6f3e-1111-2222-3333-444455556666"
MIG = "MIG-4f3e2d1c-0000-1111-2222-333344445555"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in STEERING:
        monkeypatch.delenv(name, raising=False)


def machine(specs: tuple[str, ...] | None) -> contextlib.AbstractContextManager[Any]:
    """``simulate(*specs)``; None means this machine as it is."""
    return contextlib.nullcontext() if specs is None else simulate(*specs)


def check_error(err: pytest.ExceptionInfo[BaseException], error: type[DeviceError], says: tuple[str, ...]) -> str:
    assert type(err.value) is error, f"{type(err.value).__name__}: {err.value}"
    assert isinstance(err.value, DeviceError)
    text = str(err.value)
    for fragment in says:
        assert fragment in text, f"{fragment!r} not in {text!r}"
    return text


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ================================================================================ device strings


class Bad(NamedTuple):
    value: Any
    machine: tuple[str, ...] | None  # simulated specs; None: this machine
    error: type[DeviceError]
    says: tuple[str, ...]  # what the message must contain: above all, the fix


DEVICE_VALUES = [
    pytest.param(Bad("", None, UnknownDeviceError, ("is empty", "'cuda:0'", "leave it out")), id="empty"),
    pytest.param(Bad(" ", None, UnknownDeviceError, ("is empty", "leave it out")), id="blank"),
    pytest.param(Bad("gpu", None, UnknownDeviceError, ("unknown device 'gpu'", "Did you mean 'cuda'?")), id="gpu"),
    pytest.param(Bad("GPU", None, UnknownDeviceError, ("Did you mean 'cuda'?",)), id="GPU"),
    pytest.param(Bad("Cuda", None, UnknownDeviceError, ("lower case", "write 'cuda'")), id="Cuda"),
    pytest.param(Bad("CUDA:1", None, UnknownDeviceError, ("lower case", "write 'cuda:1'")), id="CUDA:1"),
    pytest.param(Bad("CUDA:ABC", None, UnknownDeviceError, ("lower case", "write 'cuda'")), id="CUDA:ABC"),
    pytest.param(Bad("cuda:", None, UnknownDeviceError, ("index after ':' is missing", "'cuda:0'")), id="cuda:"),
    pytest.param(Bad("cuda:-1", None, UnknownDeviceError, ("start at 0", "'cuda:0'")), id="cuda:-1"),
    pytest.param(Bad("cuda:abc", None, UnknownDeviceError, ("'abc' is not a device index", "'cuda:0'")), id="cuda:abc"),
    pytest.param(Bad("cuda:1.0", None, UnknownDeviceError, ("'1.0' is not a device index", "'cuda:0'")), id="cuda:1.0"),
    pytest.param(
        Bad("cuda:\u0661", None, UnknownDeviceError, ("is not a device index", "'cuda:0'")), id="cuda:arabic-1"
    ),
    pytest.param(Bad("cuda:" + "9" * 5000, None, UnknownDeviceError, ("too large", "'cuda:0'")), id="cuda:huge"),
    pytest.param(Bad("cuda:0:1", None, UnknownDeviceError, ("one index", "write 'cuda:0'")), id="cuda:0:1"),
    pytest.param(Bad("cuda:abc:1", None, UnknownDeviceError, ("one index", "write 'cuda:0'")), id="cuda:abc:1"),
    pytest.param(Bad(" cuda ", None, UnknownDeviceError, ("surrounding spaces", "write 'cuda'")), id="spaced"),
    pytest.param(Bad(" gpu ", None, UnknownDeviceError, ("Did you mean 'cuda'?",)), id="spaced-gpu"),
    pytest.param(Bad("cuda 1", None, UnknownDeviceError, ("Did you mean 'cuda'?",)), id="cuda-space-1"),
    pytest.param(Bad("meta", None, UnknownDeviceError, ("unknown device 'meta'", "Valid device names: ")), id="meta"),
    pytest.param(
        Bad("cuda:99", ("cuda:2",), DeviceUnavailableError, ("index 99", "2 are visible", "use cuda:0..cuda:1")),
        id="cuda:99",
    ),
    pytest.param(Bad("hpu:x", ("hpu:8",), UnknownDeviceError, ("'x' is not a device index", "'hpu:0'")), id="hpu:x"),
    pytest.param(Bad("tpu:3", ("tpu:1",), DeviceUnavailableError, ("1 is visible", "use tpu:0")), id="tpu:3-one-chip"),
    pytest.param(
        Bad("npu", None, DeviceUnavailableError, ("torch-npu is not installed", "pip install torch-npu")),
        id="npu-not-installed",
        marks=pytest.mark.skipif(find_spec("torch_npu") is not None, reason="torch_npu is installed here"),
    ),
    pytest.param(
        Bad("npu", ("npu,broken",), DeviceUnavailableError, ("installed but broken", "pip install torch-npu")),
        id="npu-broken",
    ),
    pytest.param(Bad(0, None, UnknownDeviceError, ("not int", "write 'cuda:0'")), id="int-0"),
    pytest.param(Bad(1.0, None, UnknownDeviceError, ("not float", "'cuda:1'")), id="float"),
    pytest.param(Bad(True, None, UnknownDeviceError, ("not bool", "'cuda:1'")), id="bool"),
    pytest.param(Bad(b"cuda", None, UnknownDeviceError, ("not bytes", "'cuda'")), id="bytes"),
    pytest.param(Bad(["cuda"], None, UnknownDeviceError, ("not list", "'cuda'")), id="list"),
    pytest.param(
        Bad(torch.device("cuda", 5), ("cuda:2",), DeviceUnavailableError, ("index 5", "use cuda:0..cuda:1")),
        id="torch.device-cuda:5",
    ),
    pytest.param(
        Bad(torch.device("meta"), None, UnknownDeviceError, ("unknown device 'meta'",)), id="torch.device-meta"
    ),
]

STRING_VALUES = [p for p in DEVICE_VALUES if isinstance(p.values[0].value, str) and p.values[0].value.strip()]


@pytest.mark.parametrize("case", DEVICE_VALUES)
def test_device_argument(case: Bad) -> None:
    with machine(case.machine), pytest.raises(DeviceError) as err:
        wd.resolve_device(case.value)
    check_error(err, case.error, case.says)


@pytest.mark.parametrize("case", STRING_VALUES)
def test_device_from_whichdevice_device(case: Bad, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same values in WHICHDEVICE_DEVICE: the same error, and it names the variable."""
    monkeypatch.setenv("WHICHDEVICE_DEVICE", case.value)
    with machine(case.machine), pytest.raises(DeviceError) as err:
        wd.resolve_device()
    text = check_error(err, case.error, case.says)
    assert "WHICHDEVICE_DEVICE" in text


@pytest.mark.parametrize("case", [p for p in DEVICE_VALUES if isinstance(p.values[0].value, str)])
def test_device_on_the_command_line(case: Bad, capsys: pytest.CaptureFixture[str]) -> None:
    specs = [arg for spec in case.machine or () for arg in ("--simulate", spec)]
    code, out, err = run_cli([*specs, "check", case.value], capsys)
    assert code == EXIT[case.error], err
    assert out == "" and "Traceback" not in err
    assert err.startswith("whichdevice check: ")
    for fragment in case.says:
        assert fragment in err


VALID_TORCH_DEVICES = [
    (torch.device("cuda", 1), ("cuda:2",), "cuda:1"),
    (torch.device("cuda"), ("cuda:2",), "cuda:0"),
    (torch.device("cpu"), None, "cpu"),
    (torch.device("xpu", 0), ("xpu:2",), "xpu:0"),
    (torch.device("hpu"), ("hpu:8",), "hpu"),
    (torch.device("mps"), ("mps",), "mps"),
]


@pytest.mark.parametrize(("value", "specs", "device"), VALID_TORCH_DEVICES, ids=str)
def test_valid_torch_devices_are_accepted(value: torch.device, specs: tuple[str, ...] | None, device: str) -> None:
    with machine(specs):
        assert wd.resolve_device(value).device == device


# Other arguments that name devices or choices: None or a wrong type where a device is required, ...
ARGUMENTS = [
    pytest.param(lambda: wd.parse_device(None), UnknownDeviceError, ("not NoneType", "'cuda'"), id="parse-None"),
    pytest.param(lambda: wd.resolve_device(prefer=[None]), UnknownDeviceError, ("prefer=None",), id="prefer-None"),
    pytest.param(lambda: wd.resolve_device(prefer="gpu"), UnknownDeviceError, ("Did you mean 'cuda'?",), id="prefer"),
    pytest.param(lambda: wd.resolve_device(exclude=0), UnknownDeviceError, ("exclude=0", "'cuda:0'"), id="exclude-0"),
    pytest.param(
        lambda: wd.training_arguments("out", device="gpu"), UnknownDeviceError, ("Did you mean 'cuda'?",), id="ta-gpu"
    ),
    pytest.param(lambda: wd.resolve_device(task="train"), DeviceError, ("'inference' or 'training'",), id="task"),
    pytest.param(lambda: wd.resolve_device(dtype="bf17"), DeviceError, ("'bfloat16'",), id="dtype"),
    pytest.param(
        lambda: wd.resolve_device(attn_implementation="flash"), DeviceError, ("flash_attention_2",), id="attention"
    ),
    pytest.param(
        lambda: wd.resolve_device(use_kernels="yes"), ConfigConflictError, ("'auto', True or False",), id="kernels"
    ),
    pytest.param(lambda: wd.resolve_device(max_memory={"cpu": "lots"}), DeviceError, ("'20GiB'",), id="max-memory"),
    pytest.param(lambda: simulate("gpu:2"), DeviceError, ("Did you mean 'cuda'?",), id="simulate-gpu"),
    pytest.param(lambda: simulate(None), DeviceError, ("'cuda:4'",), id="simulate-None"),
]


@pytest.mark.parametrize(("call", "error", "says"), ARGUMENTS)
def test_bad_arguments(call: Callable[[], object], error: type[DeviceError], says: tuple[str, ...]) -> None:
    with pytest.raises(DeviceError) as err:
        call()
    check_error(err, error, says)


# =================================================================================== environment


class Misread(NamedTuple):
    value: str
    count: int  # GPUs the runtime shows on a machine with four
    warning: tuple[str, ...]  # in the probe's warnings, the trace and the report; names the fix
    fix: tuple[str, ...]  # in the error for resolve_device("cuda:<count>")


CUDA_VISIBLE = [
    pytest.param(Misread("", 0, ("set but empty",), ("unset CUDA_VISIBLE_DEVICES",)), id="empty"),
    pytest.param(Misread("-1", 0, ("=-1 hides every GPU",), ("unset CUDA_VISIBLE_DEVICES",)), id="-1"),
    pytest.param(
        Misread(
            "0,,2",
            1,
            ("stops reading at ''", "visible GPUs are: 0", "write CUDA_VISIBLE_DEVICES=0,2"),
            ("because CUDA_VISIBLE_DEVICES='0,,2'", "use cuda:0", "change CUDA_VISIBLE_DEVICES"),
        ),
        id="0,,2",
    ),
    pytest.param(Misread("0,0", 0, ("repeats GPU 0", "list each GPU once"), ("unset CUDA_VISIBLE_DEVICES",)), id="0,0"),
    pytest.param(
        Misread(
            "abc",
            0,
            ("stops reading at 'abc'", "unset CUDA_VISIBLE_DEVICES or list GPU indices"),
            ("unset CUDA_VISIBLE_DEVICES",),
        ),
        id="abc",
    ),
    pytest.param(
        Misread(UUID, 0, (f"names device(s) {UUID} that this machine lacks",), ("fix or unset CUDA_VISIBLE_DEVICES",)),
        id="GPU-uuid",
    ),
    pytest.param(
        Misread(MIG, 0, (f"names device(s) {MIG} that this machine lacks",), ("fix or unset CUDA_VISIBLE_DEVICES",)),
        id="MIG-uuid",
    ),
    pytest.param(
        Misread(" 0,1 ", 2, ("surrounding spaces", "read as '0,1'"), ("2 are visible", "use cuda:0..cuda:1")),
        id="spaces",
    ),
    pytest.param(Misread("1gpu", 1, ("reads '1gpu' as 1", "write 1"), ("use cuda:0",)), id="1gpu"),
    pytest.param(
        Misread("0,1,7", 2, ("names device(s) 7 that this machine lacks",), ("use cuda:0..cuda:1",)), id="missing-7"
    ),
]


@pytest.mark.parametrize("case", CUDA_VISIBLE)
def test_cuda_visible_devices_is_read_as_the_runtime_reads_it(case: Misread, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", case.value)
    with simulate("cuda:4"):
        result = wd.probe("cuda")
        assert result.device_count == case.count
        assert result.available == (case.count > 0)
        for fragment in case.warning:
            assert any(fragment in w for w in result.warnings), (fragment, result.warnings)
        if case.count:
            trace = wd.resolve_device().explain()
            for fragment in case.warning:
                assert fragment in trace
        with pytest.raises(DeviceError) as err:
            wd.resolve_device(f"cuda:{case.count}")
        text = check_error(err, DeviceUnavailableError, case.fix)
        assert "CUDA_VISIBLE_DEVICES" in text
    # The report says it too (in its own words where every GPU is hidden).
    data = report.gather(simulate=["cuda:4"])
    assert any(w["message"].startswith(f"CUDA_VISIBLE_DEVICES={case.value!r}") for w in data["warnings"])


class BadEnv(NamedTuple):
    env: dict[str, str]
    machine: tuple[str, ...] | None
    device: str | None  # what resolve_device is asked for (None: detect)
    error: type[DeviceError]
    says: tuple[str, ...]


ENVIRONMENTS = [
    pytest.param(
        BadEnv(
            {"HABANA_VISIBLE_MODULES": "0,x"},
            ("hpu:8",),
            "hpu",
            DeviceError,
            ("HABANA_VISIBLE_MODULES='0,x'", "such as HABANA_VISIBLE_MODULES=0,1"),
        ),
        id="habana-modules-malformed",
    ),
    pytest.param(
        BadEnv(
            {"ASCEND_RT_VISIBLE_DEVICES": "0,0"}, ("npu:8",), "npu", DeviceError, ("twice", "list each device once")
        ),
        id="ascend-repeated",
    ),
    pytest.param(
        BadEnv(
            {"LOCAL_RANK": "abc"},
            ("cuda:2",),
            None,
            DeviceError,
            ("LOCAL_RANK='abc' is not a whole number", "unset it"),
        ),
        id="local-rank-abc",
    ),
    pytest.param(
        BadEnv({"LOCAL_RANK": "-2"}, ("cuda:2",), None, DeviceError, ("LOCAL_RANK='-2' must be 0 or more", "unset it")),
        id="local-rank--2",
    ),
    pytest.param(
        BadEnv(
            {"LOCAL_RANK": "2", "RANK": "2", "WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1"},
            ("cuda:8",),
            None,
            DeviceUnavailableError,
            ("LOCAL_RANK=2", "CUDA_VISIBLE_DEVICES='0,1'", "--nproc_per_node=2"),
        ),
        id="local-rank-beyond-visible",
    ),
    pytest.param(
        BadEnv(
            {"LOCAL_RANK": "4", "RANK": "4", "WORLD_SIZE": "8"},
            ("hpu:4",),
            None,
            DeviceUnavailableError,
            ("LOCAL_RANK=4", "only 4 hpu device(s)", "--nproc_per_node=4"),
        ),
        id="local-rank-beyond-gaudis",
    ),
    pytest.param(
        BadEnv(
            {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"},
            ("cuda:4",),
            None,
            DeviceError,
            ("WORLD_SIZE=2 is smaller than LOCAL_WORLD_SIZE=4", "check the launch command"),
        ),
        id="world-smaller-than-local-world",
    ),
    pytest.param(
        BadEnv(
            {"LOCAL_RANK": "1"},
            ("cuda:2",),
            None,
            DeviceError,
            ("WORLD_SIZE (unset: 1)", "set WORLD_SIZE too or unset LOCAL_RANK"),
        ),
        id="local-rank-without-world-size",
    ),
    pytest.param(
        BadEnv(
            {"WHICHDEVICE_DEVICE": "npu"},
            (),
            None,
            DeviceUnavailableError,
            ("WHICHDEVICE_DEVICE='npu'", "pip install torch-npu", "Fix or unset WHICHDEVICE_DEVICE"),
        ),
        id="whichdevice-device-absent",
    ),
    pytest.param(
        BadEnv(
            {"WHICHDEVICE_DEVICE": "cuda:5"},
            ("cuda:2",),
            None,
            DeviceUnavailableError,
            ("WHICHDEVICE_DEVICE 'cuda:5'", "use cuda:0..cuda:1", "Fix or unset WHICHDEVICE_DEVICE"),
        ),
        id="whichdevice-device-index",
    ),
]


@pytest.mark.parametrize("case", ENVIRONMENTS)
def test_bad_environment(case: BadEnv, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    with machine(case.machine), pytest.raises(DeviceError) as err:
        wd.resolve_device(case.device, task="training")
    check_error(err, case.error, case.says)
    specs = [arg for spec in case.machine or () for arg in ("--simulate", spec)]
    code, _out, stderr = run_cli([*specs, "check", *([case.device] if case.device else [])], capsys)
    assert code == EXIT[case.error], stderr
    assert all(fragment in stderr for fragment in case.says), stderr


def test_gaudi_modules_outside_the_supported_group_sizes_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "0,1,2")
    with simulate("hpu:8"):
        result = wd.probe("hpu")
        trace = wd.resolve_device(task="training").explain()
    assert result.device_count == 3
    warning = "HABANA_VISIBLE_MODULES='0,1,2' selects 3 Gaudi devices"
    assert any(warning in w and "groups of 2 or 4" in w for w in result.warnings)
    assert warning in trace
    # The fix names the tool that maps the indices HABANA_VISIBLE_DEVICES takes to the module ids.
    assert "hl-smi -Q index,module_id -f csv" in trace
    assert any("hl-smi -Q index,module_id -f csv" in w for w in result.warnings)


def test_gaudi_variables_that_disagree_warn_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "0,1")
    monkeypatch.setenv("HABANA_VISIBLE_DEVICES", "2,3")
    with simulate("hpu:8"):
        result = wd.probe("hpu")
        trace = wd.resolve_device().explain()
    assert result.device_count == 2
    assert [d.physical_id for d in result.devices] == ["0", "1"]  # the modules win
    [warning] = [w for w in result.warnings if "disagree" in w]
    assert "HABANA_VISIBLE_MODULES='0,1'" in warning and "HABANA_VISIBLE_DEVICES='2,3'" in warning
    assert "unset one of them" in warning
    assert warning in trace


def test_blank_whichdevice_device_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WHICHDEVICE_DEVICE", " ")
    assert wd.resolve_device().source == "detection"


# ===================================================================================== conflicts


class Conflict(NamedTuple):
    machine: tuple[str, ...]
    call: Callable[[str], object]  # given an output directory
    error: type[DeviceError]
    says: tuple[str, ...]


CONFLICTS = [
    pytest.param(
        Conflict(
            ("mps,macos=13.6",),
            lambda out: wd.training_arguments(out, bf16=True),
            ConfigConflictError,
            ("bf16=True does not work on mps", "macOS 14"),
        ),
        id="bf16-on-mps-before-macos-14",
    ),
    pytest.param(
        Conflict(
            ("neuron:2",),
            lambda out: wd.training_arguments(out, fp16=True),
            ConfigConflictError,
            ("fp16=True does not work on neuron", "pass bf16=True"),
        ),
        id="fp16-on-neuron",
    ),
    pytest.param(
        Conflict(
            ("tpu:4",),
            lambda out: wd.training_arguments(out, fp16=True),
            ConfigConflictError,
            ("fp16=True does not work on tpu", "pass bf16=True"),
        ),
        id="fp16-on-tpu",
    ),
    pytest.param(
        Conflict(
            ("hpu:8",),
            lambda out: wd.training_arguments(out, ddp_backend="nccl"),
            ConfigConflictError,
            ("ddp_backend='nccl' does not fit hpu", "use 'hccl'"),
        ),
        id="nccl-on-gaudi",
    ),
    pytest.param(
        Conflict(
            ("cuda:2",),
            lambda out: wd.training_arguments(out, ddp_backend="nccl"),
            ConfigConflictError,
            ("single process", "Leave ddp_backend out"),
        ),
        id="ddp-backend-in-one-process",
    ),
    pytest.param(
        Conflict(
            (),
            lambda out: wd.training_arguments(out, use_cpu=False, bf16=True),
            ConfigConflictError,
            ("use_cpu=False", "doesn't support bf16/gpu", "pass use_cpu=True"),
        ),
        id="use-cpu-false-with-bf16-without-accelerator",
    ),
    pytest.param(
        Conflict(
            ("hpu:8",),
            lambda out: wd.training_arguments(out, torch_compile=True, torch_compile_backend="inductor"),
            ConfigConflictError,
            ("'inductor' does not compile for hpu", "'hpu_backend'"),
        ),
        id="inductor-on-gaudi",
    ),
    pytest.param(
        Conflict(
            ("cuda:1",),
            lambda out: wd.training_arguments(out, torch_compile=True, torch_compile_backend="hpu_backend"),
            ConfigConflictError,
            ("'hpu_backend' compiles for hpu only", "torch_compile_backend='inductor'"),
        ),
        id="hpu-backend-on-cuda",
    ),
    pytest.param(
        Conflict(
            ("cuda:1",),
            lambda out: wd.training_arguments(out, device="cuda:0", use_cpu=True),
            ConfigConflictError,
            ("use_cpu=True contradicts", "device='cpu'"),
        ),
        id="use-cpu-true-on-gpu",
    ),
    pytest.param(
        Conflict(
            ("neuron:2",),
            lambda out: wd.resolve_device("neuron", device_map="auto"),
            ConfigConflictError,
            ("device_map='auto' does not work on neuron", "use device_map='neuron'"),
        ),
        id="neuron-device-map-auto",
    ),
    pytest.param(
        Conflict(
            ("neuron:2",),
            lambda out: wd.resolve_device("neuron").model_kwargs(device_map="auto"),
            ConfigConflictError,
            ("use device_map='neuron'",),
        ),
        id="neuron-model-kwargs-auto",
    ),
    pytest.param(
        Conflict(
            ("tpu:4",),
            lambda out: wd.resolve_device("tpu").pipeline_kwargs(device_map="balanced"),
            ConfigConflictError,
            ("device_map='balanced' does not work on tpu", "use device_map='tpu'"),
        ),
        id="tpu-pipeline-kwargs-balanced",
    ),
]


@pytest.mark.parametrize("case", CONFLICTS)
def test_conflicting_settings(case: Conflict, tmp_path: Path) -> None:
    with simulate(*case.machine), pytest.raises(DeviceError) as err:
        case.call(str(tmp_path))
    check_error(err, case.error, case.says)


# ====================================================================================== packages


@pytest.fixture
def stub_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], None]]:
    """Write a real package (``a.b`` -> a/__init__.py, a/b/__init__.py) on sys.path; forget it afterwards."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    tops: set[str] = set()

    def make(dotted: str, body: str) -> None:
        parts = dotted.split(".")
        path = root
        for i, part in enumerate(parts):
            path = path / part
            path.mkdir(exist_ok=True)
            (path / "__init__.py").write_text(textwrap.dedent(body) if i == len(parts) - 1 else "")
            monkeypatch.delitem(sys.modules, ".".join(parts[: i + 1]), raising=False)
        tops.add(parts[0])

    yield make
    for name in [m for m in sys.modules if m.split(".")[0] in tops]:
        del sys.modules[name]


@pytest.fixture
def installed_versions(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Make whichdevice's version lookup report other versions (None: not installed)."""
    with contextlib.ExitStack() as stack:

        def set_versions(**versions: str | None) -> None:
            stack.enter_context(packages.simulated_packages(versions))

        yield set_versions


BROKEN_PACKAGES = [
    ("torch_neuronx", "neuron", "libnrt.so.1: cannot open shared object file", "pip install torch-neuronx"),
    (
        "habana_frameworks.torch",
        "hpu",
        "libhl_thunk.so: cannot open shared object file",
        "pip install habana-torch-plugin",
    ),
]


@pytest.mark.parametrize(
    ("module", "backend", "failure", "install"), BROKEN_PACKAGES, ids=[b[1] for b in BROKEN_PACKAGES]
)
def test_installed_package_that_fails_to_import(
    stub_package: Callable[[str, str], None],
    monkeypatch: pytest.MonkeyPatch,
    module: str,
    backend: str,
    failure: str,
    install: str,
) -> None:
    # The Gaudi probe applies its env hook (PT_ENABLE_INT64_SUPPORT=1) before the import that fails
    # here; put the variable back afterwards whatever the probe leaves.
    monkeypatch.setenv("PT_ENABLE_INT64_SUPPORT", "")
    monkeypatch.delenv("PT_ENABLE_INT64_SUPPORT")
    stub_package(module, f"raise ImportError({failure!r})")
    with pytest.raises(DeviceError) as err:
        wd.resolve_device(backend)
    check_error(err, DeviceUnavailableError, (failure, "installed but broken", install))
    # Detection is not derailed: it says why and moves on.
    res = wd.resolve_device()
    assert res.backend.name != backend
    assert failure in res.explain()


@pytest.mark.parametrize("backend", ["npu", "hpu", "neuron", "mlu"])
def test_simulated_package_that_fails_to_import(backend: str) -> None:
    install = wd.get_backend(backend).install_command
    with simulate(f"{backend},broken"), pytest.raises(DeviceError) as err:
        wd.resolve_device(backend)
    check_error(err, DeviceUnavailableError, ("installed but broken", "reinstall it", install))


def test_accelerate_too_old_for_gaudi(
    stub_package: Callable[[str, str], None], installed_versions: Callable[..., None]
) -> None:
    # The real probe runs; it checks accelerate before importing the Gaudi stack, so this never runs.
    stub_package("habana_frameworks.torch", "raise AssertionError('imported before checking accelerate')")
    installed_versions(accelerate="1.4.0")
    with pytest.raises(DeviceError) as err:
        wd.resolve_device("hpu")
    check_error(
        err, DeviceUnavailableError, ("accelerate 1.4.0 is too old for Gaudi", "pip install 'accelerate>=1.5.0'")
    )
    data = report.gather()
    assert any("pip install 'accelerate>=1.5.0'" in w["message"] for w in data["warnings"])


def _kernels_outside_range() -> list[Any]:
    low, high = kernels_support.transformers_kernels_range()
    cases: list[Any] = [pytest.param(None, id="not-installed")]
    if low:
        cases.append(pytest.param("0.0.1", id="older"))
    if high:
        cases.append(pytest.param(high, id="newer"))
    return cases


@pytest.mark.parametrize("version", _kernels_outside_range())
def test_kernels_outside_the_range_transformers_accepts(
    version: str | None, installed_versions: Callable[..., None]
) -> None:
    installed_versions(kernels=version)
    with simulate("cuda:1"):
        with pytest.raises(DeviceError) as err:
            wd.resolve_device(use_kernels=True)
        check_error(err, ConfigConflictError, ("use_kernels=True cannot work here", "pip install 'kernels"))
        res = wd.resolve_device(use_kernels="auto")  # "auto" turns them off and says why
    assert not res.use_kernels
    assert "Hub kernels off" in res.explain() and "pip install 'kernels" in res.explain()
    if version is not None:
        data = report.gather(simulate=["cuda:1"])
        assert any(w["source"] == "kernels" and version in w["message"] for w in data["warnings"])


def test_transformers_older_than_supported(installed_versions: Callable[..., None], tmp_path: Path) -> None:
    installed_versions(transformers="4.56.2")
    fix = f"pip install 'transformers>={training.MIN_TRANSFORMERS}'"
    with pytest.raises(DeviceError) as err:
        wd.training_arguments(str(tmp_path))
    check_error(err, PackageVersionError, ("transformers 4.56.2 is older than whichdevice supports", fix))
    assert isinstance(err.value, ImportError)  # caught where optional imports are guarded
    # Resolving still works (the device answer does not depend on it) and warns, as does the report.
    assert fix in wd.resolve_device().explain()
    assert any(fix in w["message"] for w in report.gather()["warnings"])


@pytest.mark.parametrize("version", ["2.5.1+cu121", None])
def test_torch_older_than_supported_or_missing(
    version: str | None, installed_versions: Callable[..., None], tmp_path: Path
) -> None:
    """torch's floor (pyproject's torch>=2.6) checked at run time as transformers' is (issue 58)."""
    installed_versions(torch=version)
    fix = f"pip install 'torch>={packages.MIN_TORCH}'"
    said = f"torch {version} is older than whichdevice supports" if version else "torch is not installed"
    with pytest.raises(DeviceError) as err:
        wd.training_arguments(str(tmp_path))
    check_error(err, PackageVersionError, (said, fix))
    assert fix in wd.resolve_device("cpu").explain()
    for supported in ("2.13.0+cpu", "2.6.0a0+ecf3bae40a"):  # a local build; an NGC container's build of 2.6
        installed_versions(torch=supported)
        assert packages.torch_problem() is None and packages.stack_problems() == [], supported


def test_supported_transformers_gives_no_warning(installed_versions: Callable[..., None]) -> None:
    installed_versions(transformers=training.MIN_TRANSFORMERS + ".0")
    assert training.transformers_problem() is None
    assert "older than whichdevice supports" not in wd.resolve_device().explain()


# ============================================================================== the real command


class Command(NamedTuple):
    argv: tuple[str, ...]
    env: dict[str, str]
    code: int
    says: tuple[str, ...]  # on stderr (stdout when the exit code is 0: a warning in the report)


def _write_stub_site(root: Path) -> None:
    """A site directory a user could have: an old accelerate, an old transformers, a Gaudi stack."""
    for dist, version in (("accelerate", "1.4.0"), ("transformers", "4.40.0")):
        info = root / "old" / f"{dist}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    gaudi = root / "gaudi" / "habana_frameworks" / "torch"
    gaudi.mkdir(parents=True)
    (gaudi.parent / "__init__.py").write_text("")
    (gaudi / "__init__.py").write_text("raise AssertionError('imported before checking accelerate')\n")


COMMANDS = {
    "check-gpu": Command(("check", "gpu"), {}, 2, ("Did you mean 'cuda'?",)),
    "check-empty": Command(("check", ""), {}, 2, ("is empty",)),
    "device-option-bad-index": Command(("--device", "cuda:abc"), {}, 2, ("--device='cuda:abc'", "'cuda:0'")),
    "check-npu-not-installed": Command(("check", "npu"), {}, 1, ("pip install torch-npu",)),
    "tpu-index-on-one-chip": Command(("--simulate", "tpu:1", "check", "tpu:3"), {}, 1, ("use tpu:0",)),
    "whichdevice-device-upper-case": Command(
        ("check",), {"WHICHDEVICE_DEVICE": "Cuda"}, 2, ("WHICHDEVICE_DEVICE='Cuda'", "write 'cuda'")
    ),
    "cuda-visible-empty-entry": Command(
        ("--simulate", "cuda:4", "check", "cuda:1"),
        {"CUDA_VISIBLE_DEVICES": "0,,2"},
        1,
        ("CUDA_VISIBLE_DEVICES='0,,2'", "use cuda:0"),
    ),
    "cuda-visible-uuid": Command(
        ("--simulate", "cuda:4", "check", "cuda"),
        {"CUDA_VISIBLE_DEVICES": UUID},
        1,
        ("that this machine lacks", "fix or unset CUDA_VISIBLE_DEVICES"),
    ),
    "habana-modules-malformed": Command(
        ("--simulate", "hpu:8", "check", "hpu"),
        {"HABANA_VISIBLE_MODULES": "0,x"},
        2,
        ("HABANA_VISIBLE_MODULES=0,1",),
    ),
    "local-rank-abc": Command(("check",), {"LOCAL_RANK": "abc"}, 2, ("LOCAL_RANK='abc'", "unset it")),
    "local-rank-beyond-gpus": Command(
        ("--simulate", "cuda:4", "check"),
        {"LOCAL_RANK": "4", "RANK": "4", "WORLD_SIZE": "8"},
        1,
        ("--nproc_per_node=4",),
    ),
    "accelerate-too-old-for-gaudi": Command(
        ("check", "hpu"), {"PYTHONPATH": "{old}:{gaudi}"}, 1, ("pip install 'accelerate>=1.5.0'",)
    ),
    "transformers-too-old-report": Command(
        (), {"PYTHONPATH": "{old}"}, 0, ("transformers 4.40.0 is older", "pip install 'transformers>=4.57'")
    ),
    # The limit's own values (more in tests/hardware/test_faults.py): garbage is refused naming the form.
    "probe-timeout-garbage": Command(
        ("check",), {"WHICHDEVICE_PROBE_TIMEOUT": "abc"}, 2, ("WHICHDEVICE_PROBE_TIMEOUT='abc'", "=inf for no limit")
    ),
    "probe-timeout-inf-is-no-limit": Command(("check",), {"WHICHDEVICE_PROBE_TIMEOUT": "inf"}, 0, ("ok: cpu",)),
}


@pytest.fixture(scope="module")
def command_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every command case, run at once (each process imports torch: a second or two)."""
    root = tmp_path_factory.mktemp("site")
    _write_stub_site(root)
    base = {k: v for k, v in os.environ.items() if k not in STEERING and k != "PYTHONPATH"}

    def run(case: Command) -> subprocess.CompletedProcess[str]:
        env = {**base, **{k: v.format(old=root / "old", gaudi=root / "gaudi") for k, v in case.env.items()}}
        # The whichdevice under test (a worktree's src), not whatever the environment has installed.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(wd.__file__).parents[1]), env.get("PYTHONPATH")]))
        return subprocess.run(
            [sys.executable, "-m", "whichdevice", *case.argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(COMMANDS, pool.map(run, COMMANDS.values()), strict=True))


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_command(name: str, command_results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    case, proc = COMMANDS[name], command_results[name]
    assert proc.returncode == case.code, (proc.stdout[-2000:], proc.stderr)
    assert "Traceback" not in proc.stderr
    where = proc.stdout if case.code == 0 else proc.stderr
    for fragment in case.says:
        assert fragment in where, where
    if case.code:
        assert proc.stderr.startswith("whichdevice")
        assert len(proc.stderr.strip().splitlines()) <= 2


def test_exit_codes_follow_the_error_kind() -> None:
    # What every command (and its --json "exit_code") answers for each error kind.
    for error, code in EXIT.items():
        assert report.exit_code_for(error("x")) == code
