"""Shared fixtures: no test may leak environment variables, every test starts from real probes, and
tests about "this machine" run once per kind of CPU (``cpu_kind``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import whichdevice as wd
from whichdevice.hardware import probes, probing, registry
from whichdevice.testing import simulate

# The CPU's dtype follows its measured speeds (whichdevice.measure.calibration), which depend on how busy
# this machine is: tests pin figures with simulate("cpu,calib=...") instead, or turn it back on.
# Child processes (the command, pytester) inherit it.
os.environ["WHICHDEVICE_CALIBRATION"] = "off"

pytest_plugins = ["pytester"]  # test_testing.py runs the simulated_hardware fixture in a session


def _import_deepspeed_leaving_the_environment() -> None:
    """deepspeed's import sets PYTORCH_NVML_BASED_CUDA_CHECK=1 for good (deepspeed/__init__.py,
    os.environ.setdefault), and accelerate imports it inside save_pretrained and unwrap_model once it is
    installed (the test extra installs it). Imported once here with the environment put back, so the
    leak check below still catches whichdevice's own writes of that variable."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return
    before = dict(os.environ)
    import deepspeed  # noqa: F401

    for name in set(os.environ) - set(before):
        del os.environ[name]
    os.environ.update(before)


_import_deepspeed_leaving_the_environment()

# pytest rewrites PYTEST_CURRENT_TEST around every test phase; torch's inductor exports its cache
# directory the first time a model module asks for it. Neither is whichdevice's doing.
_IGNORED = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


@pytest.fixture(autouse=True)
def _no_environment_leaks() -> Iterator[None]:
    """Fail a test that leaves os.environ changed (use monkeypatch.setenv/delenv instead)."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = sorted(
        f"{name}: {before.get(name)!r} -> {after.get(name)!r}"
        for name in (before.keys() | after.keys()) - _IGNORED
        if before.get(name) != after.get(name)
    )
    if changed:
        pytest.fail("the test left os.environ changed:\n  " + "\n  ".join(changed), pytrace=False)


@pytest.fixture(autouse=True)
def _fresh_probes_and_registry() -> Iterator[None]:
    """Probe for real from scratch in each test; undo registry and timeout changes afterwards."""
    probing.clear_cache()
    yield
    probing.set_probe_timeout(None)
    registry._reset()


# How a test runs "on another kind of CPU" from this one:
# - "this": the machine as it is; expectations come from the real probe.
# - "no-native-bf16": ONEDNN_MAX_CPU_ISA=AVX512_CORE, a real setting torch obeys (oneDNN then
#   emulates bf16 even where the CPU has it) and the real probe reports; it reaches child processes.
# - "native-bf16": simulate("cpu,flags=avx512_bf16"), in this process only: no setting gives
#   bf16 instructions to a CPU without them.
CPU_KINDS = ("this", "no-native-bf16", "native-bf16")


class CpuKind:
    """The kind of CPU a machine-sensitive test runs as, and what the CPU rule must pick there."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def native_bf16(self) -> bool:
        cpu = wd.probe("cpu")
        return bool(cpu.devices and cpu.devices[0].bf16)

    @property
    def dtype(self) -> str:
        """bf16 where the probe says bf16 is native, else fp32: taken from the probe, not assumed."""
        return "bfloat16" if self.native_bf16 else "float32"

    def __repr__(self) -> str:
        return f"CpuKind({self.name!r})"


@pytest.fixture(params=CPU_KINDS)
def cpu_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[CpuKind]:
    """Run a machine-sensitive test on this CPU, on one without native bf16, and on one with it;
    the test takes its expectations from ``cpu_kind.dtype`` (the probe), never from the CPU it was
    written on."""
    kind: str = request.param
    if kind == "no-native-bf16":
        monkeypatch.setenv(probes.ONEDNN_ISA_VARIABLE, "AVX512_CORE")
        probing.clear_cache()
        yield CpuKind(kind)
    elif kind == "native-bf16":
        with simulate("cpu,flags=avx512_bf16"):
            yield CpuKind(kind)
    else:
        yield CpuKind(kind)


@pytest.fixture
def restore_accelerate_variables() -> Iterator[None]:
    """TrainingArguments exports ACCELERATE_* variables for the Accelerator it creates later
    (ACCELERATE_MIXED_PRECISION, ...). That is transformers' doing, by design, so put them back
    rather than let the leak check blame whichdevice."""
    before = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    yield
    for name in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        if name not in before:
            del os.environ[name]
    os.environ.update(before)
