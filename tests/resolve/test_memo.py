"""The memo of resolve_device(): a repeated call reuses the answer until a variable it read changes.

The variables come from declarations (``ENV_VARIABLES`` in each module that reads them) and from
every registered backend's env hooks, so a reader added later, or a plugin backend's hook, cannot be
left out of the key.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import whichdevice as wd
from kernels_versions import GOOD_KERNELS
from whichdevice.core.packages import simulated_packages
from whichdevice.core.records import EnvDefault
from whichdevice.hardware import probes
from whichdevice.hardware.probing import ProbeResult
from whichdevice.resolve import memo
from whichdevice.resolve.arguments import Arguments
from whichdevice.testing import simulate

SRC = Path(wd.__file__).resolve().parent


@pytest.fixture
def compatible_kernels() -> Iterator[None]:
    # As tests/attention/test_kernels_support.py: a kernels version the installed transformers accepts.
    with simulated_packages({"kernels": GOOD_KERNELS}):
        yield


def _plugin(name: str, **fields: object) -> wd.Backend:
    return wd.Backend(
        name=name,
        hardware=f"{name} test hardware",
        package=f"{name}-pkg",
        module=f"{name}_not_installed_module",
        probe_ref=lambda b: ProbeResult(b.name, installed=True, available=True, device_count=1),
        **fields,  # type: ignore[arg-type]
    )


def test_moving_the_hub_cache_through_huggingface_hub_cache_is_seen(compatible_kernels, monkeypatch, tmp_path):
    """HUGGINGFACE_HUB_CACHE (huggingface_hub's older name) moves the cache kernels are read from."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("LOCAL_KERNELS", "KERNELS_CACHE", "HF_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    filled = tmp_path / "filled"
    (filled / "models--kernels-community--activation").mkdir(parents=True)
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(filled))
    with simulate("cuda:1"):
        assert wd.resolve_device(use_kernels="auto").use_kernels is True
        monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "empty"))
        moved = wd.resolve_device(use_kernels="auto")
    assert moved.use_kernels is False
    line = next(s.message for s in moved.trace if s.topic == "kernels")
    assert "not in the cache" in line and str(tmp_path / "empty") in line


def test_a_plugin_backends_hook_variable_is_in_the_key(monkeypatch):
    hook = EnvDefault("PLUGDEV_FAST_PATH", "1", "the plugin's kernels need it", stage="select")
    wd.register_backend(_plugin("plugdev", env_defaults=(hook,)))
    monkeypatch.setenv("PLUGDEV_FAST_PATH", "0")
    before = memo.memo_key(Arguments(device="plugdev"))
    first = wd.resolve_device("plugdev")
    assert any("kept your PLUGDEV_FAST_PATH=0" in s.message for s in first.trace)
    monkeypatch.setenv("PLUGDEV_FAST_PATH", "2")
    assert memo.memo_key(Arguments(device="plugdev")) != before
    second = wd.resolve_device("plugdev")
    assert second is not first
    assert any("kept your PLUGDEV_FAST_PATH=2" in s.message for s in second.trace)


def test_the_key_follows_the_registry(monkeypatch):
    monkeypatch.setenv("LATEDEV_SWITCH", "a")
    key = memo.memo_key(Arguments())
    wd.register_backend(_plugin("latedev", env_defaults=(EnvDefault("LATEDEV_SWITCH", "1", "why"),)))
    assert "LATEDEV_SWITCH" in memo.memo_variables()
    monkeypatch.setenv("LATEDEV_SWITCH", "b")
    assert memo.memo_key(Arguments()) != key
    wd.hardware.registry.unregister_backend("latedev")
    assert "LATEDEV_SWITCH" not in memo.memo_variables()


def test_every_declared_variable_is_in_the_key():
    from whichdevice.attention import kernels as kernels_support
    from whichdevice.device import request
    from whichdevice.launch import distributed

    for module in (request, distributed, kernels_support):
        assert set(module.ENV_VARIABLES) <= set(memo.memo_variables()), module.__name__
    assert "HUGGINGFACE_HUB_CACHE" in memo.memo_variables()


def test_the_key_is_the_same_set_read_without_importing_a_probe():
    """The key's variables come from the declaring modules and the registry's rows, never from the probe
    modules (a resolve imports only the probes it runs); the rows' visible-devices variables are the
    ones the probes read."""
    code = (
        "import json, sys; from whichdevice.resolve import memo; names = memo.memo_variables(); "
        "print(json.dumps([names, sorted(m for m in sys.modules if m.startswith('whichdevice.hardware.probes.'))]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    names, imported = json.loads(out.stdout.splitlines()[-1])
    readers = [f"whichdevice.hardware.probes.{m}" for m in ("cpu", "cuda", "hpu", "mps", "tpu", "vendor", "xpu")]
    assert sorted(set(imported) & set(readers)) == []
    declared = {name for module in memo.DECLARING_MODULES for name in module.ENV_VARIABLES}
    hooks = {d.name for b in wd.backends() for d in b.env_defaults}
    visible = {name for b in wd.backends() for name in b.visible_devices_env}
    assert set(names) == declared | hooks | visible == set(memo.memo_variables())
    assert visible <= set(probes.ENV_VARIABLES)


# Modules whose readings of the environment are cached with the probe results (a probe runs once
# per process; refresh=True runs it again), or that are surfaces above the resolver: a resolution
# does not read through them after its probes are done. memo itself reads the union.
_NOT_IN_THE_KEY = {"memo", "probes", "probing", "visible", "envhooks", "testing", "report", "smoke", "cli"}


def _environment_reads(tree: ast.AST) -> set[str]:
    """Literal names read as os.environ.get("X"), os.environ["X"], env.get("X") or os.getenv("X")."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            target = ast.unparse(node.func.value)
            if node.func.attr in ("get", "getenv") and ("environ" in target or target in ("env", "os")):
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    names.add(first.value)
        if (
            isinstance(node, ast.Subscript)
            and "environ" in ast.unparse(node.value)
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ):
            names.add(node.slice.value)
    return names


def _declared(tree: ast.Module) -> bool:
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "ENV_VARIABLES" for t in targets):
            return True
    return False


def test_a_module_that_reads_the_environment_declares_it_and_the_key_holds_it():
    import importlib

    for path in sorted(SRC.glob("*.py")):
        module_name = path.stem
        if module_name in _NOT_IN_THE_KEY:
            continue
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        reads = any(isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") for node in ast.walk(tree))
        if not reads:
            continue
        assert _declared(tree), f"{path.name} reads the environment but declares no ENV_VARIABLES"
        module = importlib.import_module(f"whichdevice.{module_name}")
        declared = set(module.ENV_VARIABLES)
        literal = _environment_reads(tree)
        assert literal <= declared, f"{path.name} reads {sorted(literal - declared)} without declaring them"
        assert declared <= set(memo.memo_variables()), f"{path.name}: {sorted(declared - set(memo.memo_variables()))}"
