"""The backend registry: records, detection order, lookup errors, third-party backends, drift."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
import warnings

import pytest

import whichdevice as wd
from whichdevice.core.errors import UnknownDeviceError, closest_match
from whichdevice.hardware import registry
from whichdevice.hardware.probing import ProbeResult

EXPECTED_ORDER = ("neuron", "tpu", "npu", "hpu", "mlu", "musa", "cuda", "xpu", "mps", "cpu")


def _record(name: str, **changes: object) -> wd.Backend:
    fields: dict[str, object] = {
        "name": name,
        "hardware": f"{name} test hardware",
        "package": f"{name}-pkg",
        "module": f"{name}_not_installed_module",
        "probe_ref": lambda b: ProbeResult(b.name, installed=True, available=True, device_count=1),
    }
    fields.update(changes)
    return wd.Backend(**fields)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- records, order


def test_all_ten_device_strings_in_declared_order() -> None:
    assert registry.backend_names() == EXPECTED_ORDER
    assert tuple(b.name for b in wd.backends()) == EXPECTED_ORDER
    assert all(isinstance(b, wd.Backend) for b in wd.backends())


def test_backends_that_make_cuda_look_available_come_before_cuda() -> None:
    names = registry.backend_names()
    assert names.index("npu") < names.index("cuda")
    assert names.index("neuron") < names.index("cuda")
    assert names[-1] == "cpu"


def test_get_backend_returns_the_record_in_backends() -> None:
    for record in wd.backends():
        assert wd.get_backend(record.name) is record
        assert str(record) == record.name
    hpu = wd.get_backend("hpu")
    assert hpu.module == "habana_frameworks"
    assert hpu.package == "habana-torch-plugin"
    assert [d.name for d in hpu.env_defaults] == ["PT_ENABLE_INT64_SUPPORT"]
    assert wd.get_backend("cuda").install_command.startswith("pip install torch")
    assert wd.get_backend("npu").install_command == "pip install torch-npu"


def test_registry_view_is_read_only() -> None:
    view = registry.registry_view()
    assert set(view) == set(EXPECTED_ORDER)
    with pytest.raises(TypeError):
        view["fake"] = _record("fake")  # type: ignore[index]


def test_probe_refs_resolve_without_importing_vendor_packages() -> None:
    for record in wd.backends():
        assert callable(record.probe), record.name


# ------------------------------------------------------------------------------------ unknown names


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("gpu", "cuda"), ("GPU", "cuda"), ("Cuda", "cuda"), ("gaudi", "hpu"), ("cdua", "cuda"), ("rocm", "cuda")],
)
def test_unknown_name_names_closest_match_and_valid_names(typed: str, meant: str) -> None:
    with pytest.raises(wd.DeviceError) as info:
        wd.get_backend(typed)
    assert isinstance(info.value, UnknownDeviceError)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert repr(typed) in message
    assert f"Did you mean {meant!r}?" in message
    for name in EXPECTED_ORDER:
        assert name in message


def test_unknown_name_without_a_close_match_still_lists_valid_names() -> None:
    with pytest.raises(UnknownDeviceError) as info:
        wd.get_backend("zzzzzzzz")
    assert "Did you mean" not in str(info.value)
    assert "cuda" in str(info.value) and "cpu" in str(info.value)


def test_non_string_name_raises_device_error() -> None:
    with pytest.raises(wd.DeviceError, match="valid names"):
        wd.get_backend(0)  # type: ignore[arg-type]


def test_closest_match_handles_indices_and_spelling() -> None:
    assert closest_match("cuda:1", EXPECTED_ORDER) == "cuda"
    assert closest_match("Habana", EXPECTED_ORDER) == "hpu"
    assert closest_match("trainium", EXPECTED_ORDER) == "neuron"
    assert closest_match("qqqq", EXPECTED_ORDER) is None


# -------------------------------------------------------------------------------- register_backend


def test_register_new_backend_goes_before_cpu_and_is_probed() -> None:
    record = wd.register_backend(_record("fancy"))
    assert record is wd.get_backend("fancy")
    names = registry.backend_names()
    assert names[-2:] == ("fancy", "cpu")
    assert wd.probe("fancy").available


def test_register_duplicate_without_replace_raises() -> None:
    with pytest.raises(ValueError, match="replace=True"):
        wd.register_backend(_record("cuda"))
    assert wd.get_backend("cuda").package == "torch"
    wd.register_backend(_record("fancy"))
    with pytest.raises(ValueError, match="already registered"):
        wd.register_backend(_record("fancy", package="other"))
    assert wd.get_backend("fancy").package == "fancy-pkg"


def test_register_replace_keeps_position_and_drops_cached_result() -> None:
    assert not wd.probe("npu").available
    replacement = _record("npu", package="torch-npu")
    wd.register_backend(replacement, replace=True)
    assert wd.get_backend("npu") is replacement
    assert registry.backend_names() == EXPECTED_ORDER
    assert wd.probe("npu").available  # the old cached "not installed" was forgotten


def test_registering_inside_a_simulation_reaches_the_real_answers_too() -> None:
    # The registry is one per process: a backend registered while a simulation is active must
    # not leave the real store answering from before it existed.
    assert wd.resolve_device().device == "cpu"  # memoised in the real store
    with wd.testing.simulate(others="real"):
        assert wd.resolve_device().device == "cpu"  # memoised in the simulation's store
        wd.register_backend(_record("fancy"))
        assert wd.resolve_device().backend.name == "fancy"
    assert wd.resolve_device().backend.name == "fancy"
    registry.unregister_backend("fancy")
    assert wd.resolve_device().device == "cpu"


def test_register_before_places_the_backend() -> None:
    wd.register_backend(_record("fancy"), before="cuda")
    names = registry.backend_names()
    assert names.index("fancy") == names.index("cuda") - 1
    wd.register_backend(_record("fancy", package="moved"), replace=True, before="neuron")
    assert registry.backend_names()[0] == "fancy"
    assert registry.backend_names().count("fancy") == 1


def test_register_with_unknown_before_changes_nothing() -> None:
    with pytest.raises(UnknownDeviceError, match="no other backend named 'nope'"):
        wd.register_backend(_record("fancy"), before="nope")
    with pytest.raises(UnknownDeviceError):
        wd.get_backend("fancy")
    assert registry.backend_names() == EXPECTED_ORDER
    # Nothing half-registered: the same record can be registered properly afterwards.
    wd.register_backend(_record("fancy"), before="cuda")
    assert "fancy" in registry.backend_names()


def test_replace_with_unknown_or_own_before_keeps_the_record_in_order() -> None:
    with pytest.raises(UnknownDeviceError):
        wd.register_backend(_record("npu"), replace=True, before="nope")
    with pytest.raises(UnknownDeviceError):
        wd.register_backend(_record("npu"), replace=True, before="npu")
    assert registry.backend_names() == EXPECTED_ORDER
    assert wd.get_backend("npu").package == "torch-npu"


@pytest.mark.parametrize("bad", ["", "Fancy", "fan-cy", "1abc"])
def test_register_rejects_bad_names(bad: str) -> None:
    with pytest.raises(ValueError, match="lower-case identifier"):
        wd.register_backend(_record(bad))


def test_register_rejects_non_records() -> None:
    with pytest.raises(TypeError, match=r"whichdevice\.Backend"):
        wd.register_backend("cuda")  # type: ignore[arg-type]


def test_unregister_and_reset_restore_builtins() -> None:
    registry.unregister_backend("mps")
    assert "mps" not in registry.backend_names()
    with pytest.raises(UnknownDeviceError):
        registry.unregister_backend("mps")
    registry._reset()
    assert registry.backend_names() == EXPECTED_ORDER


# ------------------------------------------------------------------------------------ entry points


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """An importable module ``wd_test_plugin`` defining a record, a factory and a broken factory."""
    (tmp_path / "wd_test_plugin.py").write_text(
        textwrap.dedent(
            """
            from whichdevice import Backend
            from whichdevice.hardware.probing import ProbeResult

            def _probe(backend):
                return ProbeResult(backend.name, installed=True, available=True, device_count=2)

            RECORD = Backend(name="plugdev", hardware="Plugin device", package="plugdev",
                             module="plugdev_missing", probe_ref=_probe)

            def factory():
                return Backend(name="factorydev", hardware="Factory device", package="factorydev",
                               module="factorydev_missing", probe_ref=_probe)

            def broken():
                raise RuntimeError("plugin exploded")

            NOT_A_BACKEND = 42

            BADLY_NAMED = Backend(name="Plug-Dev", hardware="Plugin device", package="plugdev",
                                  module="plugdev_missing", probe_ref=_probe)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wd_test_plugin", raising=False)
    yield "wd_test_plugin"
    sys.modules.pop("wd_test_plugin", None)


