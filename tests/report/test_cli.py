"""The ``whichdevice`` command, run for real: ``python -m whichdevice`` and the installed script."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import whichdevice as wd
from pty_output import read_until_closed
from steering import ANSI
from steering import STEERING as _BASE
from whichdevice import cli, report
from whichdevice.hardware.registry import backends
from whichdevice.report.streams import Streams, close, write

STEERING = _BASE | {"TERM"}
SCRIPT = Path(sys.executable).parent / "whichdevice"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    env.update(extra)
    return env


def run(*args: str, script: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    command = [str(SCRIPT)] if script else [sys.executable, "-m", "whichdevice"]
    return subprocess.run(
        [*command, *args], env=clean_env(**env), capture_output=True, text=True, timeout=300, check=False
    )


def validate(data: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(report.load_schema()).validate(data)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in STEERING:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------------- real subprocesses


def test_report_text_is_plain_when_piped() -> None:
    proc = run()
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert not ANSI.search(out)
    assert out.startswith("whichdevice ")
    for section in ("BACKENDS", "ENVIRONMENT", "WARNINGS", "RESOLUTION FOR INFERENCE", "RESOLUTION FOR TRAINING"):
        assert section in out
    assert "whichdevice chose cpu for inference" in out
    assert "TrainingArguments" in out
    assert "SIMULATED" not in out
    assert proc.stderr == ""


def test_installed_script_json_matches_the_schema() -> None:
    assert SCRIPT.exists(), f"{SCRIPT} is missing: pip install -e . in this venv"
    start = time.perf_counter()
    proc = run("--json", script=True)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    validate(data)
    assert data["kind"] == "report" and data["simulated"] is False
    assert not ANSI.search(proc.stdout)
    # Generous for a loaded machine; the report itself takes a fraction of a second after torch.
    assert elapsed < 60


def test_simulated_gaudi_json() -> None:
    proc = run("--simulate", "hpu:8", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    validate(data)
    assert data["simulated"] is True and data["simulation"]["specs"] == ["hpu:8"]
    assert "SIMULATED" in data["simulation"]["notice"]
    for entry in data["resolutions"]:
        res = entry["resolution"]
        assert res["device"] == "hpu"
        # Training keeps fp32 weights under bf16 mixed precision (model_precision).
        assert res["dtype"] == ("float32" if res["task"] == "training" else "bfloat16")
        assert res["training_kwargs"] in (None, {"bf16": True, "fp16": False})
        assert "PT_ENABLE_INT64_SUPPORT" in [a["name"] for a in res["env_set"]]


def test_simulated_text_cannot_be_missed() -> None:
    proc = run("--simulate", "hpu:8", script=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("*** SIMULATED: --simulate hpu:8")
    assert "SIMULATED" in lines[-1]
    assert "hpu" in lines[3]


def test_empty_cuda_visible_devices_warns() -> None:
    proc = run(CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr
    warnings = proc.stdout.split("WARNINGS")[1].split("RESOLUTION")[0]
    assert "CUDA_VISIBLE_DEVICES='' is exported and hides every GPU" in warnings
    proc = run("--json", CUDA_VISIBLE_DEVICES="")
    data = json.loads(proc.stdout)
    assert any(
        w["source"] == "environment" and w["message"].startswith("CUDA_VISIBLE_DEVICES=''") for w in data["warnings"]
    )


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("check",), 0),
        (("check", "cpu"), 0),
        (("check", "cuda"), 1),
        (("check", "cdua"), 2),
        (("check", "--min-devices", "x"), 2),
        (("check", "cuda", "--min-devices", "8", "--simulate", "cuda:8"), 0),
        (("check", "cuda", "--min-devices", "8", "--simulate", "cuda:4"), 1),
    ],
)
def test_check_exit_codes(args: tuple[str, ...], code: int) -> None:
    proc = run(*args)
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    if code == 0:
        assert proc.stdout.count("\n") == 1 and "ok:" in proc.stdout and proc.stderr == ""
    else:
        # One line on stderr saying why and what to do; nothing on stdout.
        assert proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert 1 <= len(lines) <= 2 and lines[0].startswith("whichdevice check")


def test_check_messages_say_what_to_do() -> None:
    proc = run("check", "cuda")
    assert "pip install torch" in proc.stderr
    proc = run("check", "cdua")
    assert "Did you mean 'cuda'?" in proc.stderr
    proc = run("check", "cuda", "--min-devices", "8", "--simulate", "cuda:8", CUDA_VISIBLE_DEVICES="0,1")
    assert proc.returncode == 1
    assert "CUDA_VISIBLE_DEVICES='0,1'" in proc.stderr and "SIMULATED" in proc.stderr


def test_check_json_via_the_script() -> None:
    proc = run("check", "cuda", "--min-devices", "4", "--json", "--simulate", "cuda:4", script=True)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    validate(data)
    assert data["kind"] == "check" and data["ok"] is True and data["device_count"] == 4
    assert data["simulated"] is True and "SIMULATED" in data["message"]


def test_bad_input_is_exit_2_without_traceback_and_debug_shows_it() -> None:
    proc = run("--device", "gpu")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "whichdevice: --device='gpu': unknown device 'gpu'. Did you mean 'cuda'? Valid device names: "
        + ", ".join(b.name for b in backends())
        + "."
    ]
    proc = run("--device", "gpu", "--debug")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "UnknownDeviceError" in proc.stderr


def test_unavailable_device_report_exit_1() -> None:
    proc = run("--device", "cuda", "--json")
    assert proc.returncode == 1
    data = json.loads(proc.stdout)
    validate(data)
    assert data["exit_code"] == 1 and not data["resolutions"][0]["ok"]
    assert proc.stderr.count("\n") == 1


def test_smoke_refuses_simulation() -> None:
    proc = run("smoke", "--simulate", "hpu:8")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "whichdevice smoke: smoke runs real hardware; --simulate only changes the report"
    proc = run("smoke", "--simulate", "hpu:8", "--json")
    data = json.loads(proc.stdout)
    validate(data)
    assert data["kind"] == "error" and data["exit_code"] == 2


def test_help_and_usage_errors() -> None:
    proc = run("--help")
    assert proc.returncode == 0 and "check" in proc.stdout and "smoke" in proc.stdout
    proc = run("--task", "serving")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 2 and "--task" in proc.stderr


def test_version() -> None:
    from whichdevice.core.packages import package_version

    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout == f"whichdevice {wd.__version__}\n" and not proc.stderr
    # the installed distribution says the same as the package
    assert package_version("whichdevice") in (None, wd.__version__)
    assert cli.main(["--version"]) == 0


def run_on_tty(*args: str, **env: str) -> tuple[int, str]:
    """Run the command with stdout on a pseudo-terminal; its exit code and what it wrote there."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "whichdevice", *args],
            env=clean_env(TERM="xterm", **env),
            stdout=follower,
            stderr=subprocess.DEVNULL,
        )
        os.close(follower)
        follower = -1
        out = read_until_closed(leader, proc)
        return proc.wait(timeout=60), out.decode(errors="replace")
    finally:
        if follower != -1:
            os.close(follower)
        os.close(leader)


