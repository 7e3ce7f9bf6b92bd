"""Reports reproduce a machine: ``simulate(report=...)`` and ``whichdevice --simulate-report``."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import whichdevice as wd
from steering import STEERING
from whichdevice import cli, report
from whichdevice.core.errors import DeviceError
from whichdevice.core.records import DeviceInfo, ProbeResult
from whichdevice.hardware import probing
from whichdevice.testing import simulate
from whichdevice.testing.replay import comparable, decode, first_difference, load_report, steering_variables


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in STEERING:
        monkeypatch.delenv(name, raising=False)


def _row_specs() -> list[str]:
    """Every registry row's simulated spec, its ROCm build, its modes, and the CPU with and without bf16."""
    specs: list[str] = []
    for backend in wd.backends():
        name = backend.name
        if name == "cpu":
            specs += ["cpu,flags=avx512_bf16", "cpu,flags="]
            continue
        count = "" if name == "mps" else ":2"
        specs += [f"{name}{count}", f"{name},missing", f"{name},broken", f"{name}{count},unavailable"]
    return [*specs, "cuda:2,variant=rocm", "cuda:8,cc=7.5,mem=16GiB,name=Tesla T4", "hpu:8,gen=gaudi3", "npu:8;cuda:2"]


def _json_round_trip(data: Mapping[str, Any]) -> Any:
    return json.loads(json.dumps(data))


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    difference = first_difference(comparable(a), comparable(b))
    assert difference is None, difference


@pytest.mark.parametrize("spec", _row_specs())
def test_every_row_round_trips_through_its_report(spec: str) -> None:
    original = _json_round_trip(report.gather(simulate=[spec]))
    replayed = report.gather(simulate_report=original)
    jsonschema.Draft202012Validator(report.load_schema()).validate(replayed)
    assert replayed["simulated"] and replayed["simulation"]["report"] == "the report given"
    _same(original, replayed)
    # The Python API answers the same: the resolution, its trace and the probe behind it.
    with simulate(report=original):
        for entry in original["resolutions"]:
            if entry["ok"]:
                res = wd.resolve_device(task=entry["task"])
                _same(entry["resolution"], res.to_dict())
                assert res.simulated


def test_steering_variables_travel_with_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "0,1")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    original = _json_round_trip(report.gather(simulate=["hpu:8"]))
    assert original["replay"]["environ"] == {
        "HABANA_VISIBLE_MODULES": "0,1",
        "ACCELERATE_MIXED_PRECISION": "fp16",
        **_suite_settings(),
    }
    # Here, the user's variables are gone and one of this machine's own is set: the replay sets
    # the recorded ones, unsets the rest, and gives every one back afterwards.
    monkeypatch.delenv("HABANA_VISIBLE_MODULES")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    monkeypatch.setenv("WHICHDEVICE_DEVICE", "cpu")
    replayed = report.gather(simulate_report=original)
    _same(original, replayed)
    assert replayed["resolutions"][0]["resolution"]["device_count"] == 2
    with simulate(report=original):
        assert os.environ["HABANA_VISIBLE_MODULES"] == "0,1"
        assert "WHICHDEVICE_DEVICE" not in os.environ
        assert wd.resolve_device().device == "hpu"
        assert os.environ["PT_ENABLE_INT64_SUPPORT"] == "1"  # the hook ran again, as on that machine
    assert os.environ["WHICHDEVICE_DEVICE"] == "cpu"
    assert "HABANA_VISIBLE_MODULES" not in os.environ and "PT_ENABLE_INT64_SUPPORT" not in os.environ


def test_package_versions_travel_with_the_report() -> None:
    original = _json_round_trip(report.gather(simulate=["hpu:8"]))
    assert original["replay"]["packages"]["accelerate"] == wd.core.packages.package_version("accelerate")
    old = dict(original, replay={**original["replay"], "packages": {"accelerate": "1.4.0"}})
    with simulate(report=old):
        assert wd.core.packages.package_version("accelerate") == "1.4.0"
        assert wd.report.gather()["versions"]["accelerate"] == "1.4.0"
    assert wd.core.packages.package_version("accelerate") == original["versions"]["accelerate"]


