"""The report's data (whichdevice.report): rows, environment, warnings, resolutions, schema, text."""

from __future__ import annotations

import os
import re
from typing import Any

import jsonschema
import pytest

from steering import ANSI, STEERING
from whichdevice import report
from whichdevice.core.errors import (
    ConfigConflictError,
    DeviceError,
    DeviceUnavailableError,
    DoesNotFitError,
    UnknownDeviceError,
    printable,
)
from whichdevice.hardware.probing import DeviceInfo, ProbeResult
from whichdevice.hardware.registry import Backend, EnvDefault, backends, register_backend


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in STEERING:
        monkeypatch.delenv(name, raising=False)


def validate(data: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(report.load_schema()).validate(data)


def env_entry(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in data["environment"] if e["name"] == name)


def messages(data: dict[str, Any], source: str | None = None) -> list[str]:
    return [w["message"] for w in data["warnings"] if source is None or w["source"] == source]


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    schema = report.load_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert report.SCHEMA_VERSION.split(".")[0] == "1"
    assert re.fullmatch(schema["$defs"]["schema_version"]["pattern"], report.SCHEMA_VERSION)


def test_report_on_this_machine_matches_the_schema() -> None:
    data = report.gather()
    validate(data)
    assert data["kind"] == "report"
    assert data["schema_version"] == report.SCHEMA_VERSION
    assert data["simulated"] is False and data["simulation"] is None
    assert [row["name"] for row in data["backends"]] == [b.name for b in backends()]
    assert [r["task"] for r in data["resolutions"]] == ["inference", "training"]
    cpu = data["backends"][-1]
    assert cpu["name"] == "cpu" and cpu["status"] == "available" and cpu["device_count"] == 1
    text = report.render_text(data, verbose=True)
    for row in data["backends"]:
        if not row["available"]:
            # Every unusable row says why, and how to install it (--verbose; by default the rows simply not
            # installed share one line: tests/hardware/test_absent.py).
            assert row["reason"] and row["install_command"].startswith("pip install")
            line = next(line for line in text.splitlines() if re.match(rf"\s+[-!] {row['name']} ", line))
            # The renderer escapes control characters (a vendor message may hold a newline).
            assert printable(row["reason"]) in line and row["install_command"] in line
    assert data["exit_code"] == 0


def test_every_steering_variable_is_reported() -> None:
    data = report.gather()
    names = [e["name"] for e in data["environment"]]
    for backend in backends():
        for var in backend.visible_devices_env:
            assert var in names
    for var in (
        "CUDA_DEVICE_ORDER",
        "WHICHDEVICE_DEVICE",
        "ACCELERATE_USE_CPU",
        "ACCELERATE_TORCH_DEVICE",
        "PT_ENABLE_INT64_SUPPORT",
        "PYTORCH_ENABLE_MPS_FALLBACK",
        "HF_HUB_OFFLINE",
        "LOCAL_RANK",
        "RANK",
        "WORLD_SIZE",
    ):
        assert var in names
    assert len(names) == len(set(names))
    assert all(e["effect"] for e in data["environment"])


def test_versions_come_from_metadata_without_importing_the_libraries() -> None:
    versions = report.package_versions()
    assert list(versions)[:7] == ["python", "torch", "transformers", "accelerate", "peft", "bitsandbytes", "kernels"]
    assert versions["torch"] and versions["transformers"]


def test_simulated_gaudi_resolution_and_environment_restored() -> None:
    data = report.gather(simulate=["hpu:8"])
    validate(data)
    assert data["simulated"] is True
    assert "SIMULATED" in data["simulation"]["notice"]
    for entry in data["resolutions"]:
        res = entry["resolution"]
        # Training keeps fp32 weights under bf16 mixed precision (model_precision).
        dtype = "float32" if res["task"] == "training" else "bfloat16"
        assert res["device"] == "hpu" and res["dtype"] == dtype and res["simulated"] is True
        assert "PT_ENABLE_INT64_SUPPORT" in [a["name"] for a in res["env_set"]]
    training = data["resolutions"][1]["resolution"]
    assert training["training_kwargs"] == {"bf16": True, "fp16": False}
    # The environment section shows what the user exported, and says whichdevice set it.
    int64 = env_entry(data, "PT_ENABLE_INT64_SUPPORT")
    assert int64["value"] is None and "whichdevice set it" in int64["effect"]
    assert "PT_ENABLE_INT64_SUPPORT" not in os.environ


def test_empty_cuda_visible_devices_is_flagged_even_when_the_probe_stops_earlier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    data = report.gather()
    entry = env_entry(data, "CUDA_VISIBLE_DEVICES")
    assert entry["set"] is True and entry["value"] == ""
    assert "hides every GPU" in entry["effect"]
    found = [m for m in messages(data, "environment") if m.startswith("CUDA_VISIBLE_DEVICES=''")]
    assert len(found) == 1 and "unset CUDA_VISIBLE_DEVICES" in found[0]


def test_empty_variable_is_warned_once_under_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    data = report.gather(simulate=["cuda:8"])
    hiding = [m for m in messages(data) if "hides every" in m]
    assert len(hiding) == 1
    cuda = next(r for r in data["backends"] if r["name"] == "cuda")
    assert cuda["status"] == "unavailable"


def test_visible_devices_effect_names_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "x")
    data = report.gather()
    assert "2, 3 as cuda:0..cuda:1" in env_entry(data, "CUDA_VISIBLE_DEVICES")["effect"]
    assert env_entry(data, "ASCEND_RT_VISIBLE_DEVICES")["effect"].startswith("invalid")
    assert any("ASCEND_RT_VISIBLE_DEVICES" in m for m in messages(data, "environment"))
    # ROCm-only variables say that only the ROCm build reads them.
    assert "ROCm" in env_entry(data, "HIP_VISIBLE_DEVICES")["effect"]


