"""whichdevice.hardware.probes: pure interpretations of raw readings, and simulate() going through the same ones."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import whichdevice as wd
from whichdevice import testing
from whichdevice.core.packages import package_version
from whichdevice.core.records import EnvAction, ProbeResult
from whichdevice.hardware import envhooks, probes, registry
from whichdevice.hardware.probes import (
    CpuReadings,
    CudaReadings,
    DeviceReading,
    HpuReadings,
    MpsReadings,
    TpuReadings,
    VendorReadings,
    XpuReadings,
)
from whichdevice.hardware.probes.common import installed_versions, read_env
from whichdevice.testing import simulate

GiB = 1024**3
SIM = "simulated"


@pytest.fixture(autouse=True)
def _clean_probe_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No variable a probe reads, and no hook history: readings depend on the spec alone."""
    monkeypatch.setattr(envhooks, "_applied", {})
    hook_variables = [d.name for b in wd.backends() for d in b.env_defaults]
    for name in (*probes.ENV_VARIABLES, *hook_variables):
        monkeypatch.setenv(name, "placeholder")  # so monkeypatch restores an unset variable too
        monkeypatch.delenv(name)


def _fields(result: ProbeResult) -> dict[str, Any]:
    out = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    out.pop("simulated")
    out.pop("seconds")
    out["versions"] = dict(out["versions"])
    return out


def _int64_set() -> tuple[EnvAction, ...]:
    (default,) = wd.get_backend("hpu").env_defaults
    return (EnvAction(default.name, default.value, "set", f"set {default.name}={default.value} ({default.why})"),)


def _module(name: str, count: int, device: DeviceReading, **extra: Any) -> dict[str, Any]:
    versions = {"torch": SIM, wd.get_backend(name).package: SIM}
    return dict(available=count > 0, devices=(device,) * count, physical_count=count, versions=versions, **extra)


# Per registry row: a representative spec, and the readings written out by hand that it must give.
def _hand_made(name: str) -> tuple[str, object]:
    if name == "neuron":
        return "neuron:2", VendorReadings(**_module("neuron", 2, DeviceReading("Trainium2", 96 * GiB)))
    if name == "tpu":
        return "tpu:4", TpuReadings(**_module("tpu", 4, DeviceReading("TPU v5e", 16 * GiB)), accelerator="tpu")
    if name == "npu":
        return "npu:8,bf16=no", VendorReadings(**_module("npu", 8, DeviceReading("Ascend910B2", 64 * GiB, bf16=False)))
    if name == "hpu":
        device = DeviceReading("Intel Gaudi 3", 96 * GiB)
        readings = HpuReadings(
            **_module("hpu", 8, device, env_set=_int64_set()), accelerate_version=package_version("accelerate")
        )
        return "hpu:8,name=Intel Gaudi 3", readings
    if name in ("mlu", "musa"):
        device = DeviceReading(testing.readings.DEFAULTS[name]["name"], 48 * GiB, bf16=True)
        return f"{name}:2", VendorReadings(**_module(name, 2, device))
    if name == "cuda":
        inventory = tuple(
            DeviceReading("NVIDIA H200", 141 * GiB, (9, 0), f"GPU-00000000-0000-0000-0000-00000000000{i}")
            for i in (0, 1)
        )
        readings = CudaReadings(
            available=True,
            devices=(DeviceReading(),) * 2,
            versions={"torch": SIM},
            torch_version=SIM,
            cuda_version=SIM,
            inventory=inventory,
            mig_uuids=(),
            machine="x86_64",  # an H200 fixes no host: the simulation's default
        )
        return "cuda:2,cc=9.0,mem=141GiB,name=NVIDIA H200", readings
    if name == "xpu":
        device = DeviceReading("Intel(R) Data Center GPU Max 1550", 128 * GiB, bf16=True)
        return "xpu:2", XpuReadings(**_module("xpu", 2, device), torch_version=SIM)
    if name == "mps":
        chip = DeviceReading("Apple M2", 16 * GiB)
        return "mps,macos=13.6", MpsReadings(
            available=True, devices=(chip,), versions={"torch": SIM}, system="Darwin", macos="13.6"
        )
    if name == "cpu":
        cpu = wd.get_backend("cpu")
        readings = CpuReadings("Simulated CPU", frozenset({"avx512_bf16"}), 64 * GiB, {}, installed_versions(cpu))
        return "cpu,flags=avx512_bf16,name=Simulated CPU,mem=64GiB", readings
    raise KeyError(f"no representative spec for registry row {name!r}: add one here")


