"""whichdevice.testing.simulate: every row available on demand, through the real probe machinery."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice import testing
from whichdevice.hardware import probing
from whichdevice.testing import parse_spec, simulate

GiB = 1024**3


# -------------------------------------------------------------------------------- every row here


@pytest.mark.parametrize(
    ("spec", "backend", "count"),
    [
        ("cuda:4", "cuda", 4),
        ("cuda:8,cc=9.0,mem=141GiB,name=NVIDIA H200", "cuda", 8),
        ("cuda:2,variant=rocm", "cuda", 2),
        ("hpu:8,gen=gaudi3", "hpu", 8),
        ("npu:8", "npu", 8),
        ("neuron:2", "neuron", 2),
        ("tpu:4", "tpu", 4),
        ("mps", "mps", 1),
        ("xpu:2", "xpu", 2),
        ("mlu:2", "mlu", 2),
        ("musa:2", "musa", 2),
        ("cpu,flags=avx512_bf16", "cpu", 1),
    ],
)
def test_simulate_makes_each_row_available(spec: str, backend: str, count: int) -> None:
    real = wd.probe(backend)
    with simulate(spec):
        result = wd.probe(backend)
        assert result.simulated
        assert result.available and result.installed
        assert result.reason is None
        assert result.device_count == count == len(result.devices)
        assert [d.index for d in result.devices] == list(range(count))
        assert all(d.name for d in result.devices)
        assert result.to_dict()["simulated"] is True
        assert testing.active()
    assert wd.probe(backend) is real
    assert not testing.active()


def test_simulated_cuda_defaults_are_an_ampere_gpu() -> None:
    with simulate("cuda:4"):
        result = wd.probe("cuda")
    assert result.variant == "cuda"
    assert {d.name for d in result.devices} == {"NVIDIA A100-SXM4-80GB"}
    assert {d.capability for d in result.devices} == {(8, 0)}
    assert {d.total_memory for d in result.devices} == {80 * GiB}
    assert [d.physical_id for d in result.devices] == ["0", "1", "2", "3"]


def test_simulated_cuda_details_from_spec() -> None:
    with simulate("cuda:8,cc=9.0,mem=141GiB,name=NVIDIA H200"):
        result = wd.probe("cuda")
    assert {d.name for d in result.devices} == {"NVIDIA H200"}
    assert result.min_capability == (9, 0)
    assert {d.total_memory for d in result.devices} == {141 * GiB}


def test_simulated_rocm() -> None:
    with simulate("cuda:2,variant=rocm"):
        result = wd.probe("cuda")
    assert result.variant == "rocm"
    assert "AMD" in result.devices[0].name


def test_simulated_gaudi_generation_and_bf16() -> None:
    with simulate("hpu:8,gen=gaudi3"):
        result = wd.probe("hpu")
    assert {d.generation for d in result.devices} == {"gaudi3"}
    assert all(d.bf16 for d in result.devices)
    with simulate("hpu:2"):
        assert wd.probe("hpu").devices[0].generation == "gaudi2"


def test_simulated_gaudi_generation_comes_from_the_device_name() -> None:
    # The real probe reads the generation from the name; the simulation used to default to gaudi2.
    with simulate("hpu:1,name=Intel Gaudi 3"):
        (device,) = wd.probe("hpu").devices
    assert device.name == "Intel Gaudi 3"
    assert device.generation == "gaudi3"


def test_simulated_gaudi1_has_no_fp16() -> None:
    from whichdevice.device.target import Target
    from whichdevice.precision.hardware import supports

    with simulate("hpu:1,gen=gaudi1"):
        result = wd.probe("hpu")
    assert result.devices[0].name == "GAUDI1" and result.devices[0].generation == "gaudi1"
    assert supports(Target.of(wd.get_backend("hpu"), result), "float16")[0] is False


@pytest.mark.parametrize(("macos", "bf16"), [("13.6", False), ("14.0", True), (None, True)])
def test_simulated_mps_bf16_follows_the_macos_version(macos: str | None, bf16: bool) -> None:
    with simulate("mps" + (f",macos={macos}" if macos else "")):
        assert wd.probe("mps").devices[0].bf16 is bf16


def test_simulated_mps_reports_macos_version() -> None:
    with simulate("mps"):
        assert wd.probe("mps").os_version == "14.5"
    with simulate("mps,macos=13.6"):
        assert wd.probe("mps").os_version == "13.6"


def test_simulated_cpu_flags() -> None:
    with simulate("cpu,flags=avx512_bf16"):
        result = wd.probe("cpu")
        assert result.features == frozenset({"avx512_bf16"})
        assert result.devices[0].bf16 is True
    with simulate("cpu,flags="):
        result = wd.probe("cpu")
        assert result.features == frozenset()
        assert result.devices[0].bf16 is False


def test_simulated_npu_bf16_switch() -> None:
    with simulate("npu:8,bf16=no"):
        assert {d.bf16 for d in wd.probe("npu").devices} == {False}


def test_zero_count_is_installed_without_devices() -> None:
    with simulate("cuda:0"):
        result = wd.probe("cuda")
    assert result.installed and not result.available
    assert result.device_count == 0
    assert "finds no" in result.reason


# ---------------------------------------------------------------------------------------- modes


def test_mode_broken() -> None:
    with simulate("npu,broken"):
        result = wd.probe("npu")
    assert result.installed and not result.available
    assert "ImportError" in result.reason
    assert "pip install torch-npu" in result.reason


def test_mode_hangs_is_given_up() -> None:
    with simulate("npu,hangs"):
        result = wd.probe("npu", timeout=0.3)
        assert not result.available
        assert "did not finish within 0.3 s" in result.reason
        assert wd.probe("cpu").available  # the others still answer


def test_mode_missing() -> None:
    with simulate("npu,missing"):
        result = wd.probe("npu")
    assert not result.installed and not result.available
    assert "pip install torch-npu" in result.reason
    assert result.simulated


def test_mode_unavailable() -> None:
    with simulate("cuda:2,unavailable"):
        result = wd.probe("cuda")
    assert result.installed and not result.available
    assert result.device_count == 0
    assert result.devices == ()
    # The same words a real runtime gets when its management library lists GPUs it cannot use.
    assert "2 cuda device(s) are present, but its runtime reports none usable" in result.reason
    assert "check the driver" in result.reason


# ------------------------------------------------------------------------ several, order, nesting


def test_unnamed_backends_are_absent_and_cpu_is_real() -> None:
    with simulate("npu:8"):
        results = {r.backend: r for r in wd.probe_all()}
    assert [n for n, r in results.items() if r.available] == ["npu", "cpu"]
    assert "not present on the simulated machine" in results["cuda"].reason
    assert results["cuda"].simulated
    assert not results["cpu"].simulated


def test_others_real_probes_the_rest_for_real() -> None:
    with simulate("npu:8", others="real"):
        cuda = wd.probe("cuda")
        assert wd.probe("npu").available
    assert not cuda.simulated
    assert cuda.reason == wd.probe("cuda").reason


@pytest.mark.parametrize(
    ("specs", "first"),
    [(("npu:8", "cuda:2"), "npu"), (("cuda:2", "neuron:2"), "neuron"), (("neuron:2;cuda:4",), "neuron")],
)
def test_two_backends_first_available_follows_detection_order(specs: tuple[str, ...], first: str) -> None:
    with simulate(*specs):
        available = [r.backend for r in wd.probe_all() if r.available]
    assert available[0] == first
    assert "cuda" in available
    assert available[-1] == "cpu"


def test_nesting_restores_the_outer_simulation() -> None:
    real_cuda = wd.probe("cuda")
    with simulate("cuda:4"):
        outer_cuda = wd.probe("cuda")
        assert outer_cuda.device_count == 4
        with simulate("hpu:8"):
            assert wd.probe("hpu").available
            assert not wd.probe("cuda").available
        assert wd.probe("cuda") is outer_cuda
        assert not wd.probe("hpu").available
    assert wd.probe("cuda") is real_cuda
    assert not testing.active()


def test_exit_restores_real_results_and_counts() -> None:
    wd.probe_all()
    counts = probing.probe_counts()
    cpu = wd.probe("cpu")
    with simulate("xpu:2"):
        wd.probe_all()
        assert probing.probe_counts()["xpu"] == 1
        assert wd.probe("cpu") is not cpu
    assert wd.probe("cpu") is cpu
    assert probing.probe_counts() == counts


def test_exit_restores_hook_variables_even_after_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PT_ENABLE_INT64_SUPPORT", "placeholder")
    monkeypatch.delenv("PT_ENABLE_INT64_SUPPORT")  # restored to unset afterwards, whatever happens
    with pytest.raises(RuntimeError), simulate("hpu:8"):
        wd.probe("hpu")
        assert os.environ["PT_ENABLE_INT64_SUPPORT"] == "1"
        raise RuntimeError("test body failed")
    assert "PT_ENABLE_INT64_SUPPORT" not in os.environ
    assert not testing.active()


def test_simulate_as_decorator() -> None:
    @simulate("xpu:2")
    def count_xpus() -> int:
        return wd.probe("xpu").device_count

    assert count_xpus() == 2
    assert count_xpus() == 2  # reusable
    assert not testing.active()
    assert not wd.probe("xpu").available


def test_simulated_hardware_fixture(simulated_hardware) -> None:  # type: ignore[no-untyped-def]
    sim = simulated_hardware("hpu:8", "npu:2")
    assert isinstance(sim, simulate)
    assert testing.active()
    assert wd.probe("hpu").device_count == 8
    assert wd.probe("npu").device_count == 2
    assert sim.description == "hpu:8, npu:2"


def test_simulated_hardware_fixture_takes_packages(simulated_hardware) -> None:  # type: ignore[no-untyped-def]
    simulated_hardware("hpu:8", packages={"accelerate": "1.4.0"})
    assert "accelerate 1.4.0 is too old for Gaudi" in (wd.probe("hpu").reason or "")


def test_fixture_comes_from_the_pytest11_plugin_and_cleans_up(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import whichdevice as wd
        from whichdevice import testing

        def test_uses_fixture(simulated_hardware):
            simulated_hardware("tpu:4")
            assert wd.probe("tpu").device_count == 4

        def test_after(simulated_hardware):
            assert not testing.active()
            simulated_hardware("mlu:2")
            simulated_hardware("musa:2")  # stacked: the innermost answers
            assert wd.probe("musa").available and not wd.probe("mlu").available
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert not testing.active()


# ---------------------------------------------------------------------- visible devices select


def test_visible_devices_select_among_simulated_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with simulate("cuda:8"):
        result = wd.probe("cuda")
    assert result.device_count == 2
    assert [d.physical_id for d in result.devices] == ["0", "1"]
    assert [d.index for d in result.devices] == [0, 1]


def test_visible_devices_keep_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,2")
    with simulate("cuda:8"):
        result = wd.probe("cuda")
    assert [d.physical_id for d in result.devices] == ["6", "2"]
    assert result.visible is not None and result.visible.raw == "6,2"


def test_visible_devices_naming_absent_gpu_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,9")
    with simulate("cuda:2"):
        result = wd.probe("cuda")
    assert [d.physical_id for d in result.devices] == ["1"]
    assert any("9" in w and "lacks" in w for w in result.warnings)


def test_visible_devices_by_uuid_select_a_simulated_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    with simulate("cuda:4"):
        uuids = [testing.simulated_readings("cuda:4").inventory[i].uuid for i in (2, 0)]  # type: ignore[union-attr]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(u for u in uuids if u))
    with simulate("cuda:4"):
        result = wd.probe("cuda")
    assert [d.physical_id for d in result.devices] == uuids
    assert not result.warnings


def test_empty_visible_devices_hides_every_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with simulate("cuda:8"):
        result = wd.probe("cuda")
    assert not result.available
    assert "unset CUDA_VISIBLE_DEVICES" in result.reason
    assert any("empty" in w for w in result.warnings)


def test_visible_devices_for_other_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "0,1,2")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0.1")
    with simulate("npu:8", "hpu:8", "cuda:2,variant=rocm", "xpu:2"):
        npu, hpu, cuda, xpu = (wd.probe(n) for n in ("npu", "hpu", "cuda", "xpu"))
    assert [d.physical_id for d in npu.devices] == ["3"]
    assert hpu.device_count == 3
    assert any("groups of 2 or 4" in w for w in hpu.warnings)
    assert [d.physical_id for d in cuda.devices] == ["1"]
    assert [d.physical_id for d in xpu.devices] == ["0.1"]


def test_cuda_order_warning_with_mixed_models(monkeypatch: pytest.MonkeyPatch) -> None:
    # All simulated GPUs are one model, so no CUDA_DEVICE_ORDER warning is due.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with simulate("cuda:2"):
        assert not any("CUDA_DEVICE_ORDER" in w for w in wd.probe("cuda").warnings)


# ---------------------------------------------------------------------------------- bad specs


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("gpu:4", "Did you mean 'cuda'"),
        ("gaudi:8", "Did you mean 'hpu'"),
        ("cuda:x", "must be a number"),
        ("cuda:\u00b2", "must be a number"),
        ("cuda:-1", "must be a number"),
        ("cuda:4,foo=1", "unknown key"),
        ("cuda:4,explode", "unknown flag"),
        ("cuda:4,cc=nine", "compute capability"),
        ("cuda:4,mem=lots", "not a size"),
        ("npu:2,bf16=maybe", "yes/no"),
        ("", "a spec is a string"),
        ("   ", "a spec is a string"),
    ],
)
def test_bad_specs_raise_helpful_device_error(spec: str, match: str) -> None:
    with pytest.raises(wd.DeviceError, match=match):
        simulate(spec)
    assert not testing.active()


def test_bad_simulate_arguments() -> None:
    with pytest.raises(wd.DeviceError, match="given twice"):
        simulate("cuda:2", "cuda:4")
    with pytest.raises(wd.DeviceError, match="others"):
        simulate("cuda:2", others="maybe")
    with pytest.raises(wd.DeviceError, match="a spec is a string"):
        simulate(4)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GiB", 80 * GiB), ("16GB", 16 * 1000**3), ("1.5T", int(1.5 * 1024**4)), ("512MiB", 512 * 1024**2)],
)
def test_memory_sizes(text: str, expected: int) -> None:
    assert parse_spec(f"cuda:1,mem={text}").memory == expected


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("mps,bf16=no", "bf16= in 'mps,bf16=no' is not something the mps runtime reports"),
        ("hpu:8,bf16=no", "bf16= applies to"),
        ("npu:8,cc=8.0", "cc= applies to cuda"),
        ("xpu:2,gen=gaudi3", "gen= applies to hpu"),
        ("cuda:2,macos=14", "macos= applies to mps"),
        ("cuda:2,flags=avx512_bf16", "flags= applies to cpu"),
        ("npu:2,variant=rocm", "variant= applies to cuda"),
        ("cuda:2,variant=metal", "use variant=cuda or variant=rocm"),
        ("hpu:8,gen=gaudi", "not a Gaudi generation"),
        ("hpu:8,gen=gaudi3,name=GAUDI2", "reads as gaudi2, but gen='gaudi3'"),
        ("mps:2", "one MPS device"),
        ("cpu,missing", "the CPU is always there"),
    ],
)
def test_details_a_runtime_does_not_report_are_rejected(spec: str, match: str) -> None:
    with pytest.raises(wd.DeviceError, match=re.escape(match)):
        simulate(spec)


def test_gen_and_a_matching_name_are_accepted() -> None:
    assert parse_spec("hpu:8,gen=gaudi3,name=Intel Gaudi 3").generation == "gaudi3"


# ------------------------------------------------------------------------------------ packages


def test_simulated_packages_answer_for_the_duration() -> None:
    from whichdevice.core.packages import package_version

    real = package_version("kernels")
    with simulate("cuda:1", packages={"accelerate": "1.4.0", "kernels": None}):
        assert package_version("accelerate") == "1.4.0"
        assert package_version("kernels") is None
        assert wd.probe("cuda").available
    assert package_version("kernels") == real
    assert package_version("accelerate") != "1.4.0"


def test_simulated_accelerate_too_old_for_gaudi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PT_ENABLE_INT64_SUPPORT", "placeholder")
    monkeypatch.delenv("PT_ENABLE_INT64_SUPPORT")
    with simulate("hpu:8", packages={"accelerate": "1.4.0"}):
        result = wd.probe("hpu")
        # Like the real probe, it stops before the hook and the import.
        assert "PT_ENABLE_INT64_SUPPORT" not in os.environ
    assert result.env_set == ()
    assert result.installed and not result.available
    assert "pip install 'accelerate>=1.5.0'" in (result.reason or "")


def test_simulated_package_versions_show_in_the_result() -> None:
    with simulate("npu:2", packages={"torch": "2.6.0", "torch-npu": "2.6.0.post1"}):
        assert dict(wd.probe("npu").versions) == {"torch": "2.6.0", "torch-npu": "2.6.0.post1"}
    with simulate("npu:2"):
        assert dict(wd.probe("npu").versions) == {"torch": "simulated", "torch-npu": "simulated"}


@pytest.mark.parametrize("packages", [["accelerate"], {"accelerate": 1.4}, {1: "1.0"}])
def test_bad_packages_argument(packages: object) -> None:
    with pytest.raises(wd.DeviceError, match="packages="):
        simulate("cuda:1", packages=packages)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- never from environment


_LIKELY_SWITCHES = ("WHICHDEVICE_SIMULATE", "WHICHDEVICE_SIMULATION", "WHICHDEVICE_SIMULATED_HARDWARE")


def test_never_switched_on_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _LIKELY_SWITCHES:
        monkeypatch.setenv(name, "hpu:8")
    assert not testing.active()
    result = wd.probe("hpu")
    assert not result.simulated and not result.available


def test_never_switched_on_by_environment_in_a_fresh_process() -> None:
    env = {**os.environ, **dict.fromkeys(_LIKELY_SWITCHES, "hpu:8")}
    env.pop("PYTEST_CURRENT_TEST", None)
    code = "import whichdevice, whichdevice.testing as t; r = whichdevice.probe('hpu'); print(t.active(), r.simulated)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_testing_module_reads_no_whichdevice_variable() -> None:
    for path in Path(testing.__file__).parent.glob("*.py"):
        assert "WHICHDEVICE_" not in path.read_text(), path
