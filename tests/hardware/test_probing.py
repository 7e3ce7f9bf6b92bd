"""The probe layer, run for real on this machine: cached, bounded, thread- and fork-safe, never raising."""

from __future__ import annotations

import math
import multiprocessing
import os
import platform
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import whichdevice as wd
from whichdevice.core.errors import DeviceError
from whichdevice.hardware import envhooks, probes, probing, registry
from whichdevice.hardware.probes import BF16_CPU_FLAGS
from whichdevice.hardware.probes.nvidia import NvidiaStack
from whichdevice.hardware.probing import ProbeResult
from whichdevice.testing import simulate

ROWS = ("neuron", "tpu", "npu", "hpu", "mlu", "musa", "cuda", "xpu", "mps", "cpu")


def _cpu_only_torch() -> bool:
    import torch

    return not hasattr(torch._C, "_cuda_getDeviceCount") and not hasattr(torch._C, "_xpu_getDeviceCount")


def _custom(name: str, probe: Callable[[wd.Backend], object], **changes: object) -> wd.Backend:
    fields: dict[str, object] = {
        "name": name,
        "hardware": f"{name} test device",
        "package": f"{name}-pkg",
        "module": f"{name}_module_not_installed",
        "probe_ref": probe,
    }
    fields.update(changes)
    return wd.register_backend(wd.Backend(**fields))  # type: ignore[arg-type]


def _ok(backend: wd.Backend) -> ProbeResult:
    return ProbeResult(backend.name, installed=True, available=True, device_count=1)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Lets probes that hang on purpose finish when the test ends."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def no_hook_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start with no variables recorded as set by whichdevice's env hooks."""
    monkeypatch.setattr(envhooks, "_applied", {})
    for name in ("PT_ENABLE_INT64_SUPPORT", "PYTORCH_ENABLE_MPS_FALLBACK"):
        # setenv first: monkeypatch then restores the original afterwards even when it was unset
        # (delenv of an absent variable records nothing, so a hook's value would leak).
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)


# ------------------------------------------------------------------------------ real probing here


@pytest.mark.parametrize("name", ROWS)
def test_every_row_probed_for_real(name: str) -> None:
    backend = wd.get_backend(name)
    result = wd.probe(name)
    assert isinstance(result, ProbeResult)
    assert result.backend == name
    assert not result.simulated
    assert bool(result) is result.available
    assert result.to_dict()["backend"] == name
    if result.available:
        assert result.installed
        assert result.device_count == len(result.devices) > 0
        assert result.reason is None
    else:
        assert result.device_count == 0
        assert result.reason
        assert backend.package in result.reason or "pip install" in result.reason, result.reason


def test_cpu_is_available_with_details() -> None:
    result = wd.probe("cpu")
    assert result.available and result.installed
    assert result.device_count == 1
    (device,) = result.devices
    assert device.index == 0
    assert device.total_memory is None or device.total_memory > 0
    assert result.features <= BF16_CPU_FLAGS
    capped = probes.bf16_cap(os.environ.get(probes.ONEDNN_ISA_VARIABLE))
    assert device.bf16 == (bool(result.features) and capped is None)
    assert "torch" in result.versions


@pytest.mark.skipif(platform.system() != "Linux", reason="describes this Linux CPU-only machine")
def test_on_this_machine_only_cpu_is_available() -> None:
    if not _cpu_only_torch():
        pytest.skip("torch here is an accelerator build")
    results = {r.backend: r for r in wd.probe_all()}
    assert tuple(results) == ROWS
    assert [n for n, r in results.items() if r.available] == ["cpu"]
    for name in ROWS[:-1]:
        result = results[name]
        backend = wd.get_backend(name)
        assert not result.installed
        assert backend.package in result.reason or "pip install" in result.reason, (name, result.reason)
    assert "pip install torch-npu" in results["npu"].reason
    assert "CPU-only build" in results["cuda"].reason