def test_colour_on_a_terminal_and_no_color() -> None:
    code, out = run_on_tty()
    assert code == 0 and ANSI.search(out)
    code, out = run_on_tty(NO_COLOR="1")
    assert code == 0 and "RESOLUTION FOR INFERENCE" in out and not ANSI.search(out)
    code, out = run_on_tty("--json")
    assert code == 0 and not ANSI.search(out)
    json.loads(out)


def test_report_does_not_import_transformers() -> None:
    code = (
        "import sys, io, contextlib\n"
        "from whichdevice.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--json']) == 0\n"
        "    assert main(['check']) == 0\n"
        "heavy = [m for m in ('transformers', 'accelerate', 'peft', 'bitsandbytes') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(("argv", "paused"), [("check", True), ("--json", True), ("smoke --help", False)])
def test_the_command_pauses_the_collector_in_its_own_process_only(argv: str, paused: bool) -> None:
    # As the command (main() with no argv): the collector is off for a command that runs no model.
    # Called in a program's process (main(argv)): the program's collector is left as it was.
    code = (
        "import atexit, contextlib, gc, io, os, sys\n"
        "from whichdevice.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    main({argv.split()!r})\n"
        "assert gc.isenabled(), 'main(argv) changed the caller collector'\n"
        "atexit.register(lambda: os.write(2, f'collector on at exit: {gc.isenabled()}'.encode()))\n"
        f"sys.argv = ['whichdevice', *{argv.split()!r}]\n"
        "raise SystemExit(main())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.endswith(f"collector on at exit: {not paused}")


def test_a_plugin_backend_from_an_entry_point_is_in_the_json_report(tmp_path: Path) -> None:
    # A third-party package, installed as far as importlib.metadata can tell: a module and a
    # dist-info folder whose entry point names its Backend record.
    (tmp_path / "plugdev_backend.py").write_text(
        "from whichdevice import Backend, EnvDefault\n"
        "from whichdevice.hardware.probing import ProbeResult\n"
        "RECORD = Backend(name='plugdev', hardware='Plugin accelerator', package='plugdev-torch',\n"
        "    module='plugdev_torch', probe_ref=lambda b: ProbeResult(b.name, installed=False, available=False,\n"
        "    reason='plugdev-torch is not installed'), visible_devices_env=('PLUGDEV_VISIBLE_DEVICES',),\n"
        "    env_defaults=(EnvDefault('PLUGDEV_SAFE_KERNELS', '1', 'its kernels crash without it'),))\n"
    )
    dist = tmp_path / "plugdev_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugdev-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[whichdevice.backends]\nplugdev = plugdev_backend:RECORD\n")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    proc = run("--json", PYTHONPATH=path, PLUGDEV_VISIBLE_DEVICES="1")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    validate(data)
    assert [row["name"] for row in data["backends"]][-2:] == ["plugdev", "cpu"]
    entries = {e["name"]: e for e in data["environment"]}
    assert entries["PLUGDEV_VISIBLE_DEVICES"]["effect"] == "shows physical plugdev device 1 as plugdev:0"
    assert entries["PLUGDEV_SAFE_KERNELS"]["backend"] == "plugdev"
    assert "when it probes plugdev, because its kernels crash without it" in entries["PLUGDEV_SAFE_KERNELS"]["effect"]


# --------------------------------------------------------------------------------- in-process


def test_options_before_or_after_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--json", "check", "cpu"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert cli.main(["check", "cpu", "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert before == after and before["kind"] == "check"
    assert cli.main(["--simulate", "cuda:2", "check", "--min-devices", "2"]) == 0
    assert "SIMULATED" in capsys.readouterr().out


def test_report_subcommand_and_task_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", "--task", "training", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    validate(data)
    assert [r["task"] for r in data["resolutions"]] == ["training"]
    assert data["resolutions"][0]["resolution"]["training_kwargs"]["use_cpu"] is True


def test_device_option_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["request"]["device"] == "cpu"
    assert data["resolutions"][0]["resolution"]["source"] == "device"
    assert cli.main(["check", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert cli.main(["check", "cpu", "--device", "cuda"]) == 2
    assert "give one" in capsys.readouterr().err
    assert cli.main(["smoke", "--device", "cdua"]) == 2
    assert "unknown device 'cdua'" in capsys.readouterr().err


def test_simulate_options_repeat(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--simulate", "hpu:8", "--simulate", "cuda:2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["simulation"]["specs"] == ["hpu:8", "cuda:2"]
    rows = {r["name"]: r for r in data["backends"]}
    assert rows["hpu"]["device_count"] == 8 and rows["cuda"]["device_count"] == 2
    assert cli.main(["--simulate", "hpu:x"]) == 2
    assert "simulate" in capsys.readouterr().err


def test_check_for_training(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--task", "all", "--json", "--simulate", "hpu:8", "--min-devices", "8"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tasks"] == ["inference", "training"] and data["device"] == "hpu"


def test_usage_error_in_json_mode(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--min-devices", "0", "--json"]) == 2
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    validate(data)
    assert data["kind"] == "error" and data["command"] == "check"
    assert "--min-devices" in captured.err


def test_internal_errors_are_one_line_unless_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(**kwargs: Any) -> dict[str, Any]:
        raise RuntimeError("the probe table is on fire")

    monkeypatch.setattr(sys.modules["whichdevice.report.gather"], "gather", broken)  # where the command reads it
    assert cli.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("whichdevice: internal error: RuntimeError: the probe table is on fire\n")
    assert "Traceback" not in err and "--debug" in err
    assert cli.main(["--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_keyboard_interrupt(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(**kwargs: Any) -> dict[str, Any]:
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["whichdevice.report.gather"], "gather", interrupted)
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "whichdevice: interrupted\n"


def test_a_closed_pipe_is_not_an_error() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = os.fdopen(write_end, "w")
    streams = Streams(stream, stream)
    write(streams, "x" * 100_000)  # EPIPE: no exception
    write(streams, "more")  # later writes go nowhere quietly
    close(streams)  # and closing says nothing either


def test_module_entry_point_exists() -> None:
    import importlib.util

    assert importlib.util.find_spec("whichdevice.__main__") is not None


def test_the_report_sizes_a_model_and_says_the_largest_job_that_fits(tmp_path: Path) -> None:
    # Issue 26: the command prints the longest length and largest batch that fit for --model.
    from tiny_models import save_tiny_llama

    folder = save_tiny_llama(tmp_path / "tiny", tokenizer=False)
    argv = ["--model", str(folder), "--batch-size", "4", "--max-length", "100000", "--task", "inference", "--json"]
    proc = subprocess.run([sys.executable, "-m", "whichdevice", *argv], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    resolution = json.loads(proc.stdout)["resolutions"][0]
    assert "the largest that fit for inference in " in resolution["explanation"]
    assert "batch_size=4" in resolution["explanation"]


def test_the_model_options_belong_to_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--model", "somewhere", "check", "cpu"]) == 2
    assert "check takes no --model" in capsys.readouterr().err
    assert cli.main(["--max-new-tokens", "9", "smoke"]) == 2
    assert "smoke takes no --max-new-tokens" in capsys.readouterr().err


def test_the_report_passes_the_new_tokens_to_the_resolution(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--max-length", "41", "--max-new-tokens", "9", "--task", "inference", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["resolutions"][0]["ok"] is True
    # resolve_device's own check reaches the command: a clear error, not a traceback.
    assert cli.main(["--max-length", "9", "--max-new-tokens", "9", "--task", "inference"]) != 0
    assert "max_length counts the prompt too" in capsys.readouterr().err
    assert cli.main(["--max-new-tokens", "0"]) == 2


@pytest.mark.parametrize("flag", ["--batch-size", "--max-length", "--max-new-tokens", "--min-devices"])
def test_a_count_below_one_names_its_option_and_what_it_takes(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["check", flag, "0"] if flag == "--min-devices" else [flag, "0"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: '0': give a whole number of 1 or more" in err
    # Only --min-devices counts devices: the others must not say so.
    assert "devices" not in err.split("\n")[0].replace("--min-devices", "")


@pytest.mark.parametrize("json_out", [False, True], ids=["text", "json"])
def test_a_model_path_that_does_not_exist_is_one_line_and_no_false_headline(tmp_path: Path, json_out: bool) -> None:
    """Issue 46: the report printed "no usable device" (the CPU was usable) and the error three times."""
    missing = tmp_path / "no such model"
    proc = run("--model", str(missing), *(["--json"] if json_out else []))
    assert proc.returncode == 2
    assert "no usable device" not in proc.stdout + proc.stderr
    if json_out:
        error = json.loads(proc.stdout)
        validate(error)
        assert error["kind"] == "error" and str(missing) in error["error"]["message"]
    else:
        assert proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and str(missing) in lines[0]