def test_probe_warnings_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "0,1,2")
    data = report.gather(simulate=["hpu:8"])
    assert any("groups of 2 or 4" in m for m in messages(data, "probe:hpu"))


def test_mixed_gpu_models_warn_about_numbering() -> None:
    cuda = ProbeResult(
        "cuda", True, True, 2, devices=(DeviceInfo(0, "NVIDIA A100"), DeviceInfo(1, "Tesla V100")), variant="cuda"
    )
    found = report._other_warnings({}, [cuda], [], {"accelerate": "1.16.0"})
    assert any("CUDA_DEVICE_ORDER=PCI_BUS_ID" in w["message"] for w in found)
    quiet = report._other_warnings({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, [cuda], [], {"accelerate": "1.16.0"})
    assert not any("PCI_BUS_ID" in w["message"] for w in quiet)


def test_kernels_outside_the_supported_range_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    import whichdevice.attention.kernels as ks

    monkeypatch.setattr(ks, "kernels_compatibility", lambda: (False, "kernels 0.1 is too old"))
    found = report._other_warnings({}, [], [], {"kernels": "0.1", "accelerate": "1.16.0"})
    assert {"source": "kernels", "message": "kernels 0.1 is too old"} in found
    monkeypatch.setattr(ks, "kernels_compatibility", lambda: (True, "fine"))
    assert not report._other_warnings({}, [], [], {"kernels": "0.18.2", "accelerate": "1.16.0"})


def test_old_accelerate_warns_about_gaudi() -> None:
    found = report._other_warnings({}, [], [], {"kernels": None, "accelerate": "1.4.0"})
    assert any(w["source"] == "accelerate" and "1.5.0" in w["message"] for w in found)
    assert not report._other_warnings({}, [], [], {"kernels": None, "accelerate": "1.5.0"})


def test_accelerate_use_cpu_against_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    data = report.gather(simulate=["cuda:2"])
    assert any("ACCELERATE_USE_CPU" in m for m in messages(data, "environment"))
    monkeypatch.setenv("ACCELERATE_USE_CPU", "maybe")
    data = report.gather()
    assert env_entry(data, "ACCELERATE_USE_CPU")["effect"].startswith("invalid")


def test_bad_whichdevice_device_is_in_the_report_with_exit_code_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WHICHDEVICE_DEVICE", "gpu")
    data = report.gather()
    validate(data)
    assert data["exit_code"] == 2
    assert all(not r["ok"] and r["error"]["type"] == "UnknownDeviceError" for r in data["resolutions"])
    assert env_entry(data, "WHICHDEVICE_DEVICE")["effect"].startswith("invalid")


def test_unavailable_device_gives_exit_code_1_and_invalid_one_raises() -> None:
    data = report.gather(device="cuda")
    validate(data)
    assert data["exit_code"] == 1
    assert data["resolutions"][0]["error"]["type"] == "DeviceUnavailableError"
    with pytest.raises(UnknownDeviceError):
        report.gather(device="cdua")
    with pytest.raises(DeviceError):
        report.gather(tasks=["serving"])


def test_distributed_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    data = report.gather(simulate=["cuda:2"], tasks=["inference"])
    assert data["resolutions"][0]["resolution"]["device"] == "cuda:1"
    assert "local rank 1" in env_entry(data, "LOCAL_RANK")["effect"]
    assert "taken as" in env_entry(data, "RANK")["effect"]
    text = report.render_text(data)
    assert re.search(r"^  RANK\s+\(unset\)", text, re.MULTILINE)


def test_exit_code_for() -> None:
    assert report.exit_code_for(DeviceUnavailableError("x")) == 1
    assert report.exit_code_for(DoesNotFitError("x")) == 1
    assert report.exit_code_for(UnknownDeviceError("x")) == 2
    assert report.exit_code_for(ConfigConflictError("x")) == 2
    assert report.exit_code_for(DeviceError("x")) == 2
    assert report.exit_code_for(RuntimeError("x")) == 1


def test_text_is_plain_unless_colour_is_asked() -> None:
    data = report.gather()
    plain = report.render_text(data)
    assert not ANSI.search(plain)
    for section in ("BACKENDS", "ENVIRONMENT", "WARNINGS", "RESOLUTION FOR INFERENCE", "RESOLUTION FOR TRAINING"):
        assert section in plain
    assert "whichdevice chose cpu for inference" in plain
    assert "torch " in plain.split("VERSIONS")[1]
    colored = report.render_text(data, color=True)
    assert ANSI.search(colored)
    assert ANSI.sub("", colored).count("whichdevice chose") == plain.count("whichdevice chose")


def test_generate_keywords_are_printed_escaped_keys_too() -> None:
    data = report.gather()
    resolution = data["resolutions"][0]["resolution"]
    assert resolution["generate_kwargs"] == {}  # nothing to hand over here: no generate line
    assert "  generate  " not in report.render_text(data)
    # A report read back is untrusted: a key is printed as well as a value.
    resolution["generate_kwargs"] = {"cache_implementation": "static", "\x1b[2Jx": "\x07y"}
    text = report.render_text(data)
    assert "\x1b" not in text and "\x07" not in text
    (line,) = [line for line in text.splitlines() if line.startswith("  generate ")]
    assert "cache_implementation='static'" in line and "\\x1b[2Jx=" in line


def test_text_wraps_to_the_terminal_width() -> None:
    text = report.render_text(report.gather(), width=80)
    too_long = [line for line in text.splitlines() if len(line) > 80 and " " in line.strip()[:80]]
    assert not too_long


def test_simulated_text_says_so_at_both_ends() -> None:
    text = report.render_text(report.gather(simulate=["hpu:8"]))
    lines = text.strip().splitlines()
    assert "SIMULATED" in lines[0] and "SIMULATED" in lines[-1]
    assert "(SIMULATED hardware)" in text


def test_use_color() -> None:
    class Tty:
        def isatty(self) -> bool:
            return True

    assert report.use_color(Tty(), {})
    assert not report.use_color(Tty(), {"NO_COLOR": "1"})
    assert not report.use_color(Tty(), {"TERM": "dumb"})
    assert report.use_color(Tty(), {"NO_COLOR": ""})  # no-color.org: only a non-empty value counts
    assert not report.use_color(object(), {})


def test_every_hook_variable_is_reported_with_its_backend_and_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    hooks = [(b, d) for b in backends() for d in b.env_defaults]
    assert {d.name for _, d in hooks} >= {"PT_ENABLE_INT64_SUPPORT", "PYTORCH_ENABLE_MPS_FALLBACK"}
    data = report.gather()
    for backend, default in hooks:
        entry = env_entry(data, default.name)
        assert entry["backend"] == backend.name and entry["value"] is None
        assert f"sets it to {default.value} when it" in entry["effect"] and default.why in entry["effect"]
    # A value the user exported is kept; the entry says what the backend wants instead, and why.
    for _, default in hooks:
        monkeypatch.setenv(default.name, default.value + "0")
    data = report.gather()
    for backend, default in hooks:
        effect = env_entry(data, default.name)["effect"]
        assert effect.startswith("kept") and f"{backend.name} wants {default.name}={default.value}" in effect


# ------------------------------------------------------------------------------ plugin backends

PLUGIN_VISIBLE = "PLUGDEV_VISIBLE_DEVICES"
PLUGIN_HOOK = "PLUGDEV_SAFE_KERNELS"


def _plugin(available: bool) -> Backend:
    return Backend(
        name="plugdev",
        hardware="Plugin accelerator",
        package="plugdev-torch",
        module="plugdev_torch_not_installed",
        probe_ref=lambda b: ProbeResult(
            b.name, installed=True, available=available, device_count=int(available), reason="no plugdev here"
        ),
        visible_devices_env=(PLUGIN_VISIBLE,),
        env_defaults=(EnvDefault(PLUGIN_HOOK, "1", "its kernels crash without it", stage="select"),),
    )


def test_a_plugin_backend_gets_its_own_environment_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    register_backend(_plugin(available=False))
    monkeypatch.setenv(PLUGIN_VISIBLE, "0,2")
    data = report.gather()
    validate(data)
    assert any(row["name"] == "plugdev" and row["visible_devices_env"] == [PLUGIN_VISIBLE] for row in data["backends"])
    visible = env_entry(data, PLUGIN_VISIBLE)
    assert (visible["group"], visible["backend"]) == ("visible_devices", "plugdev")
    assert visible["effect"] == "shows physical plugdev devices 0, 2 as plugdev:0..plugdev:1"
    hook = env_entry(data, PLUGIN_HOOK)
    assert hook["backend"] == "plugdev" and hook["value"] is None
    assert hook["effect"] == (
        "unset: whichdevice sets it to 1 when it picks plugdev, because its kernels crash without it"
    )
    text = report.render_text(data)
    assert re.search(rf"^  {PLUGIN_VISIBLE}\s+'0,2'\s+shows physical plugdev devices 0, 2", text, re.MULTILINE)
    assert re.search(rf"^  {PLUGIN_HOOK}\s+\(unset\)\s+whichdevice sets it to 1 when it picks plugdev", text, re.M)

    monkeypatch.setenv(PLUGIN_VISIBLE, "")
    data = report.gather()
    assert env_entry(data, PLUGIN_VISIBLE)["effect"] == "hides every plugdev device: plugdev sees none"
    assert any(m.startswith(f"{PLUGIN_VISIBLE}='' is exported") for m in messages(data, "environment"))


def test_a_chosen_plugin_backend_says_its_hook_set_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    # Recorded as unset, so monkeypatch removes what the hook sets when the test ends.
    monkeypatch.setenv(PLUGIN_HOOK, "")
    monkeypatch.delenv(PLUGIN_HOOK)
    register_backend(_plugin(available=True))
    data = report.gather(tasks=["inference"])
    assert data["resolutions"][0]["resolution"]["device"] == "plugdev:0"
    hook = env_entry(data, PLUGIN_HOOK)
    assert hook["value"] is None
    assert hook["effect"] == "unset: whichdevice set it to 1 for this run because it picked plugdev"


def test_check_answers_in_the_shape_of_the_schema() -> None:
    usable = report.check()
    validate(usable)
    assert usable["exit_code"] == 0 and usable["message"].startswith("ok: cpu is usable (1 device")
    too_few = report.check("cuda", min_devices=4, simulate=["cuda:2"])
    validate(too_few)
    assert (too_few["ok"], too_few["exit_code"], too_few["device_count"]) == (False, 1, 2)
    assert too_few["message"].startswith("SIMULATED (cuda:2): cuda: 2 devices are usable, fewer than --min-devices 4")
    unusable = report.check("hpu", simulate=["cuda:1"])
    assert unusable["exit_code"] == 1 and "pip install habana-torch-plugin" in unusable["message"]
