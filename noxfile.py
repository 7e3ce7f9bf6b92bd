"""nox sessions: tests, the transformers 4.57 end-to-end run, Ray Train, lint, bench and docs (`nox -l` lists them)."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

# A bare torch requirement pulls a multi-GB CUDA build; the pinned CPU build comes first.
TORCH = "torch==2.13.0"


def install(session: nox.Session, *extras: str, pins: tuple[str, ...] = ()) -> None:
    session.install(TORCH)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install(target, *pins)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole test suite against the newest transformers here."""
    install(session, "test")
    session.run("pytest", *session.posargs)


@nox.session(python="3.11", name="tests-transformers-4.57")
def tests_transformers_457(session: nox.Session) -> None:
    """End-to-end, training and attention tests against transformers 4.57.6 (the oldest supported)."""
    # Only the test runner besides the pin: the test extra's peft/bitsandbytes/kernels track the
    # newest transformers and are not what this session is about.
    install(session, pins=("transformers==4.57.6", "pytest>=8", "hypothesis>=6"))
    session.run(
        "pytest",
        "tests/test_end_to_end.py",
        "tests/training/test_training.py",
        "tests/launch/test_distributed.py",
        "tests/resolve/test_resolver.py",
        "tests/attention/test_decode_attention.py",
        *session.posargs,
    )


@nox.session(python="3.11", name="tests-ray")
def tests_ray(session: nox.Session) -> None:
    """The Ray Train row of the launch matrix: ray[train] is large, so the default run skips it."""
    install(session, "test", pins=("ray[train]>=2.60",))
    session.run(
        "pytest", "tests/launch/test_distributed.py", "-k", "ray", *session.posargs, env={"WHICHDEVICE_TEST_RAY": "1"}
    )


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and mypy --strict on src/."""
    install(session, "dev", "quantization")
    session.run("ruff", "check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("mypy")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """The benchmark: what asking costs and what the answer buys, medians and ratios (benchmarks/cost_of_asking.py)."""
    install(session, "quantization")
    session.run("python", "benchmarks/cost_of_asking.py", *session.posargs)


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """Build the user docs with mkdocs in strict mode (broken links fail)."""
    session.install("mkdocs>=1.6")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


# Vendor runtimes installed for real on a machine without their devices (tests/hardware/test_vendor_stacks.py).
# Each stack gets its own throwaway venv under .nox/; the torch each plugin was built against comes
# with it. None is in the default run: the CUDA build alone is several GB.
# stack -> (what to install, the device `whichdevice check` is asked for, environment)
VENDOR_STACKS: dict[str, tuple[tuple[str, ...], str, dict[str, str]]] = {
    # The index's default torch on Linux is the CUDA 13.0 build; no NVIDIA driver here.
    "cuda": (("torch==2.14.1",), "cuda", {}),
    # The same, plus NVML's Python binding without libnvidia-ml.so (which comes with the driver).
    "cuda-nvml": (("torch==2.14.1", "nvidia-ml-py"), "cuda", {}),
    # torch_xla runs on the CPU with PJRT_DEVICE=CPU; it is built against torch 2.9 (a CUDA 12.8 build).
    "xla": (("torch==2.9.0", "torch_xla==2.9.0"), "tpu", {"PJRT_DEVICE": "CPU"}),
    # torch_npu pins torch 2.13 (Requires-Dist: torch==2.13.0.*); the CANN toolkit is not on PyPI.
    "npu": ((TORCH, "torch_npu==2.13.0"), "npu", {}),
    # PyPI's torch-neuronx is AWS's placeholder: importing it says to use the Neuron package index.
    "neuron": ((TORCH, "torch-neuronx==1.0"), "neuron", {}),
}

# What a stack's row says, printed for the record (the tests hold it to the runtime's words). It
# ends with os._exit: after a failed `import torch` (torch_npu without CANN) the interpreter
# crashes on exit.
_SHOW_ROW = """
import os, sys
from whichdevice.report import gather
for row in gather(tasks=("inference",))["backends"]:
    if row["name"] == sys.argv[1]:
        for key in ("status", "versions", "reason", "warnings", "incompatible", "features"):
            print(f"{row['name']}.{key}: {row[key]}")
sys.stdout.flush()
os._exit(0)
"""


@nox.session(python="3.11", name="vendor-stacks")
@nox.parametrize("stack", list(VENDOR_STACKS))
def vendor_stacks(session: nox.Session, stack: str) -> None:
    """Each vendor stack in its own venv without its hardware: what the real runtime says."""
    packages, device, env = VENDOR_STACKS[stack]
    session.install(*packages)
    session.install("-e", ".", "pytest>=8")
    env = {**env, "WHICHDEVICE_VENDOR_STACK": stack}
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "-v",
        "-rs",
        "tests/hardware/test_vendor_stacks.py",
        *session.posargs,
        env=env,
    )
    session.run("python", "-c", _SHOW_ROW, device, env=env)
    session.run("whichdevice", "check", device, env=env, success_codes=[0, 1])
