"""``whichdevice smoke``: the end-to-end run on this machine, its failures and its progress display."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest

from whichdevice import report, smoke
from whichdevice.core.errors import DeviceError
from whichdevice.hardware.registry import backends
from whichdevice.resolve.resolver import resolve_device
from whichdevice.testing import simulate

STEERING = {
    *(var for b in backends() for var in b.visible_devices_env),
    "WHICHDEVICE_DEVICE",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_TORCH_DEVICE",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
}


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in STEERING}


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in STEERING:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def smoke_run() -> subprocess.CompletedProcess[str]:
    """One real ``whichdevice smoke --json`` on this machine (builds, loads, generates, trains)."""
    return subprocess.run(
        [sys.executable, "-m", "whichdevice", "smoke", "--json"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.slow
def test_smoke_passes_on_this_machine(smoke_run: subprocess.CompletedProcess[str]) -> None:
    assert smoke_run.returncode == 0, smoke_run.stderr
    data = json.loads(smoke_run.stdout)
    jsonschema.Draft202012Validator(report.load_schema()).validate(data)
    assert data["kind"] == "smoke" and data["ok"] is True and data["error"] is None
    assert [s["name"] for s in data["steps"]] == [
        "resolve",
        "import transformers",
        "build and save a tiny Llama",
        "load for inference",
        "generate",
        "load for training",
        "train 3 steps",
    ]
    assert all(s["ok"] for s in data["steps"])
    # The model really ran where, and how, the resolution for that model said (on a CPU with
    # native bf16 the keywords name sdpa and prepare() runs the decode attention verified for Llama).
    expected = resolve_device(model=smoke.tiny_llama_config())
    inference, training = data["inference"], data["training"]
    assert inference["device"] == expected.device == inference["resolved_device"]
    assert inference["dtype"] == expected.dtype_name
    prepared = expected.tuning.attention_after_prepare(expected.attn_implementation) if expected.tuning else None
    assert inference["attn_implementation"] == (prepared or expected.attn_implementation)
    assert inference["new_tokens"] == smoke.NEW_TOKENS and inference["tokens_per_second"] > 0
    assert training["device"] == expected.device and training["steps"] == smoke.TRAIN_STEPS
    assert training["seconds_per_step"] > 0 and training["loss"] > 0
    assert training["training_kwargs"] == resolve_device(task="training").training_kwargs()


@pytest.mark.slow
def test_smoke_progress_is_plain_on_a_pipe(smoke_run: subprocess.CompletedProcess[str]) -> None:
    err = smoke_run.stderr
    assert "\r" not in err and "\033[" not in err
    lines = [line for line in err.splitlines() if line.startswith("[")]
    assert len(lines) == 7
    for i, line in enumerate(lines, 1):
        assert re.match(rf"\[{i}/7\] .+ \.\.\. ok \(\d+\.\d\d s\)", line), line
    # Library chatter (tqdm bars, Trainer's metrics dict) stays out of both streams.
    assert "it/s]" not in err and "train_runtime" not in smoke_run.stdout + err


@pytest.mark.slow
def test_summary_text(smoke_run: subprocess.CompletedProcess[str]) -> None:
    data = json.loads(smoke_run.stdout)
    text = smoke.render_summary(data)
    assert text.startswith("smoke passed in ")
    assert "tokens/s" in text and "s/step" in text
    assert f"device {data['inference']['device']}, dtype {data['inference']['dtype']}" in text


def test_smoke_refuses_simulation_in_process() -> None:
    with simulate("hpu:8"), pytest.raises(DeviceError, match="--simulate only changes the report"):
        smoke.run_smoke()


def test_unusable_device_fails_at_resolve_with_the_reason() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "whichdevice", "smoke", "--device", "cuda"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("whichdevice smoke: step 'resolve' failed: DeviceUnavailableError:")
    assert "pip install torch" in last
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_a_failing_step_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_transformers(state: dict[str, Any]) -> None:
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(smoke, "_import_transformers", no_transformers)
    stream = io.StringIO()
    result = smoke.run_smoke(tasks=("inference",), progress_stream=stream)
    assert result["ok"] is False and result["exit_code"] == 1
    assert [s["name"] for s in result["steps"]] == ["resolve", "import transformers"]
    assert result["error"]["step"] == "import transformers"
    assert result["error"]["message"] == (
        "step 'import transformers' failed on cpu: ImportError: No module named 'transformers'"
    )
    assert "[2/5] import transformers ... FAILED" in stream.getvalue()


def test_debug_keeps_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(state: dict[str, Any]) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(smoke, "_import_transformers", broken)
    stream = io.StringIO()
    result = smoke.run_smoke(tasks=("training",), progress_stream=stream, debug=True)
    assert "Traceback" in result["steps"][1]["error"]["traceback"]
    assert "Traceback" in stream.getvalue()


def test_progress_redraws_only_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    plain = io.StringIO()
    progress = smoke.Progress(plain, 2)
    progress.start("first")
    progress.update("step 1/3")
    progress.finish(smoke._Step("first", ok=True, seconds=0.5, notes=["a library said this"]), "done")
    assert plain.getvalue() == "[1/2] first ... ok (0.50 s) done\n      note: a library said this\n"

    tty = Tty()
    progress = smoke.Progress(tty, 2)
    progress.start("first")
    progress.update("step 1/3")
    progress.finish(smoke._Step("first", ok=False, seconds=0.5))
    assert "\r" in tty.getvalue() and "step 1/3" in tty.getvalue() and "FAILED" in tty.getvalue()


def test_verify_catches_a_model_in_the_wrong_place() -> None:
    import torch
    from transformers import LlamaConfig

    res = resolve_device(dtype="float32", model=LlamaConfig(num_hidden_layers=1))  # attention read: sdpa
    model = SimpleNamespace(
        device=torch.device("cpu"), dtype=torch.float32, config=SimpleNamespace(_attn_implementation="sdpa")
    )
    smoke._verify(model, res)
    wrong_dtype = SimpleNamespace(device=model.device, dtype=torch.float16, config=model.config)
    with pytest.raises(smoke.SmokeCheckError, match="float16"):
        smoke._verify(wrong_dtype, res)
    wrong_attn = SimpleNamespace(
        device=model.device, dtype=torch.float32, config=SimpleNamespace(_attn_implementation="eager")
    )
    with pytest.raises(smoke.SmokeCheckError, match="eager"):
        smoke._verify(wrong_attn, res)


def test_library_messages_become_notes() -> None:
    import logging
    import warnings

    notes: list[str] = []
    with smoke._collect_messages(notes):
        logging.getLogger("some.library").warning("careful\nsecond line")
        warnings.warn("a user warning", UserWarning, stacklevel=1)
        warnings.warn("an old API", DeprecationWarning, stacklevel=1)
    assert notes == ["careful", "a user warning"]


def test_what_a_package_logs_while_being_imported_is_an_import_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import logging
    import warnings

    (tmp_path / "noisy_on_import").mkdir()
    (tmp_path / "noisy_on_import" / "__init__.py").write_text(
        "import logging, warnings\n"
        "logging.getLogger('noisy_on_import').warning('Failed to load a kernel nobody asked for')\n"
        "warnings.warn('a warning at import', UserWarning, stacklevel=1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    notes: list[str] = []
    import_notes: list[str] = []
    with smoke._collect_messages(notes, import_notes):
        importlib.import_module("noisy_on_import")
        logging.getLogger("some.library").warning("said while running")
        warnings.warn("a user warning", UserWarning, stacklevel=1)
    monkeypatch.delitem(sys.modules, "noisy_on_import")
    assert notes == ["said while running", "a user warning"]
    assert import_notes == [
        "Failed to load a kernel nobody asked for (on importing noisy_on_import)",
        "a warning at import (on importing noisy_on_import)",
    ]


def test_bitsandbytes_import_noise_stays_out_of_the_summary_and_shows_with_debug() -> None:
    """The real smoke test (training imports Trainer, which imports bitsandbytes) in a fresh process."""
    from whichdevice.hardware.probes.cpu_facts import cpu_facts
    from whichdevice.report.third_party import AVX512_BF16, bitsandbytes_hub_kernel

    found = bitsandbytes_hub_kernel()
    applies = found is not None and AVX512_BF16 in cpu_facts()[1]
    command = [sys.executable, "-m", "whichdevice", "smoke", "--task", "training"]
    plain = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=600, check=False)
    assert plain.returncode == 0, plain.stderr
    result = json.loads(plain.stdout)
    jsonschema.validate(result, report.load_schema())
    noted = [n for s in result["steps"] for n in s["notes"]]
    imported = [n for s in result["steps"] for n in s["import_notes"]]
    assert not any("Failed to load CPU" in n for n in noted)
    logged = found.logged if found is not None else "Failed to load CPU"
    assert any(logged in n and "on importing bitsandbytes" in n for n in imported) == applies, imported
    debug = subprocess.run([*command, "--debug"], capture_output=True, text=True, timeout=600, check=False)
    assert debug.returncode == 0, debug.stderr
    assert "Failed to load CPU" not in debug.stdout  # the summary
    assert "Failed to load CPU" not in plain.stderr  # the progress lines
    shown = [line for line in debug.stderr.splitlines() if "import note: " in line]
    assert any("Failed to load CPU" in line for line in shown) == applies, debug.stderr[-3000:]