def test_a_file_report_replays_with_the_file_named(tmp_path: Path) -> None:
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(report.gather(simulate=["cuda:2"])), encoding="utf-8")
    replayed = report.gather(simulate_report=str(path))
    assert replayed["simulation"]["report"] == str(path)
    assert "--simulate-report " + str(path) in report.render_text(replayed)
    checked = report.check("cuda", min_devices=2, simulate_report=path)
    assert checked["exit_code"] == 0 and checked["message"].startswith(f"SIMULATED ({path}): ok: cuda:0")
    jsonschema.Draft202012Validator(report.load_schema()).validate(checked)
    too_few = report.check("cuda", min_devices=4, simulate_report=path)
    assert too_few["exit_code"] == 1 and "fewer than --min-devices 4" in too_few["message"]


def test_a_report_from_schema_1_0_still_replays() -> None:
    original = _json_round_trip(report.gather(simulate=["cuda:2", "npu:1"]))
    old = {k: v for k, v in original.items() if k != "replay"} | {"schema_version": "1.0"}
    replayed = report.gather(simulate_report=old)
    assert replayed["schema_version"] == report.SCHEMA_VERSION
    _same(old | {"schema_version": replayed["schema_version"]}, {k: v for k, v in replayed.items() if k != "replay"})


def test_a_newer_minor_version_replays_and_its_new_fields_are_ignored() -> None:
    original = _good()
    major, minor = report.SCHEMA_VERSION.split(".")
    newer = original | {"schema_version": f"{major}.{int(minor) + 1}", "something_new": {"x": 1}}
    newer["backends"] = [row | {"new_probe_field": [1, 2]} for row in original["backends"]]
    replayed = report.gather(simulate_report=newer)
    _same(original, replayed | {"schema_version": original["schema_version"]})


class probing_timeout:  # noqa: N801 - a small context manager
    def __enter__(self) -> None:
        probing.set_probe_timeout(0.3)

    def __exit__(self, *exc: object) -> None:
        probing.set_probe_timeout(None)


def test_a_hung_probe_replays_as_the_reason_it_gave() -> None:
    with probing_timeout():
        original = _json_round_trip(report.gather(simulate=["npu:2,hangs", "cuda:1"]))
    replayed = report.gather(simulate_report=original)
    _same(original, replayed)
    npu = next(r for r in replayed["backends"] if r["name"] == "npu")
    assert "did not finish" in npu["reason"] and npu["seconds"] < 0.3


# ------------------------------------------------------------------------ this machine, for real


def _suite_settings() -> dict[str, str]:
    # Steering variables the suite itself runs with, so recorded too: tests/conftest.py turns the
    # CPU calibration off, and the README's second run caps oneDNN.
    names = ("WHICHDEVICE_CALIBRATION", "ONEDNN_MAX_CPU_ISA")
    return {name: os.environ[name] for name in names if name in os.environ}


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in STEERING}
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-m", "whichdevice", *args], env=clean, capture_output=True, text=True, timeout=300
    )


def test_this_machines_real_report_replays_in_another_process(tmp_path: Path) -> None:
    # Written with steering variables set, replayed where they are not.
    written = _cli("--json", ACCELERATE_MIXED_PRECISION="no", CUDA_VISIBLE_DEVICES="1")
    assert written.returncode == 0, written.stderr
    path = tmp_path / "machine.json"
    path.write_text(written.stdout, encoding="utf-8")
    original = json.loads(written.stdout)
    assert not original["simulated"]
    assert original["replay"]["environ"] == {
        "ACCELERATE_MIXED_PRECISION": "no",
        "CUDA_VISIBLE_DEVICES": "1",
        **_suite_settings(),
    }
    replayed_run = _cli("--simulate-report", str(path), "--json")
    assert replayed_run.returncode == original["exit_code"], replayed_run.stderr
    replayed = json.loads(replayed_run.stdout)
    assert replayed["simulated"] and all(row["simulated"] for row in replayed["backends"])
    _same(original, replayed)
    text = _cli("--simulate-report", str(path))
    assert "*** SIMULATED: --simulate-report " in text.stdout
    smoke = _cli("smoke", "--simulate-report", str(path))
    assert smoke.returncode == 2 and "--simulate-report only changes the report" in smoke.stderr


