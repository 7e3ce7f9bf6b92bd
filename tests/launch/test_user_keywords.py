"""TrainingArguments keywords the user passed, checked against the backend (launch/user_keywords.py)."""

from __future__ import annotations

import importlib.util
import inspect
import textwrap

import pytest

import whichdevice as wd
from whichdevice.hardware.registry import get_backend
from whichdevice.launch.user_keywords import ONECCL_MODULE, REMOVED_SWITCHES, check_compile_backend, check_ddp_package


@pytest.mark.parametrize(
    ("row", "value", "says"),
    [
        ("hpu", "inductor", "its compile backend is 'hpu_backend'"),
        ("cuda", "hpu_backend", "compiles for hpu only"),
        ("cpu", "neuron", "compiles for neuron only"),
        ("neuron", "inductor", "its compile backend is 'neuron'"),
    ],
)
def test_a_compile_backend_for_another_device_is_refused(row: str, value: str, says: str) -> None:
    backend = get_backend(row)
    with pytest.raises(wd.ConfigConflictError, match=says) as err:
        check_compile_backend(backend, value)
    assert f"torch_compile_backend={(backend.compile_backend or 'inductor')!r}" in str(err.value) or (
        f"{backend.compile_backend!r}" in str(err.value)
    )


@pytest.mark.parametrize(("row", "value"), [("hpu", "hpu_backend"), ("cuda", "inductor"), ("cpu", "aot_eager")])
def test_the_devices_own_compile_backend_passes(row: str, value: str) -> None:
    check_compile_backend(get_backend(row), value)


def test_ccl_needs_onecclbindings() -> None:
    if importlib.util.find_spec(ONECCL_MODULE) is not None:
        assert "import oneccl_bindings_for_pytorch" in (check_ddp_package("ccl") or "")
        return
    with pytest.raises(wd.ConfigConflictError, match=r"oneccl_bind_pt.*'xccl'.*'gloo'"):
        check_ddp_package("ccl")
    assert check_ddp_package("gloo") is None


@pytest.mark.usefixtures("restore_accelerate_variables")
def test_ccl_in_a_real_cpu_launch_is_refused_before_transformers(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    if importlib.util.find_spec(ONECCL_MODULE) is not None:
        pytest.skip("oneCCL's bindings are installed here")
    for name, value in {
        "LOCAL_RANK": "0",
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(wd.ConfigConflictError, match="oneCCL"):
        wd.training_arguments(str(tmp_path), use_cpu=True, ddp_backend="ccl")


@pytest.mark.parametrize("name", sorted(REMOVED_SWITCHES))
def test_removed_switches_name_what_replaced_them(name: str, tmp_path) -> None:
    import dataclasses

    from transformers import TrainingArguments

    assert name not in {f.name for f in dataclasses.fields(TrainingArguments)}  # really gone here
    with pytest.raises(wd.DeviceError) as err:
        wd.training_arguments(str(tmp_path), **{name: True})
    assert f"{name} was removed in transformers 5: use {REMOVED_SWITCHES[name]}" in str(err.value)
    assert "arguments_class=" not in str(err.value)


@pytest.mark.parametrize(("value", "mode"), [("1", "lazy"), ("0", "eager"), (None, "default")])
def test_gaudi_execution_mode_is_read_and_compile_needs_eager(
    monkeypatch: pytest.MonkeyPatch, tmp_path, value: str | None, mode: str
) -> None:
    from whichdevice.hardware import probing
    from whichdevice.testing import simulate
    from whichdevice.training.simulated import SimulatedTrainingError

    if value is None:
        monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    else:
        monkeypatch.setenv("PT_HPU_LAZY_MODE", value)
    with simulate("hpu:8"):
        assert f"execution-mode:{mode}" in probing.probe("hpu").features
        if mode == "lazy":
            with pytest.raises(wd.ConfigConflictError, match="PT_HPU_LAZY_MODE=0"):
                wd.training_arguments(str(tmp_path), torch_compile=True)
        else:
            with pytest.raises(SimulatedTrainingError) as err:
                wd.training_arguments(str(tmp_path), torch_compile=True)
            assert err.value.kwargs["torch_compile_backend"] == "hpu_backend"


@pytest.mark.parametrize("value", ["aot_eager", "cudagraphs", "openxla", "tvm"])
def test_on_gaudi_every_backend_transformers_would_replace_is_refused(value: str) -> None:
    """transformers' hpu_backend_compile replaces every backend but 'hpu_backend' and 'eager' with a warning;
    only inductor was refused (issue 58)."""
    with pytest.raises(wd.ConfigConflictError, match=r"transformers replaces every torch\.compile backend") as err:
        check_compile_backend(get_backend("hpu"), value)
    assert "'hpu_backend', 'eager'" in str(err.value) and "pass torch_compile_backend='hpu_backend'" in str(err.value)
    for kept in ("hpu_backend", "eager"):
        check_compile_backend(get_backend("hpu"), kept)


def test_the_backends_gaudi_keeps_are_read_from_the_installed_transformers() -> None:
    """The list is transformers' own: its patched torch.compile, run with a stand-in for torch's, keeps exactly
    these backends and replaces any other with 'hpu_backend'."""
    import torch
    from transformers.utils import import_utils

    from whichdevice.launch.user_keywords import gaudi_compile_backends

    kept = gaudi_compile_backends()
    assert kept is not None and "hpu_backend" in kept
    source = inspect.getsource(import_utils)
    start, end = source.index("    def hpu_backend_compile("), source.index("    torch.compile = hpu_backend_compile")
    patch = source[start:end]
    seen: list[str] = []
    scope = {"original_compile": lambda *a, **k: seen.append(k["backend"]), "logger": import_utils.logger}
    exec(textwrap.dedent(patch), scope)  # the function as transformers defines it, calling our stand-in
    for backend in (*kept, "inductor", "aot_eager", "cudagraphs"):
        scope["hpu_backend_compile"](torch.nn.Identity(), backend=backend)
    assert seen == [*kept, "hpu_backend", "hpu_backend", "hpu_backend"]