INTERPRET: dict[str, Callable[..., ProbeResult]] = {
    "neuron": probes.interpret_neuron,
    "tpu": probes.interpret_tpu,
    "npu": probes.interpret_npu,
    "hpu": probes.interpret_hpu,
    "mlu": probes.interpret_mlu,
    "musa": probes.interpret_musa,
    "cuda": probes.interpret_cuda,
    "xpu": probes.interpret_xpu,
    "mps": probes.interpret_mps,
    "cpu": probes.interpret_cpu,
}

ROWS = [b.name for b in wd.backends()]


@pytest.mark.parametrize("name", ROWS)
def test_simulate_is_the_interpretation_of_its_readings(name: str) -> None:
    spec, hand = _hand_made(name)
    backend = wd.get_backend(name)
    with simulate(spec):
        result = wd.probe(name)
        built = testing.simulated_readings(spec)
    assert result.simulated
    assert built == hand
    assert _fields(result) == _fields(INTERPRET[name](backend, hand))
    assert _fields(result) == _fields(probes.interpret(backend, built))


def _variants(name: str) -> list[str]:
    if name == "cpu":
        # Free memory pinned: read twice from this machine, it moved between the reads on a busy one.
        return ["cpu,free=8GiB", "cpu,flags=,free=8GiB"]
    count = "" if name == "mps" else ":3"
    return [f"{name}{count}", f"{name}:0", f"{name},missing", f"{name}{count},unavailable"]


@pytest.mark.parametrize(("name", "spec"), [(n, s) for n in ROWS for s in _variants(n)])
def test_every_mode_goes_through_the_interpretation(name: str, spec: str) -> None:
    with simulate(spec):
        result = wd.probe(name)
        built = testing.simulated_readings(spec)
    assert _fields(result) == _fields(INTERPRET[name](wd.get_backend(name), built))


@pytest.mark.parametrize("name", [n for n in ROWS if n != "cpu"])
def test_broken_mode_raises_the_import_error_probing_reports(name: str) -> None:
    with simulate(f"{name},broken"):
        result = wd.probe(name)
        built = testing.simulated_readings(f"{name},broken")
    with pytest.raises(ImportError) as err:
        INTERPRET[name](wd.get_backend(name), built)
    assert f"raised ImportError: {err.value}" in result.reason
    assert "installed but broken" in result.reason


# ------------------------------------------------------------------------------- edge readings


def test_installed_without_devices() -> None:
    npu = wd.get_backend("npu")
    result = probes.interpret_npu(npu, VendorReadings(versions={"torch-npu": "2.6"}))
    assert result.installed and not result.available and result.device_count == 0
    assert result.reason == "torch-npu is installed but finds no Huawei Ascend device"
    assert result.versions == {"torch-npu": "2.6"}


def test_not_installed_names_the_install_and_keeps_the_versions_read() -> None:
    result = probes.interpret_npu(wd.get_backend("npu"), VendorReadings(installed=False, versions={"torch": "2.9"}))
    assert not result.installed
    assert result.reason == "torch-npu is not installed: pip install torch-npu"
    assert result.versions == {"torch": "2.9"}


def test_import_error_names_the_variable_a_hook_set() -> None:
    readings = HpuReadings(import_error="libhl_thunk.so: cannot open shared object file", env_set=_int64_set())
    with pytest.raises(ImportError, match=r"libhl_thunk\.so.*\(whichdevice had set PT_ENABLE_INT64_SUPPORT=1"):
        probes.interpret_hpu(wd.get_backend("hpu"), readings)