def test_probe_all_follows_detection_order() -> None:
    assert tuple(r.backend for r in wd.probe_all()) == registry.backend_names()


def test_probing_leaves_environment_byte_identical() -> None:
    before = dict(os.environb)
    wd.probe_all()
    wd.probe_all(refresh=True)
    assert dict(os.environb) == before


def test_fresh_process_probing_changes_nothing_and_imports_no_vendor_package() -> None:
    code = textwrap.dedent(
        """
        import json, os, sys
        before = dict(os.environ)
        import whichdevice
        results = whichdevice.probe_all()
        after = dict(os.environ)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        vendor = ["torch_npu", "torch_neuronx", "torch_mlu", "torch_musa", "habana_frameworks",
                  "torch_tpu", "transformers", "accelerate"]
        import torch
        print(json.dumps({
            "changed": changed,
            "imported": [m for m in vendor if m in sys.modules],
            "cuda_initialized": torch.cuda.is_initialized(),
            "available": [r.backend for r in results if r.available],
        }))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env)
    import json

    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["changed"] == []
    assert report["imported"] == []
    assert report["cuda_initialized"] is False
    assert "cpu" in report["available"]


# -------------------------------------------------------------------------- failures become results


def test_raising_probe_is_reported_unavailable() -> None:
    def boom(backend: wd.Backend) -> ProbeResult:
        raise RuntimeError("driver version mismatch 535 != 550")

    _custom("boom", boom)
    result = wd.probe("boom")
    assert not result.available
    assert result.installed
    assert "RuntimeError: driver version mismatch 535 != 550" in result.reason
    assert "boom-pkg" in result.reason  # names the package to reinstall


def test_probe_calling_sys_exit_is_captured() -> None:
    def leaves(backend: wd.Backend) -> ProbeResult:
        sys.exit(3)

    _custom("exiter", leaves)
    result = wd.probe("exiter")
    assert not result.available
    assert "sys.exit(3)" in result.reason


def test_probe_returning_garbage_is_reported_not_raised() -> None:
    _custom("garbage", lambda b: None)
    result = wd.probe("garbage")
    assert not result.available
    assert "NoneType" in result.reason


def test_device_error_in_probe_is_a_fixable_setting_not_a_broken_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,x")
    with simulate("npu:8"):
        result = wd.probe("npu")
    assert not result.available
    assert "ASCEND_RT_VISIBLE_DEVICES" in result.reason
    assert "reinstall" not in result.reason


def test_hanging_probe_is_given_up_with_probe_timeout(release: threading.Event) -> None:
    _custom("hangs", lambda b: release.wait(30) and _ok(b))
    start = time.perf_counter()
    result = wd.probe("hangs", timeout=0.3)
    elapsed = time.perf_counter() - start
    assert elapsed < 3
    assert not result.available
    assert "did not finish within 0.3 s" in result.reason
    assert "WHICHDEVICE_PROBE_TIMEOUT" in result.reason
    assert result.seconds >= 0.3
    # Given up once, cached like any other answer.
    assert wd.probe("hangs") is result


def test_hanging_probe_with_set_probe_timeout(release: threading.Event) -> None:
    _custom("hangs", lambda b: release.wait(30) and _ok(b))
    probing.set_probe_timeout(0.2)
    assert probing.probe_timeout() == 0.2
    start = time.perf_counter()
    results = {r.backend: r for r in wd.probe_all()}
    assert time.perf_counter() - start < 3
    assert "within 0.2 s" in results["hangs"].reason
    assert results["cpu"].available  # one hung backend does not spoil the others


def test_probe_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WHICHDEVICE_PROBE_TIMEOUT", "2.5")
    assert probing.probe_timeout() == 2.5
    for bad in ("abc", "-1", "nan"):  # refused naming the valid forms: tests/hardware/test_faults.py
        monkeypatch.setenv("WHICHDEVICE_PROBE_TIMEOUT", bad)
        with pytest.raises(DeviceError, match="is not a time limit"):
            probing.probe_timeout()
    monkeypatch.setenv("WHICHDEVICE_PROBE_TIMEOUT", "0")
    assert probing.probe_timeout() == math.inf  # 0 is no limit, as for GNU timeout
    probing.set_probe_timeout(1.0)
    assert probing.probe_timeout() == 1.0  # the explicit setting wins
    with pytest.raises(ValueError):
        probing.set_probe_timeout(0)


# ---------------------------------------------------------------------------- cache and threads


def test_results_are_cached_and_refresh_probes_again() -> None:
    calls: list[int] = []

    def counted(backend: wd.Backend) -> ProbeResult:
        calls.append(1)
        return _ok(backend)

    _custom("counted", counted)
    first = wd.probe("counted")
    assert wd.probe("counted") is first
    assert probing.probe_counts()["counted"] == 1
    again = wd.probe("counted", refresh=True)
    assert again is not first and again == first.__class__(**{**again.__dict__})
    assert len(calls) == 2
    assert probing.probe_counts()["counted"] == 2
    assert wd.probe("counted") is again
    probing.clear_cache("counted")
    assert "counted" not in probing.probe_counts()
    wd.probe("counted")
    assert len(calls) == 3


def test_sixteen_threads_get_one_probe_each_and_identical_results() -> None:
    calls: list[int] = []

    def slow(backend: wd.Backend) -> ProbeResult:
        calls.append(1)
        time.sleep(0.2)  # long enough that every thread arrives while it runs
        return _ok(backend)

    _custom("slow", slow)
    barrier = threading.Barrier(16)
    answers: list[tuple[ProbeResult, ...]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            answers.append(wd.probe_all())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert len(answers) == 16
    first = answers[0]
    for other in answers[1:]:
        assert all(a is b for a, b in zip(first, other, strict=True))
    assert len(calls) == 1
    assert probing.probe_counts() == {name: 1 for name in registry.backend_names()}


# ------------------------------------------------------------------------- CUDA: the NVML switch


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """Make this CPU-only torch look like a CUDA build with 2 GPUs; record the NVML switch it sees."""
    import torch

    seen: list[str | None] = []

    def is_available() -> bool:
        seen.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))
        return True

    def device_count() -> int:
        seen.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))
        return 2

    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 2, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr("whichdevice.hardware.probes.nvidia.nvml_devices", NvidiaStack)
    monkeypatch.setattr("whichdevice.hardware.probes.nvidia.smi_devices", NvidiaStack)
    return seen


@pytest.mark.parametrize("previous", [None, "0", "1", ""])
def test_cuda_probe_scopes_the_nvml_switch(
    fake_cuda: list[str | None], monkeypatch: pytest.MonkeyPatch, previous: str | None
) -> None:
    if previous is None:
        monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", previous)
    result = wd.probe("cuda")
    assert result.available and result.device_count == 2
    assert result.variant == "cuda" and result.versions.get("cuda") == "12.8"
    assert fake_cuda and set(fake_cuda) == {"1"}
    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == previous
    assert any("nvidia-ml-py" in w for w in result.warnings)


def test_cuda_probe_maps_visible_devices_to_physical_ids(
    fake_cuda: list[str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    result = wd.probe("cuda")
    assert [d.physical_id for d in result.devices] == ["3", "1"]
    assert result.visible is not None and result.visible.variable == "CUDA_VISIBLE_DEVICES"


def test_cuda_probe_after_cuda_init_reads_properties_and_skips_the_switch(
    fake_cuda: list[str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    import torch

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    props = types.SimpleNamespace(name="NVIDIA H200", total_memory=141 * 2**30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    result = wd.probe("cuda")
    assert [d.name for d in result.devices] == ["NVIDIA H200", "NVIDIA H200"]
    assert result.min_capability == (9, 0)
    assert set(fake_cuda) == {None}  # counted without setting the NVML switch


def test_probe_all_leaves_the_nvml_switch_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    wd.probe_all(refresh=True)
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    wd.probe_all(refresh=True)
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"


@pytest.mark.parametrize("previous", [None, "0", "1"])
def test_scoped_env_restores_previous_value_including_unset(
    monkeypatch: pytest.MonkeyPatch, previous: str | None
) -> None:
    name = "PYTORCH_NVML_BASED_CUDA_CHECK"
    if previous is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, previous)
    with envhooks.scoped_env(**{name: "1", "WHICHDEVICE_TEST_OTHER": "x"}):
        assert os.environ[name] == "1"
        assert os.environ["WHICHDEVICE_TEST_OTHER"] == "x"
    assert os.environ.get(name) == previous
    assert "WHICHDEVICE_TEST_OTHER" not in os.environ
    with pytest.raises(KeyError), envhooks.scoped_env(**{name: "1"}):
        raise KeyError("inside")
    assert os.environ.get(name) == previous


def test_scoped_env_overlapping_scopes_restore_the_original(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two threads' scopes that do not nest: A opens, B opens, A closes, B closes.
    name = "PYTORCH_NVML_BASED_CUDA_CHECK"
    monkeypatch.delenv(name, raising=False)
    a = envhooks.scoped_env(**{name: "1"})
    b = envhooks.scoped_env(**{name: "1"})
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert os.environ.get(name) == "1"  # B is still inside its scope
    b.__exit__(None, None, None)
    assert name not in os.environ


# --------------------------------------------------------------------------- MLU: the CNDEV switch


@pytest.fixture
def fake_vendor_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], None]:
    """Write an importable fake vendor package; undo its import and its torch attribute afterwards."""
    import torch

    made: list[tuple[str, str]] = []

    def make(package: str, source: str) -> None:
        path = tmp_path / package.replace(".", "/")
        path.mkdir(parents=True, exist_ok=True)
        parent = tmp_path
        for part in package.split(".")[:-1]:
            parent = parent / part
            (parent / "__init__.py").touch()
        (path / "__init__.py").write_text(textwrap.dedent(source))
        made.append((package.split(".")[0], source))

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for top, _ in made:
        for mod in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[mod]
    for attr in ("mlu", "hpu"):
        if attr in vars(torch):
            delattr(torch, attr)


_FAKE_DEVICE_MODULE = """
import os, types
import torch

SEEN = []

class _Module:
    def is_available(self):
        SEEN.append(os.environ.get({switch!r}))
        return True

    def device_count(self):
        SEEN.append(os.environ.get({switch!r}))
        return {count}

    def get_device_properties(self, i):
        return types.SimpleNamespace(name={name!r}, total_memory=64 * 2**30)

IMPORT_TIME_INT64 = os.environ.get("PT_ENABLE_INT64_SUPPORT", "<unset>")
torch.{attr} = _Module()
"""


def test_mlu_probe_scopes_the_cndev_switch(fake_vendor_package, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("PYTORCH_CNDEV_BASED_MLU_CHECK", raising=False)
    fake_vendor_package(
        "torch_mlu",
        _FAKE_DEVICE_MODULE.format(switch="PYTORCH_CNDEV_BASED_MLU_CHECK", count=2, name="MLU370", attr="mlu"),
    )
    result = wd.probe("mlu")
    assert result.available and result.device_count == 2, result.reason
    assert [d.name for d in result.devices] == ["MLU370", "MLU370"]
    assert set(sys.modules["torch_mlu"].SEEN) == {"1"}
    assert "PYTORCH_CNDEV_BASED_MLU_CHECK" not in os.environ


# ------------------------------------------------------------------------------ Gaudi env hook


def test_gaudi_int64_set_before_habana_import_only_when_unset(
    fake_vendor_package,
    no_hook_history,
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    fake_vendor_package(
        "habana_frameworks.torch",
        _FAKE_DEVICE_MODULE.format(switch="PT_ENABLE_INT64_SUPPORT", count=8, name="GAUDI3", attr="hpu"),
    )
    result = wd.probe("hpu")
    assert result.available and result.device_count == 8, result.reason
    assert sys.modules["habana_frameworks.torch"].IMPORT_TIME_INT64 == "1"
    assert os.environ["PT_ENABLE_INT64_SUPPORT"] == "1"
    assert [(a.name, a.action) for a in result.env_set] == [("PT_ENABLE_INT64_SUPPORT", "set")]
    assert {d.generation for d in result.devices} == {"gaudi3"}
    assert envhooks.applied_env() == {"PT_ENABLE_INT64_SUPPORT": "1"}
    # Idempotent: probing again reports the same action and changes nothing.
    again = wd.probe("hpu", refresh=True)
    assert [(a.name, a.value, a.action) for a in again.env_set] == [("PT_ENABLE_INT64_SUPPORT", "1", "set")]
    assert not again.warnings


def test_gaudi_keeps_users_value_real_probe(fake_vendor_package, no_hook_history, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PT_ENABLE_INT64_SUPPORT", "0")
    fake_vendor_package(
        "habana_frameworks.torch",
        _FAKE_DEVICE_MODULE.format(switch="PT_ENABLE_INT64_SUPPORT", count=8, name="GAUDI2", attr="hpu"),
    )
    result = wd.probe("hpu")
    assert sys.modules["habana_frameworks.torch"].IMPORT_TIME_INT64 == "0"
    assert os.environ["PT_ENABLE_INT64_SUPPORT"] == "0"
    assert [a.action for a in result.env_set] == ["kept"]
    assert any("PT_ENABLE_INT64_SUPPORT=0" in w and "int64" in w for w in result.warnings)


@pytest.mark.usefixtures("no_hook_history")
def test_gaudi_hook_under_simulation_sets_only_when_unset() -> None:
    with simulate("hpu:8"):
        result = wd.probe("hpu")
        assert os.environ["PT_ENABLE_INT64_SUPPORT"] == "1"
        assert [(a.name, a.value, a.action) for a in result.env_set] == [("PT_ENABLE_INT64_SUPPORT", "1", "set")]
        assert not result.warnings
        # Idempotent within the process.
        again = wd.probe("hpu", refresh=True)
        assert [a.action for a in again.env_set] == ["set"]
        assert os.environ["PT_ENABLE_INT64_SUPPORT"] == "1"
    assert "PT_ENABLE_INT64_SUPPORT" not in os.environ  # the simulation undid its hook


@pytest.mark.usefixtures("no_hook_history")
def test_gaudi_hook_keeps_users_different_value_with_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PT_ENABLE_INT64_SUPPORT", "0")
    with simulate("hpu:8"):
        result = wd.probe("hpu")
        assert os.environ["PT_ENABLE_INT64_SUPPORT"] == "0"
    assert result.available
    (action,) = result.env_set
    assert (action.action, action.value) == ("kept", "0")
    assert any("kept your PT_ENABLE_INT64_SUPPORT=0" in w and "int64" in w for w in result.warnings)
    assert os.environ["PT_ENABLE_INT64_SUPPORT"] == "0"


@pytest.mark.usefixtures("no_hook_history")
def test_gaudi_hook_silent_when_user_already_set_the_same_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PT_ENABLE_INT64_SUPPORT", "1")
    with simulate("hpu:8"):
        result = wd.probe("hpu")
    assert result.env_set == ()
    assert envhooks.applied_env() == {}


@pytest.mark.usefixtures("no_hook_history")
def test_apply_env_defaults_stages() -> None:
    mps = wd.get_backend("mps")
    assert envhooks.apply_env_defaults(mps, "import") == ()
    assert "PYTORCH_ENABLE_MPS_FALLBACK" not in os.environ
    (action,) = envhooks.apply_env_defaults(mps, "select")
    assert (action.name, action.value, action.action) == ("PYTORCH_ENABLE_MPS_FALLBACK", "1", "set")
    assert os.environ["PYTORCH_ENABLE_MPS_FALLBACK"] == "1"
    assert action.to_dict()["action"] == "set"


# ----------------------------------------------------------------------------------------- fork


def _child_probes_again(names: tuple[str, ...]) -> None:
    # Runs in the forked child: must neither deadlock nor raise.
    results = [wd.probe(n, refresh=True, timeout=0.5) for n in names]
    assert results[-1].backend == names[-1]
    assert wd.probe("cpu").available
    assert wd.backends()


def _fork_and_wait(target: Callable[..., None], *args: object) -> int | None:
    process = multiprocessing.get_context("fork").Process(target=target, args=args)
    process.start()
    process.join(30)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail("the forked child deadlocked")
    return process.exitcode


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_can_probe_again() -> None:
    wd.probe_all()
    assert _fork_and_wait(_child_probes_again, registry.backend_names()) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_a_probe_is_in_flight_does_not_deadlock_the_child(release: threading.Event) -> None:
    started = threading.Event()

    def hangs(backend: wd.Backend) -> ProbeResult:
        started.set()
        release.wait(30)
        return _ok(backend)

    _custom("inflight", hangs)
    prober = threading.Thread(target=wd.probe, args=("inflight",), kwargs={"timeout": 20}, daemon=True)
    prober.start()
    assert started.wait(10)
    # The parent's probe of "inflight" is in flight now: the child must not wait for it.
    assert _fork_and_wait(_child_probes_again, ("inflight", "cpu")) == 0
    release.set()
    prober.join(10)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_registry_lock_is_held_does_not_deadlock_the_child() -> None:
    locked, unlock = threading.Event(), threading.Event()

    def hold() -> None:
        with registry._lock, envhooks._lock:
            locked.set()
            unlock.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert locked.wait(10)
    try:
        assert _fork_and_wait(_child_probes_again, ("cpu",)) == 0
    finally:
        unlock.set()
        holder.join(10)


@pytest.mark.parametrize(
    ("isa", "native"),
    [("AVX512_CORE", False), ("avx2", False), ("AVX512_CORE_VNNI", False), ("AVX512_CORE_BF16", True), ("", True)],
)
def test_onednn_isa_cap_turns_native_bf16_off(isa: str, native: bool) -> None:
    """ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 makes torch emulate bf16 even where the CPU has it."""
    with simulate(f"cpu,flags=avx512_bf16,isa={isa}" if isa else "cpu,flags=avx512_bf16"):
        result = wd.probe("cpu")
        res = wd.resolve_device()
    assert result.features == frozenset({"avx512_bf16"})
    assert result.devices[0].bf16 is native
    assert res.dtype_name == ("bfloat16" if native else "float32")
    if not native:
        assert any("unset ONEDNN_MAX_CPU_ISA" in w for w in result.warnings)
        assert "caps oneDNN below AVX512_CORE_BF16" in res.explain()


def test_real_cpu_probe_reads_the_onednn_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    result = wd.probe("cpu", refresh=True)
    assert result.devices[0].bf16 is False
    assert wd.resolve_device().dtype_name == "float32"


def test_the_answer_follows_a_visible_devices_edit(monkeypatch: pytest.MonkeyPatch) -> None:
    # A notebook: a first call under CUDA_VISIBLE_DEVICES="0,1", then the user edits the variable.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with simulate("cuda:4,cc=8.0"):
        first = wd.resolve_device(task="training")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
        second = wd.resolve_device(task="training")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        third = wd.resolve_device(task="training")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        fourth = wd.resolve_device(task="training")
    assert first.launch_command("t.py")[:2] == ["env", "CUDA_VISIBLE_DEVICES=0,1"]
    assert second.launch_command("t.py") == ["env", "CUDA_VISIBLE_DEVICES=2", "torchrun", "--nproc-per-node=1", "t.py"]
    assert third.launch_command("t.py") == ["torchrun", "--nproc-per-node=4", "t.py"]
    assert fourth.backend.name == "cpu"