def _fake_entry_points(monkeypatch, eps):  # type: ignore[no-untyped-def]
    # As fsspec's tests do: replace the entry points the registry reads with a fixed list.
    def entry_points(**params):  # type: ignore[no-untyped-def]
        assert params == {"group": registry.ENTRY_POINT_GROUP}
        return eps

    monkeypatch.setattr(registry, "entry_points", entry_points)
    registry._reset()


def _ep(name: str, value: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=value, group=registry.ENTRY_POINT_GROUP)


def test_entry_point_backends_are_loaded(monkeypatch, plugin_module) -> None:  # type: ignore[no-untyped-def]
    _fake_entry_points(monkeypatch, [_ep("plug", f"{plugin_module}:RECORD"), _ep("fact", f"{plugin_module}:factory")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names = registry.backend_names()
    assert names[-3:] == ("plugdev", "factorydev", "cpu")
    assert wd.get_backend("plugdev").hardware == "Plugin device"
    result = wd.probe("factorydev")
    assert result.available and result.device_count == 2


def test_a_broken_plugin_only_warns(monkeypatch, plugin_module) -> None:  # type: ignore[no-untyped-def]
    _fake_entry_points(
        monkeypatch,
        [
            _ep("bad", f"{plugin_module}:broken"),
            _ep("wrongtype", f"{plugin_module}:NOT_A_BACKEND"),
            _ep("gone", "no_such_module_anywhere:thing"),
            _ep("badname", f"{plugin_module}:BADLY_NAMED"),
            _ep("good", f"{plugin_module}:RECORD"),
        ],
    )
    with pytest.warns(UserWarning) as caught:
        names = registry.backend_names()
    messages = [str(w.message) for w in caught]
    assert any("'bad'" in m and "plugin exploded" in m for m in messages)
    assert any("'wrongtype'" in m and "not a whichdevice.Backend" in m for m in messages)
    assert any("'gone'" in m for m in messages)
    # a plugin is held to the same naming rule as register_backend: "Plug-Dev" could never be asked for
    assert any("'badname'" in m and "lower-case identifier" in m for m in messages)
    assert "Plug-Dev" not in names
    assert "plugdev" in names  # the good plugin still loaded
    assert names[: len(EXPECTED_ORDER) - 1] == EXPECTED_ORDER[:-1]
    assert wd.probe("cpu").available


def test_entry_point_never_overrides_a_builtin(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "wd_test_shadow.py").write_text(
        "from whichdevice import Backend\n"
        "RECORD = Backend(name='cuda', hardware='fake', package='fake', module='fake', "
        "probe_ref=lambda b: None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_entry_points(monkeypatch, [_ep("shadow", "wd_test_shadow:RECORD")])
    try:
        assert wd.get_backend("cuda").package == "torch"
        assert registry.backend_names() == EXPECTED_ORDER
    finally:
        sys.modules.pop("wd_test_shadow", None)


# ------------------------------------------------------------------------------ drift vs accelerate


DRIFT_KEYS = ("cuda", "xpu", "mlu", "musa", "npu", "hpu", "neuron")


def test_static_facts_match_accelerate_constants() -> None:
    from accelerate.utils import constants

    visible = constants.DEVICE_VISIBLE_DEVICES_ENV_VARS
    dist = constants.TORCH_DISTRIBUTED_BACKENDS
    shared_visible = [name for name in registry.backend_names() if name in visible]
    shared_dist = [name for name in registry.backend_names() if name in dist]
    # The comparison must not go vacuous if accelerate renames its keys.
    assert set(DRIFT_KEYS) <= set(shared_visible)
    assert set(DRIFT_KEYS) <= set(shared_dist)
    for name in shared_visible:
        record = wd.get_backend(name)
        assert record.visible_devices_env, name
        assert record.visible_devices_env[0] == visible[name], name
    for name in shared_dist:
        assert wd.get_backend(name).distributed_backend == dist[name], name


# --------------------------------------------------------------------------------- import is light


def test_import_whichdevice_imports_no_heavy_package() -> None:
    code = (
        "import sys, whichdevice, whichdevice.hardware.registry, whichdevice.hardware.visible, whichdevice.testing\n"
        "whichdevice.backends(); whichdevice.get_backend('cuda')\n"
        "print(','.join(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "", f"import whichdevice imported: {out.stdout.strip()}"