def test_import_error_through_probing_is_an_installed_but_broken_package() -> None:
    readings = VendorReadings(import_error="OSError: libascend_hal.so: cannot open shared object file")
    row = dataclasses.replace(wd.get_backend("npu"), probe_ref=lambda b: probes.interpret_npu(b, readings))
    registry.register_backend(row, replace=True)
    result = wd.probe("npu")
    assert not result.available and result.installed
    assert "raised ImportError: OSError: libascend_hal.so" in result.reason
    assert "reinstall it (pip install torch-npu)" in result.reason


@pytest.mark.parametrize(
    ("name", "readings"),
    [
        ("npu", VendorReadings(env={"ASCEND_RT_VISIBLE_DEVICES": ""}, physical_count=8)),
        ("xpu", XpuReadings(env={"ZE_AFFINITY_MASK": ""})),
        ("tpu", TpuReadings(env={"TPU_VISIBLE_CHIPS": ""}, accelerator="tpu")),
        ("cuda", CudaReadings(env={"CUDA_VISIBLE_DEVICES": ""}, inventory=(DeviceReading("NVIDIA A100"),) * 2)),
    ],
)
def test_visible_devices_variable_hiding_every_device(name: str, readings: Any) -> None:
    result = probes.interpret(wd.get_backend(name), readings)
    assert not result.available
    (variable,) = readings.env
    assert f"{variable}='' hides every {name} device" in result.reason
    assert f"unset {variable}" in result.reason


def test_interpretation_reads_the_variables_from_the_readings_not_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1")
    readings = VendorReadings(available=True, devices=(DeviceReading("Ascend910B2"),) * 2)
    result = probes.interpret_npu(wd.get_backend("npu"), readings)
    assert [d.physical_id for d in result.devices] == ["0", "1"]
    assert result.visible is not None and result.visible.variable is None


def test_visible_devices_the_machine_lacks_are_named() -> None:
    readings = VendorReadings(
        env={"ASCEND_RT_VISIBLE_DEVICES": "1,9"}, available=True, devices=(DeviceReading(),), physical_count=2
    )
    result = probes.interpret_npu(wd.get_backend("npu"), readings)
    assert [d.physical_id for d in result.devices] == ["1"]
    assert "ASCEND_RT_VISIBLE_DEVICES='1,9' names device(s) 9 that this machine lacks" in result.warnings


def test_cuda_not_a_cuda_build() -> None:
    result = probes.interpret_cuda(wd.get_backend("cuda"), CudaReadings(installed=False, torch_version="2.9.0+cpu"))
    assert result.reason is not None and result.reason.startswith("this torch (2.9.0+cpu) is a CPU-only build")


def test_cuda_details_come_from_the_inventory_by_uuid() -> None:
    inventory = (
        DeviceReading("NVIDIA A100", 80 * GiB, (8, 0), "GPU-aaa"),
        DeviceReading("NVIDIA H100", None, (9, 0), "GPU-bbb"),
    )
    readings = CudaReadings(
        env={"CUDA_VISIBLE_DEVICES": "GPU-bbb"}, available=True, devices=(DeviceReading(),), inventory=inventory
    )
    result = probes.interpret_cuda(wd.get_backend("cuda"), readings)
    (device,) = result.devices
    assert (device.name, device.capability, device.physical_id) == ("NVIDIA H100", (9, 0), "GPU-bbb")


def test_cuda_mig_instances_are_not_called_absent_when_unread() -> None:
    mig = "MIG-4f3e2d1c-0000-1111-2222-333344445555"
    inventory = (DeviceReading("NVIDIA A100", 80 * GiB, (8, 0), "GPU-aaa"),)
    readings = CudaReadings(
        env={"CUDA_VISIBLE_DEVICES": mig}, available=True, devices=(DeviceReading(),), inventory=inventory
    )
    result = probes.interpret_cuda(wd.get_backend("cuda"), readings)
    assert result.device_count == 1 and result.devices[0].physical_id == mig
    assert not any("lacks" in w for w in result.warnings)
    listed = probes.interpret_cuda(wd.get_backend("cuda"), dataclasses.replace(readings, mig_uuids=()))
    assert any(f"names device(s) {mig} that this machine lacks" in w for w in listed.warnings)