# --------------------------------------------------------------------------- decoding, generically


@pytest.mark.parametrize("name", [b.name for b in wd.backends()])
def test_every_probe_result_decodes_to_itself(name: str) -> None:
    spec = "cpu,flags=amx_bf16" if name == "cpu" else f"{name}:2" if name != "mps" else "mps"
    with simulate(spec):
        result = wd.probe(name)
    decoded = decode(ProbeResult, {**result.to_dict(), "name": name}, name)
    assert decoded.to_dict() == result.to_dict()


@dataclass(frozen=True)
class _CalibratedDevice(DeviceInfo):
    # A field added later (a CPU calibration, say) replays with no edit to the decoder.
    tokens_per_s: Mapping[str, float] = field(default_factory=dict)
    isa: tuple[str, ...] = ()


def test_fields_added_later_decode_without_edits() -> None:
    text = {"index": 0, "name": "x", "capability": "9.0", "tokens_per_s": {"bfloat16": 3}, "isa": ["AVX512_CORE_AMX"]}
    got = decode(_CalibratedDevice, text, "device")
    assert got == _CalibratedDevice(0, "x", capability=(9, 0), tokens_per_s={"bfloat16": 3.0}, isa=("AVX512_CORE_AMX",))


def test_first_difference_names_the_field() -> None:
    a = {"backends": [{"name": "cuda", "devices": [{"capability": "8.0"}]}], "exit_code": 0}
    b = {"backends": [{"name": "cuda", "devices": [{"capability": "9.0"}]}], "exit_code": 0}
    assert first_difference(a, b) == "backends[0].devices[0].capability: '8.0' != '9.0'"
    assert first_difference(a, a) is None
    assert first_difference({"a": [1]}, {"a": [1, 2]}) == "a: 1 items != 2 items"
    assert first_difference({"a": 1}, {"b": 1}) == "a: only in the first"


def test_steering_variables_cover_the_memo_key_and_the_probes() -> None:
    names = set(steering_variables())
    assert {"WHICHDEVICE_DEVICE", "CUDA_VISIBLE_DEVICES", "ACCELERATE_MIXED_PRECISION", "ONEDNN_MAX_CPU_ISA"} <= names


# ------------------------------------------------------------------------------------ bad reports


def _good() -> dict[str, Any]:
    result: dict[str, Any] = _json_round_trip(report.gather(simulate=["cuda:1"]))
    return result


def _damaged_capability() -> dict[str, Any]:
    data = _good()
    cuda = next(r for r in data["backends"] if r["name"] == "cuda")
    cuda["devices"][0]["capability"] = "eight"
    return data


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda tmp: tmp / "absent.json", ["cannot read the report", "whichdevice --json > machine.json"]),
        (lambda tmp: _write(tmp, '{"kind": "report", "schema'), ["is not JSON", "cut short"]),
        (lambda tmp: _write(tmp, "[1, 2]"), ["holds a JSON list, not a whichdevice report"]),
        (lambda tmp: {"kind": "check", "schema_version": "1.1"}, ["a 'check' output", "whichdevice --json >"]),
        (lambda tmp: _good() | {"schema_version": "2.0"}, ["schema '2.0'", "pip install whichdevice=="]),
        (lambda tmp: _good() | {"backends": "none"}, ["'backends' is missing or damaged"]),
        (
            lambda tmp: _good() | {"backends": [{"name": "gpu9"}]},
            ["backend(s) 'gpu9'", "install the plugin that registers them"],
        ),
        (lambda tmp: _damaged_capability(), ["backend 'cuda'.devices[0].capability", "damaged"]),
        (lambda tmp: 42, ["give the path of a `whichdevice --json` report or its parsed dict"]),
    ],
    ids=[
        "missing",
        "cut-short",
        "not-an-object",
        "check-output",
        "newer-major",
        "no-backends",
        "unknown",
        "damaged",
        "int",
    ],
)
def test_a_bad_report_names_the_problem(tmp_path: Path, make: Any, says: list[str]) -> None:
    with pytest.raises(DeviceError) as info:
        simulate(report=make(tmp_path))
    for text in says:
        assert text in str(info.value)


