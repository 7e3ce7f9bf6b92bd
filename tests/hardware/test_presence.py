"""whichdevice.hardware.probes.presence: a backend whose package is absent is answered without its probe module."""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
from importlib.util import find_spec
from types import ModuleType

import pytest

import whichdevice as wd
from whichdevice.core.records import ProbeResult
from whichdevice.hardware.probes import common, hpu, tpu, vendor

# The rows presence.py answers for, and the module that holds each one's own probe.
GATED = {"neuron": vendor, "tpu": tpu, "npu": vendor, "hpu": hpu, "mlu": vendor, "musa": vendor}
# The rows whose runtime comes with torch: presence.py answers where this torch was built without it.
BUILT = ("cuda", "xpu", "mps")


def _probe_module(name: str) -> ModuleType:
    return importlib.import_module(f"whichdevice.hardware.probes.{name}")


def _not_built_here() -> list[str]:
    import platform

    import torch

    presence = _presence()
    built = {
        "cuda": presence.cuda_built(torch),
        "xpu": presence.xpu_built(torch),
        "mps": presence.mps_built(torch, platform.system()),
    }
    return [name for name in BUILT if not built[name]]


def _presence() -> ModuleType:
    # Imported here, not above: the subprocess test below checks the import-time promise on its own.
    return importlib.import_module("whichdevice.hardware.probes.presence")


def _absent_here() -> list[str]:
    return [name for name in GATED if find_spec(wd.get_backend(name).module.split(".")[0]) is None]


def test_the_rows_name_the_presence_probes() -> None:
    presence = _presence()
    for name in (*GATED, *BUILT):
        assert wd.get_backend(name).probe is getattr(presence, f"probe_{name}"), name


def test_a_resolve_imports_no_probe_of_an_absent_package() -> None:
    absent = _absent_here()
    assert absent, "this test needs a backend whose package is not installed"
    code = (
        "import json, sys, whichdevice; res = whichdevice.resolve_device(); "
        "print(json.dumps([res.device, sorted(m for m in sys.modules if m.startswith('whichdevice.'))]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    device, modules = json.loads(out.stdout.splitlines()[-1])
    assert device == "cpu"
    imported = sorted({GATED[name].__name__ for name in absent} & set(modules))
    assert imported == [], f"imported for backends whose package is absent ({', '.join(absent)}): {imported}"
    # The runtimes this torch was built without: their probe modules, and the readings records, stay out.
    unbuilt = {f"whichdevice.hardware.probes.{name}" for name in _not_built_here()}
    if unbuilt == {f"whichdevice.hardware.probes.{name}" for name in BUILT}:
        unbuilt.add("whichdevice.hardware.probes.readings")
    assert sorted(unbuilt & set(modules)) == []


@pytest.mark.parametrize("name", BUILT)
def test_a_runtime_this_torch_lacks_gets_the_answer_its_probe_gives(name: str) -> None:
    presence = _presence()
    if name not in _not_built_here():
        pytest.skip(f"this torch has {name} built in")
    row = wd.get_backend(name)
    quick = getattr(presence, f"probe_{name}")(row)
    assert quick == getattr(_probe_module(name), f"probe_{name}")(row)
    assert not quick.installed and quick.reason


@pytest.mark.parametrize("name", BUILT)
def test_a_runtime_this_torch_has_goes_to_its_own_probe(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    presence = _presence()
    module = _probe_module(name)
    monkeypatch.setattr(presence, f"{name}_built", lambda *args: True)
    own = ProbeResult(name, installed=True, available=True, device_count=1)
    monkeypatch.setattr(module, f"probe_{name}", lambda backend: own)
    assert getattr(presence, f"probe_{name}")(wd.get_backend(name)) is own


def test_the_readings_records_are_still_read_from_common() -> None:
    """Third-party probes import DeviceReading and RuntimeReadings from probes.common, where they were defined."""
    from whichdevice.hardware.probes import readings

    assert common.DeviceReading is readings.DeviceReading
    assert common.RuntimeReadings is readings.RuntimeReadings
    with pytest.raises(AttributeError):
        common.NoSuchReading  # noqa: B018


@pytest.mark.parametrize("name", list(GATED))
def test_an_absent_package_gets_the_answer_its_probe_gives(name: str) -> None:
    presence = _presence()
    if name not in _absent_here():
        pytest.skip(f"{name}'s package is installed here")
    row = wd.get_backend(name)
    quick = getattr(presence, f"probe_{name}")(row)
    assert quick == getattr(GATED[name], f"probe_{name}")(row)
    assert quick.reason == common.absent_reason(row) and not quick.installed


def test_an_installed_package_goes_to_its_own_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    presence = _presence()
    seen: list[str] = []

    def own(backend: wd.Backend) -> ProbeResult:
        seen.append(backend.name)
        return ProbeResult(backend.name, installed=True, available=True, device_count=1)

    for name, module in GATED.items():
        monkeypatch.setattr(module, f"probe_{name}", own)
    monkeypatch.setattr(presence, "vendor_installed", lambda backend: True)
    monkeypatch.setattr(presence, "hpu_installed", lambda: True)
    monkeypatch.setattr(presence, "tpu_installed", lambda backend: True)
    for name in GATED:
        assert getattr(presence, f"probe_{name}")(wd.get_backend(name)).available, name
    assert seen == list(GATED)


def test_torch_xla_alone_sends_tpu_to_its_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_xla without torch-tpu is named in tpu's reason, which only tpu.py's probe writes."""
    presence = _presence()
    if find_spec("torch_tpu") is not None:
        pytest.skip("torch_tpu is installed here")
    real = presence.package_version
    monkeypatch.setattr(presence, "package_version", lambda d: "2.9.0" if d == presence.XLA_PACKAGE else real(d))
    monkeypatch.setattr(tpu, "package_version", lambda d: "2.9.0" if d == presence.XLA_PACKAGE else real(d))
    result = presence.probe_tpu(wd.get_backend("tpu"))
    assert not result.installed
    assert "torch_xla 2.9.0 is installed" in (result.reason or "")


def test_a_plugin_row_may_reuse_a_vendor_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """A third-party row named after its own device may name probe_npu: vendor.py's reader serves it."""
    presence = _presence()
    row = dataclasses.replace(wd.get_backend("npu"), name="plugdev", module="plugdev_runtime")
    read: list[str] = []
    monkeypatch.setattr(presence, "vendor_installed", lambda backend: True)
    monkeypatch.setattr(vendor, "read_vendor", lambda b: read.append(b.name) or vendor.VendorReadings(installed=False))
    result = presence.probe_npu(row)
    assert read == ["plugdev"]
    assert result.backend == "plugdev" and not result.installed
