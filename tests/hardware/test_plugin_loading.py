"""A ``whichdevice.backends`` plugin that misbehaves is left out, named by its package, with the fix.

The plugins are real: a package and its ``*.dist-info`` with ``entry_points.txt`` on ``sys.path``,
found by ``importlib.metadata`` and loaded by the registry's (time-limited) loader.
"""

from __future__ import annotations

import shlex
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

import whichdevice as wd
from steering import STEERING
from whichdevice import report
from whichdevice.hardware import registry
from whichdevice.hardware.plugin_loading import plugin_problems

HEAD = "from whichdevice import Backend, ProbeResult\n"
PLUGINS = {
    # distribution -> (module body, entry point value)
    "wd-exit-plugin": ("def factory():\n    import sys\n    sys.exit(4)\n", "wdexitplug:factory"),
    "wd-not-a-backend": ("RECORD = 42\n", "wdnotplug:RECORD"),
    "wd-bad-name": (
        HEAD + "RECORD = Backend(name='Bad-Name', hardware='x', package='x', module='x_missing', "
        "probe_ref=lambda b: None)\n",
        "wdbadnameplug:RECORD",
    ),
    "wd-none-probe": (
        HEAD + "def probe(b):\n    return None\n"
        "RECORD = Backend(name='nonedev', hardware='None device', package='nonedev-runtime', "
        "module='nonedev_missing', probe_ref=probe)\n",
        "wdnoneplug:RECORD",
    ),
}


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in STEERING:
        monkeypatch.delenv(name, raising=False)
    for dist, (body, value) in PLUGINS.items():
        module = value.split(":")[0]
        (tmp_path / f"{module}.py").write_text(body)
        info = tmp_path / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{module} = {value}\n")
    sys.path.insert(0, str(tmp_path))
    registry._reset()
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        for _, value in PLUGINS.values():
            sys.modules.pop(value.split(":")[0], None)
        registry._reset()


def _loaded() -> tuple[str, ...]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return registry.backend_names()


def test_a_plugin_calling_sys_exit_does_not_end_resolve_device(plugins: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = wd.resolve_device("cpu")
    assert res.device == "cpu"
    problem = plugin_problems()["wdexitplug"]
    assert "called sys.exit(4)" in problem and "'wd-exit-plugin'" in problem
    assert any("wd-exit-plugin" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    ("entry_point", "distribution", "says"),
    [
        ("wdexitplug", "wd-exit-plugin", "called sys.exit(4)"),
        ("wdnotplug", "wd-not-a-backend", "gave int, not a whichdevice.Backend"),
        ("wdbadnameplug", "wd-bad-name", "lower-case identifier like 'cuda', not 'Bad-Name'"),
    ],
)
def test_a_plugin_that_does_not_load_is_named_by_its_package_with_the_fix(
    plugins: None, entry_point: str, distribution: str, says: str
) -> None:
    names = _loaded()
    problem = plugin_problems()[entry_point]
    assert says in problem and f"from the package {distribution!r}" in problem
    upgrade = problem.split("upgrade it (", 1)[1].split(")", 1)[0]
    assert shlex.split(upgrade) == ["pip", "install", "--upgrade", distribution]
    assert f"pip uninstall {distribution}" in problem
    assert "Bad-Name" not in names and "nonedev" in names


def test_the_report_lists_every_plugin_that_did_not_load(plugins: None) -> None:
    _loaded()
    data = report.gather(tasks=("inference",), simulate=["cpu"])
    sources = {w["source"]: w["message"] for w in data["warnings"]}
    for entry_point in ("wdexitplug", "wdnotplug", "wdbadnameplug"):
        assert f"plugin:{entry_point}" in sources
    # The packaged schema allows what the report writes for them.
    jsonschema.Draft202012Validator(report.load_schema()).validate(data)
    assert "wd-not-a-backend" in report.render_text(data)


def test_a_plugin_probe_returning_none_names_its_package_and_the_fix(plugins: None) -> None:
    _loaded()
    result = wd.probe("nonedev")
    assert not result.available and result.reason is not None
    assert "returned NoneType, not a ProbeResult" in result.reason
    assert "plugin package 'wd-none-probe'" in result.reason and "pip install --upgrade wd-none-probe" in result.reason
    assert "a bug in the probe" not in result.reason


def test_a_probe_given_to_register_backend_that_returns_none_names_it() -> None:
    def probe(b: wd.Backend) -> None:
        return None

    record = wd.Backend(name="regnone", hardware="x", package="x", module="x_missing", probe_ref=probe)  # type: ignore[arg-type]
    wd.register_backend(record)
    try:
        reason = wd.probe("regnone").reason or ""
        assert "given to register_backend(): make it return a whichdevice.ProbeResult" in reason
        assert "test_plugin_loading" in reason
    finally:
        registry._reset()