def test_cuda_without_inventory_says_how_to_read_the_model() -> None:
    readings = CudaReadings(available=True, devices=(DeviceReading(),) * 2, cuda_version="12.8")
    result = probes.interpret_cuda(wd.get_backend("cuda"), readings)
    assert result.device_count == 2 and result.devices[0].name is None
    assert any("pip install nvidia-ml-py" in w for w in result.warnings)
    assert result.versions == {"cuda": "12.8"} and result.variant == "cuda"


def test_cuda_gpus_present_but_unusable_point_at_the_driver() -> None:
    readings = CudaReadings(available=False, inventory=(DeviceReading("NVIDIA A100"),) * 4)
    result = probes.interpret_cuda(wd.get_backend("cuda"), readings)
    assert not result.available
    assert "4 cuda device(s) are present, but its runtime reports none usable" in (result.reason or "")


def test_cuda_after_initialisation_a_changed_variable_is_only_a_warning() -> None:
    props = DeviceReading("NVIDIA H200", 141 * GiB, (9, 0))
    readings = CudaReadings(
        env={"CUDA_VISIBLE_DEVICES": "0"},
        available=True,
        devices=(props, props),
        initialized=True,
        earlier_visible=(None,),
    )
    result = probes.interpret_cuda(wd.get_backend("cuda"), readings)
    assert result.device_count == 2  # what the initialised runtime shows, not the new variable
    assert any("already initialised in this process with 2 GPU(s)" in w for w in result.warnings)


@pytest.mark.parametrize(("order", "warned"), [(None, True), ("FASTEST_FIRST", True), ("PCI_BUS_ID", False)])
def test_cuda_order_warning_for_mixed_models(order: str | None, warned: bool) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0,1"} | ({"CUDA_DEVICE_ORDER": order} if order else {})
    inventory = (DeviceReading("NVIDIA A100"), DeviceReading("NVIDIA T4"))
    readings = CudaReadings(env=env, available=True, devices=(DeviceReading(),) * 2, inventory=inventory)
    result = probes.interpret_cuda(wd.get_backend("cuda"), readings)
    assert any("export CUDA_DEVICE_ORDER=PCI_BUS_ID" in w for w in result.warnings) is warned


def test_rocm_variant_and_version() -> None:
    readings = CudaReadings(available=True, devices=(DeviceReading(),), hip_version="6.4.1", cuda_version=None)
    result = probes.interpret_cuda(wd.get_backend("cuda"), readings)
    assert result.variant == "rocm" and result.versions == {"rocm": "6.4.1"}


@pytest.mark.parametrize(
    ("name", "generation"),
    [("GAUDI2", "gaudi2"), ("Intel Gaudi 3", "gaudi3"), ("GAUDI", "gaudi1"), ("HL-205", None), (None, None)],
)
def test_gaudi_generation_from_the_device_name(name: str | None, generation: str | None) -> None:
    readings = HpuReadings(available=True, devices=(DeviceReading(name),))
    (device,) = probes.interpret_hpu(wd.get_backend("hpu"), readings).devices
    assert device.generation == generation
    assert device.bf16 is True  # every Gaudi computes bf16


def test_gaudi_with_old_accelerate_is_unusable() -> None:
    readings = HpuReadings(accelerate_version="1.4.0", available=True, devices=(DeviceReading("GAUDI2"),))
    result = probes.interpret_hpu(wd.get_backend("hpu"), readings)
    assert result.installed and not result.available and result.devices == ()
    assert "accelerate 1.4.0 is too old for Gaudi" in (result.reason or "")


def test_gaudi_group_and_kept_hook_warnings() -> None:
    kept = EnvAction("PT_ENABLE_INT64_SUPPORT", "0", "kept", "kept your PT_ENABLE_INT64_SUPPORT=0; ...")
    readings = HpuReadings(
        env={"HABANA_VISIBLE_MODULES": "0,1,2"}, env_set=(kept,), available=True, devices=(DeviceReading("GAUDI2"),) * 3
    )
    result = probes.interpret_hpu(wd.get_backend("hpu"), readings)
    assert any("groups of 2 or 4" in w for w in result.warnings)
    assert kept.message in result.warnings
    assert result.env_set == (kept,)