def _write(tmp: Path, text: str) -> Path:
    path = tmp / "machine.json"
    path.write_text(text, encoding="utf-8")
    return path


def test_specs_and_a_report_are_not_mixed() -> None:
    with pytest.raises(DeviceError, match="give specs or report=, not both"):
        simulate("cuda:1", report=_good())


def test_the_command_exits_2_on_a_bad_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--simulate-report", str(tmp_path / "nope.json")]) == 2
    assert "cannot read the report" in capsys.readouterr().err
    assert load_report(_good()).results["cuda"].available


CALIBRATED_CPU = (
    "cpu,flags=,calib=bf16.b1:1.17/bf16.b2:1.0/bf16.b4:0.72/bf16.b8:0.6/bf16.prompt:0.6"
    "/fp16.b1:1.0/fp16.b2:1.0/fp16.b4:0.6/fp16.b8:0.5/fp16.prompt:0.4"
)


def test_the_cpu_calibration_replays_with_the_report() -> None:
    # The figures that chose bf16 on the recorded CPU choose it in the replay, and say so the same way.
    with simulate(CALIBRATED_CPU):
        recorded = wd.resolve_device(batch_size=1, max_length=64, max_new_tokens=32)
        machine = json.loads(json.dumps(report.gather()))
    assert machine["calibration"]["spec"]
    with simulate(report=machine):
        replayed = wd.resolve_device(batch_size=1, max_length=64, max_new_tokens=32)
    assert recorded.dtype_name == replayed.dtype_name == "bfloat16"
    assert replayed.trace == recorded.trace


@pytest.mark.parametrize("entry", [[], {"why": 3}, {"why": "x", "spec": 7}, {"why": "x", "spec": "bf16.b1:fast"}])
def test_a_damaged_calibration_section_is_named(entry: object) -> None:
    with simulate("cpu,flags="):
        machine = json.loads(json.dumps(report.gather()))
    machine["calibration"] = entry
    with pytest.raises(wd.DeviceError, match="'calibration' section is damaged"), simulate(report=machine):
        pass


# ------------------------------------------------------------------------- hostile reports


def _with_device_name(name: str) -> dict[str, Any]:
    data = _good()
    next(r for r in data["backends"] if r["name"] == "cuda")["devices"][0]["name"] = name
    return data


