"""Real vendor stacks without their devices: what each runtime says, and what whichdevice makes of it.

`nox -s vendor-stacks` installs each stack in its own venv (the CUDA build of torch without an NVIDIA
driver, nvidia-ml-py without libnvidia-ml, torch_xla on the CPU, torch_npu without CANN) and runs
this module there. In the normal suite every test skips at once: the conditions read package
metadata and try to load a shared library, and import nothing heavy (a torch_npu stack without CANN
cannot even import torch, so each check runs whichdevice in a child process).

The runtimes' own words are recorded in ``whichdevice.testing.readings.RUNTIME_TEXTS``, which the
simulations use; the tests here hold those records to what the real runtimes print.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from functools import cache
from importlib.util import find_spec
from typing import Any

import pytest

from whichdevice.core.packages import package_version
from whichdevice.hardware.compatibility import min_driver
from whichdevice.testing.readings import RUNTIME_TEXTS

STACK = os.environ.get("WHICHDEVICE_VENDOR_STACK")
HOW = "run `nox -s vendor-stacks` for the real vendor stacks"


def _loads(library: str) -> bool:
    try:
        ctypes.CDLL(library)
    except OSError:
        return False
    return True


@cache
def _cuda_build() -> bool:
    # The CUDA builds on the index depend on NVIDIA's runtime wheels; the CPU build on none.
    return any(package_version(f"nvidia-cuda-runtime{s}") for s in ("", "-cu12", "-cu13")) or bool(
        package_version("cuda-toolkit")
    )


def needs_cuda_without_driver() -> None:
    if not _cuda_build():
        pytest.skip(f"needs the CUDA build of torch (this torch is not one); {HOW}")
    if _loads("libcuda.so.1"):
        pytest.skip("an NVIDIA driver is installed here (libcuda.so.1 loads): this is the no-driver case")


def needs_nvml_without_library() -> None:
    if find_spec("pynvml") is None:
        pytest.skip(f"needs nvidia-ml-py; {HOW}")
    if _loads("libnvidia-ml.so.1"):
        pytest.skip("libnvidia-ml.so.1 loads here: this is the case without it")


def needs(dist: str) -> str:
    version = package_version(dist)
    if version is None:
        pytest.skip(f"needs {dist}; {HOW}")
    return version


def run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -c code`` in a fresh process (whatever a broken runtime does to it stays there)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
        check=False,
    )


def whichdevice(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run(f"import sys; from whichdevice.cli import main; sys.exit(main({list(args)!r}))", env)


def report_row(name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = whichdevice("--json", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    rows: list[dict[str, Any]] = json.loads(done.stdout)["backends"]
    return next(r for r in rows if r["name"] == name)


# ---------------------------------------------------------------- the CUDA build without a driver


def test_cuda_build_without_driver_report() -> None:
    needs_cuda_without_driver()
    facts = run("import torch; print(torch.__version__); print(torch.version.cuda)")
    torch_version, cuda = facts.stdout.split()
    row = report_row("cuda")
    assert row["status"] == "unavailable" and row["installed"] and row["variant"] == "cuda"
    assert row["versions"]["cuda"] == cuda  # the report shows the build's CUDA version
    reason = row["reason"]
    assert RUNTIME_TEXTS["cuda-no-driver"] in reason  # torch's own words
    assert f"torch {torch_version} is a CUDA {cuda} build" in reason
    assert "no NVIDIA driver" in reason and f"install the NVIDIA driver ({min_driver(cuda)} or newer)" in reason
    assert "--gpus" in reason
    assert row["features"], "the build's kernel architectures (torch.cuda.get_arch_list())"
    text = whichdevice().stdout
    line = next(x for x in text.splitlines() if x.strip().startswith("! cuda"))
    assert "(install:" not in line  # no hint to install the torch that is installed


def test_check_cuda_exits_1_naming_the_driver() -> None:
    needs_cuda_without_driver()
    done = whichdevice("check", "cuda")
    assert done.returncode == 1
    said = done.stdout + done.stderr
    assert "no NVIDIA driver" in said and RUNTIME_TEXTS["cuda-no-driver"] in said
    assert "install the NVIDIA driver" in said and "GPU node" in said


def test_resolve_device_cuda_names_the_driver() -> None:
    needs_cuda_without_driver()
    done = run(
        "import whichdevice\n"
        "try:\n    whichdevice.resolve_device('cuda')\n"
        "except whichdevice.DeviceError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    assert done.stdout.startswith("DeviceUnavailableError"), done.stdout + done.stderr[-2000:]
    assert "no NVIDIA driver" in done.stdout and RUNTIME_TEXTS["cuda-no-driver"] in done.stdout


def test_torch_says_what_the_simulation_says() -> None:
    needs_cuda_without_driver()
    done = run("import torch\ntry:\n    torch.cuda.init()\nexcept Exception as exc:\n    print(exc)")
    assert done.stdout.strip() == RUNTIME_TEXTS["cuda-no-driver"]


def test_nothing_printed_and_still_forkable() -> None:
    needs_cuda_without_driver()
    done = run(
        "import os, whichdevice, torch\n"
        "whichdevice.resolve_device()\n"
        "print(torch.cuda.is_initialized())\n"
        "pid = os.fork()\n"
        "os._exit(0) if pid == 0 else print(os.waitpid(pid, 0)[1])\n"
    )
    assert done.stdout.split() == ["False", "0"], done.stdout + done.stderr[-2000:]
    assert "CUDA initialization" not in done.stderr  # torch's warning is read, not printed


# ------------------------------------------------------------- nvidia-ml-py without libnvidia-ml


def test_nvml_without_library_fails_soft() -> None:
    needs_nvml_without_library()
    done = run("import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept Exception as exc:\n    print(exc)")
    assert done.stdout.strip() == RUNTIME_TEXTS["nvml-no-library"]
    row = report_row("cuda")
    assert not row["available"]
    assert any(
        f"NVML (nvidia-ml-py) could not be read: {RUNTIME_TEXTS['nvml-no-library']}" in w for w in row["warnings"]
    )


# ------------------------------------------------------------------- torch_xla on the CPU (PJRT)


def test_xla_on_the_cpu_is_never_a_tpu() -> None:
    xla = needs("torch_xla")
    env = {"PJRT_DEVICE": "CPU"}
    done = run(
        "import torch, torch_xla, torch_xla.runtime as xr\n"
        "print(torch_xla.device(), xr.device_type(), xr.global_runtime_device_count())\n"
        "import whichdevice\nres = whichdevice.resolve_device()\nprint(res.device)\n"
        "print(whichdevice.hardware.probing.probe('tpu').reason)\n",
        env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # what the real runtime says: an XLA device backed by the CPU
    assert lines[0].split()[:2] == ["xla:0", "CPU"], lines
    # with torch_xla imported by the program, detection still does not take it for a TPU
    assert lines[1] == "cpu"
    assert f"torch_xla {xla} is installed (PJRT_DEVICE=CPU" in lines[2] and "never picks" in lines[2]
    row = report_row("tpu", env)
    assert row["status"] == "not installed" and "torch_xla" in row["reason"]
    assert "also," not in row["reason"]  # torch and torch_xla of this stack belong together
    assert whichdevice("check", "tpu", env=env).returncode == 1


# ------------------------------------------------------------------ torch_npu without CANN


def test_torch_npu_without_cann_names_cann() -> None:
    needs("torch-npu")
    done = run("import torch")
    # torch auto-loads torch_npu as a device backend: import torch itself fails
    assert "Failed to load the backend extension: torch_npu" in done.stderr
    assert RUNTIME_TEXTS["npu-no-cann"] in done.stderr
    check = whichdevice("check", "npu")
    said = check.stdout + check.stderr
    assert check.returncode == 1, said[-2000:]  # not a crash on exit (the half-imported torch)
    assert RUNTIME_TEXTS["npu-no-cann"] in said and "CANN toolkit" in said
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in said and "pip uninstall torch-npu" in said
    # The rest of the report still comes: the CPU is there.
    assert whichdevice("check", "cpu").returncode == 0


def test_torch_npu_without_autoload_is_a_broken_import_naming_cann() -> None:
    needs("torch-npu")
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = whichdevice("check", "npu", env=env)
    said = done.stdout + done.stderr
    assert done.returncode == 1
    assert RUNTIME_TEXTS["npu-no-cann"] in said and "CANN toolkit" in said and "installed but broken" in said
    assert "is built for torch" not in said  # torch 2.13 is what torch_npu 2.13.0 requires
    row = report_row("npu", env)
    assert row["status"] == "unavailable"


# ------------------------------------------------------- torch-neuronx: PyPI's placeholder package


def test_torch_neuronx_placeholder_says_where_the_real_one_is() -> None:
    if needs("torch-neuronx") != "1.0":
        pytest.skip("a real torch-neuronx is installed: this is the case of PyPI's placeholder")
    done = run("import torch_neuronx")
    assert RUNTIME_TEXTS["neuron-placeholder"] in done.stderr
    check = whichdevice("check", "neuron")
    said = check.stdout + check.stderr
    assert check.returncode == 1
    assert RUNTIME_TEXTS["neuron-placeholder"] in said and "installed but broken" in said