@pytest.mark.parametrize(("macos", "bf16"), [("13.6", False), ("14.0", True), ("15.1", True), (None, False)])
def test_mps_bf16_from_macos_14(macos: str | None, bf16: bool) -> None:
    readings = MpsReadings(available=True, devices=(DeviceReading(None, 8 * GiB),), system="Darwin", macos=macos)
    result = probes.interpret_mps(wd.get_backend("mps"), readings)
    (device,) = result.devices
    assert (device.bf16, device.name, result.os_version) == (bf16, "Apple Silicon", macos)


def test_mps_unavailable_and_not_a_mac() -> None:
    mps = wd.get_backend("mps")
    off = probes.interpret_mps(mps, MpsReadings(system="Darwin", macos="12.1"))
    assert off.installed and "not available (macOS 12.1; needs 12.3+)" in (off.reason or "")
    linux = probes.interpret_mps(mps, MpsReadings(installed=False, system="Linux"))
    assert not linux.installed and (linux.reason or "").endswith("this is Linux")


def test_tpu_counts_only_a_tpu_accelerator() -> None:
    readings = TpuReadings(available=True, devices=(DeviceReading(),), accelerator="cuda")
    assert not probes.interpret_tpu(wd.get_backend("tpu"), readings).available


def test_xpu_not_built_names_the_torch() -> None:
    result = probes.interpret_xpu(wd.get_backend("xpu"), XpuReadings(installed=False, torch_version="2.9.0+cpu"))
    assert "this torch (2.9.0+cpu) was built without Intel GPU (XPU) support" in (result.reason or "")


@pytest.mark.parametrize(
    ("flags", "isa", "bf16"),
    [({"avx512_bf16", "avx2"}, None, True), ({"avx2"}, None, False), ({"amx_bf16"}, "AVX2", False)],
)
def test_cpu_native_bf16(flags: set[str], isa: str | None, bf16: bool) -> None:
    env = {probes.ONEDNN_ISA_VARIABLE: isa} if isa else {}
    result = probes.interpret_cpu(wd.get_backend("cpu"), CpuReadings("CPU", frozenset(flags), None, env))
    assert result.features == frozenset(flags) & probes.BF16_CPU_FLAGS
    assert result.devices[0].bf16 is bf16
    assert any("unset ONEDNN_MAX_CPU_ISA" in w for w in result.warnings) is (isa is not None)


# --------------------------------------------------------------------------- module structure


def test_interpret_dispatches_on_the_readings_type() -> None:
    assert probes.interpret(wd.get_backend("mlu"), VendorReadings()).reason == (
        "torch-mlu is installed but finds no Cambricon MLU device"
    )
    with pytest.raises(TypeError):
        probes.interpret(wd.get_backend("cpu"), object())  # type: ignore[arg-type]


def test_env_variables_are_declared_by_the_module_that_reads_them() -> None:
    for row in wd.backends():
        assert set(row.visible_devices_env) <= set(probes.ENV_VARIABLES), row.name
    assert probes.ONEDNN_ISA_VARIABLE in probes.ENV_VARIABLES
    assert len(set(probes.ENV_VARIABLES)) == len(probes.ENV_VARIABLES)


def test_env_variables_are_the_union_of_the_probe_modules_lists() -> None:
    """Read lazily from the modules that declare them, in one order, each once."""
    modules = (probes.common, probes.cpu, probes.cuda, probes.hpu, probes.mps, probes.tpu, probes.vendor, probes.xpu)
    joined = tuple(dict.fromkeys(name for m in modules for name in m.ENV_VARIABLES))
    assert joined == probes.ENV_VARIABLES


def test_readers_keep_only_declared_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in probes.ENV_VARIABLES:
        monkeypatch.setenv(name, "0")
    readings = probes.read_cpu(wd.get_backend("cpu"))
    assert set(readings.env) == set(probes.cpu.ENV_VARIABLES)
    assert read_env(["NOT_A_WHICHDEVICE_VARIABLE", probes.ONEDNN_ISA_VARIABLE]) == {"ONEDNN_MAX_CPU_ISA": "0"}