def _report_file(tmp_path: Path, data: Any) -> str:
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def test_escape_codes_in_a_replayed_device_name_do_not_reach_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _report_file(tmp_path, _with_device_name("\x1b[2J\x1b]0;owned\x07H100\u202e"))
    assert cli.main(["--simulate-report", path]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "\\x1b[2J\\x1b]0;owned\\x07H100\\u202e" in out


def test_a_newline_in_a_device_name_cannot_forge_a_line_of_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _report_file(tmp_path, _with_device_name("H100\nok: cuda:0 is usable (8 x H100)"))
    assert cli.main(["check", "cuda", "--simulate-report", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "H100\\nok: cuda:0" in lines[0]


def test_a_hostile_version_becomes_a_quoted_pip_command(tmp_path: Path) -> None:
    hostile = "1.0'; touch PWNED; echo '"
    data = _good() | {"schema_version": "2.0", "versions": {"whichdevice": hostile}}
    with pytest.raises(DeviceError) as info:
        simulate(report=data)
    command = str(info.value).split("replay it with ", 1)[1]
    assert shlex.split(command) == ["pip", "install", f"whichdevice=={hostile}"]


def test_only_variables_whichdevice_reads_are_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    data = _good()
    data["replay"]["environ"] = {"LD_PRELOAD": "/tmp/evil.so", "A=B": "x", "WHICHDEVICE_DEVICE": "cpu"}
    machine = load_report(data)
    assert machine.environ == {"WHICHDEVICE_DEVICE": "cpu"}
    with simulate(report=data):
        assert "LD_PRELOAD" not in os.environ and "A=B" not in os.environ
        assert wd.resolve_device().device == "cpu"


def test_a_nul_in_a_replayed_value_is_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _good()
    data["replay"]["environ"] = {"WHICHDEVICE_DEVICE": "cpu\x00cuda"}
    assert cli.main(["--simulate-report", _report_file(tmp_path, data)]) == 2
    err = capsys.readouterr().err
    assert "NUL character" in err and "damaged" in err and "internal error" not in err


def test_a_report_nested_100000_deep_is_refused_as_damaged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    assert cli.main(["--simulate-report", str(path)]) == 2
    err = capsys.readouterr().err
    assert "nests its JSON too deeply" in err and "internal error" not in err


def test_a_huge_value_in_a_report_is_quoted_short() -> None:
    data = _good()
    data["platform"] = {"system": ["x" * 1_000_000]}
    with pytest.raises(DeviceError) as info:
        simulate(report=data)
    assert len(str(info.value)) < 1000 and "damaged" in str(info.value)


# ------------------------------------------------------------ meaning, not only shape (issue 57)


def _row(data: dict[str, Any], name: str) -> dict[str, Any]:
    row: dict[str, Any] = next(r for r in data["backends"] if r["name"] == name)
    return row


def _unusable_cpu(data: dict[str, Any]) -> None:
    _row(data, "cpu")["devices"][0]["unusable"] = "held by another process"


def _index_beyond_count(data: dict[str, Any]) -> None:
    _row(data, "cuda")["devices"][0]["index"] = 5  # device_count is 1


def _index_twice(data: dict[str, Any]) -> None:
    cuda = _row(data, "cuda")
    cuda["device_count"] = 2
    cuda["devices"] = [cuda["devices"][0], dict(cuda["devices"][0])]


def _more_devices_than_count(data: dict[str, Any]) -> None:
    cuda = _row(data, "cuda")
    cuda["devices"] = [cuda["devices"][0], {**cuda["devices"][0], "index": 1}]


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_unusable_cpu, "devices[0].unusable='held by another process', which no probe of cpu writes"),
        (_index_beyond_count, "device index 5 is outside 0 to 0"),
        (_index_twice, "device index 0 is listed twice"),
        (_more_devices_than_count, "2 devices listed for a device_count of 1"),
    ],
)
def test_a_report_with_values_no_probe_writes_is_damaged_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Any, says: str
) -> None:
    data = _good()
    damage(data)
    with pytest.raises(DeviceError, match="the report is damaged"):
        load_report(data)
    assert cli.main(["--simulate-report", _report_file(tmp_path, data)]) == 2
    err = capsys.readouterr().err
    assert says in err and "internal error" not in err
    with pytest.raises(DeviceError, match="the report is damaged"), simulate(report=data):
        wd.resolve_device()


def test_a_report_named_as_a_fifo_is_said_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "machine.json"
    os.mkfifo(fifo)
    code = f"from whichdevice.cli import main; raise SystemExit(main(['--simulate-report', {str(fifo)!r}]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10)
    assert done.returncode == 2 and "is a named pipe (FIFO), not a file" in done.stderr