def test_documented_import_paths() -> None:
    for name in ("finish", "not_installed", "package_version", "BF16_CPU_FLAGS", "cpu_facts", "bf16_cap"):
        assert hasattr(probes, name), name
    assert probes.ONEDNN_ISA_VARIABLE == "ONEDNN_MAX_CPU_ISA"
    assert callable(probes.cpu_result)
    for row in registry._BUILTIN:
        assert isinstance(row.probe_ref, str) and row.probe_ref.startswith("whichdevice.hardware.probes:")
        assert callable(row.probe)


def test_probe_is_read_then_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    readings = VendorReadings(available=True, devices=(DeviceReading("fake"),))
    monkeypatch.setattr(probes.vendor, "read_vendor", lambda b: readings)
    monkeypatch.setattr(
        probes.vendor, "interpret_vendor", lambda b, r: seen.append(r) or ProbeResult(b.name, True, True)
    )
    probes.vendor.probe_npu(wd.get_backend("npu"))
    assert seen == [readings]
    # The row's probe hands over to the module's own once the package is there (presence.py).
    monkeypatch.setattr(probes.presence, "vendor_installed", lambda b: True)
    wd.get_backend("npu").probe(wd.get_backend("npu"))
    assert seen == [readings, readings]


@pytest.fixture
def _no_leftover_simulation() -> Iterator[None]:
    yield
    assert not testing.active()


@pytest.mark.usefixtures("_no_leftover_simulation")
def test_simulated_readings_need_no_simulation_for_hookless_rows() -> None:
    readings = testing.simulated_readings("xpu:2")
    assert isinstance(readings, XpuReadings) and len(readings.devices) == 2
    assert "ZE_AFFINITY_MASK" not in os.environ


def _gaudi_warnings(modules: str) -> list[str]:
    cards = (DeviceReading("GAUDI2"),) * len(modules.split(","))
    readings = HpuReadings(env={"HABANA_VISIBLE_MODULES": modules}, available=True, devices=cards)
    return list(probes.interpret_hpu(wd.get_backend("hpu"), readings).warnings)


def test_a_gaudi_module_group_the_page_does_not_list_is_warned_about() -> None:
    """docs/backends/hpu.md's table of module groups is the one the probe checks (issue 58: `1,2` passed)."""
    from whichdevice.hardware.probes.hpu import GAUDI_MODULE_GROUPS

    page = (Path(__file__).resolve().parents[2] / "docs" / "backends" / "hpu.md").read_text(encoding="utf-8")
    table = page.split("| cards | `HABANA_VISIBLE_MODULES` |", 1)[1].split("\n\n", 1)[0]
    listed = {tuple(map(int, group.split(","))) for group in re.findall(r"`([\d,]+)`", table)}
    assert listed == set(GAUDI_MODULE_GROUPS)
    for group in listed:
        assert _gaudi_warnings(",".join(map(str, reversed(group)))) == []  # the order is not the group
    said = " ".join(_gaudi_warnings("1,2"))
    assert "modules 1,2, a group of 2 Intel does not list" in said and "use 0,1 or 2,3 or 4,5 or 6,7" in said
    assert "0,1,2,3 or 4,5,6,7" in " ".join(_gaudi_warnings("2,3,4,5"))
    assert any("groups of 2 or 4" in w for w in _gaudi_warnings("0,1,2"))


def test_the_gaudi_container_form_sets_the_variable_the_probe_reads() -> None:
    """The page's `docker run --runtime=habana` line passes the variable the hpu row and probe read."""
    from whichdevice.hardware.probes.hpu import ENV_VARIABLES, MODULES_VARIABLE

    page = (Path(__file__).resolve().parents[2] / "docs" / "backends" / "hpu.md").read_text(encoding="utf-8")
    command = next(b for b in page.split("```") if "docker run" in b)
    assert "--runtime=habana" in command
    passed = dict(re.findall(r"-e (\w+)=(\S+)", command))
    assert MODULES_VARIABLE in passed and MODULES_VARIABLE in ENV_VARIABLES
    assert wd.get_backend("hpu").visible_devices_env[0] == MODULES_VARIABLE
    # What it passes is a group the probe accepts without a warning, read as the probe reads it.
    assert _gaudi_warnings(passed[MODULES_VARIABLE]) == []
