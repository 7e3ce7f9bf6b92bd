"""Simulated hardware: ``simulate("hpu:8")`` replaces the *reading* of hardware, and nothing else.

A simulation builds, from its spec, the raw readings a runtime would give (device names, counts,
memory, versions, the visible-devices variables in the environment) and hands them to the same
interpretation a real probe uses; the probe machinery (time limit, exception capture, one run per
backend), the env hooks and the whole resolver run for real. Spec strings::

    "cuda:4"                                  four GPUs with default details (Ampere-class)
    "cuda:8,cc=9.0,mem=141GiB,name=NVIDIA H200"
    "cuda:2,variant=rocm"                     AMD GPUs through the ROCm build
    "hpu:8,gen=gaudi3"   "npu:8,bf16=no"   "neuron:2"   "tpu:4"   "mps,macos=13.6"
    "cpu,flags=avx512_bf16"   "cpu,flags="    the CPU with (or without) native bf16
    "cpu,calib=bf16.b1:1.15/bf16.b4:0.72/bf16.prompt:0.3"   the CPU's calibration figures
    "cpu,flags=avx512_bf16,packs=float32"     a CPU whose oneDNN packs fp32 weights only
    "npu,broken"   "npu,hangs"   "npu,missing"   "cuda:0"  installed-but-broken, a hanging probe,
                                              not installed, installed with no device

The count is the number of *physical* devices; visible-devices variables in the environment then
select among them, as the runtime would. Backends no spec names are simulated absent (``cpu`` is
probed for real) unless ``others="real"``. ``packages={"accelerate": "1.4.0", "kernels": None}``
answers package-version questions for the duration. ``simulate(report="machine.json")`` replays the
machine a ``whichdevice --json`` report describes (see :mod:`whichdevice.testing.replay`). Nothing
turns a simulation on from the environment.

A simulation is per process, like the environment it restores on exit: while it is on, every thread
sees it (threads and pools started inside it too). One thread at a time holds simulations (nested
ones included); ``simulate()`` entered in another thread waits until they end, for at most
``WAIT_S`` seconds, then raises DeviceError, so two threads never see each other's machine.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from whichdevice.core.errors import DeviceError
from whichdevice.core.packages import simulated_packages
from whichdevice.core.records import Backend, ProbeResult
from whichdevice.hardware import store as _probe
from whichdevice.hardware.envhooks import _forget
from whichdevice.hardware.probes import interpret, not_installed
from whichdevice.hardware.probes.common import simulated_absent_reason
from whichdevice.hardware.probes.cpu_facts import BF16_CPU_FLAGS
from whichdevice.hardware.registry import backend_names, get_backend
from whichdevice.measure.calibration import calibration_enabled, parse_figures, pin
from whichdevice.testing.readings import simulated_readings
from whichdevice.testing.replay import RecordedMachine, load_report, replay_environment, replaying
from whichdevice.testing.spec import SimulatedDevice, parse_spec

__all__ = [
    "WAIT_S",
    "RecordedMachine",
    "SimulatedDevice",
    "active",
    "load_report",
    "parse_spec",
    "replaying",
    "simulate",
    "simulated_readings",
]


class _SimulatedStore(_probe._Store):
    def __init__(
        self,
        specs: dict[str, SimulatedDevice],
        others: str,
        packages: Mapping[str, str | None],
        release: threading.Event,
        recorded: RecordedMachine | None = None,
    ):
        super().__init__()
        self.specs = specs
        self.others = others
        self.packages = packages
        self.release = release
        self.recorded = recorded
        cpu = specs.get("cpu")
        # What oneDNN packs on the simulated CPU (measure.cpu_memory.packable_dtypes); None:
        # this machine's answer (no CPU spec, or one that keeps the real flags).
        self.packs: frozenset[str] | None = None
        if cpu is not None and recorded is None:
            self.packs = cpu.packs if cpu.packs is not None else _packs_of(cpu.flags)
        if recorded is not None:
            # A replayed CPU keeps the figures its machine used, never this machine's.
            pin(self, parse_figures(recorded.calibration) if recorded.calibration else None, recorded.calibration_why)
        elif cpu is not None:
            # A simulated CPU is timed by its spec's figures or not at all, never by this machine's.
            figures = parse_figures(cpu.calibration) if cpu.calibration else None
            enabled, off = calibration_enabled()
            if figures:
                why = "simulated figures (calib= in the spec)"
            else:  # said as the real CPU would say it when the variable turns calibration off
                why = off if not enabled else "the simulated CPU has no calib= figures"
            pin(self, figures, why)

    def function(self, backend: Backend) -> Callable[[Backend], ProbeResult]:
        if self.recorded is not None:
            return self.recorded.probe_function(backend) or _absent
        spec = self.specs.get(backend.name)
        if spec is None:
            if self.others == "real" or backend.name == "cpu":
                return backend.probe
            return _absent
        return lambda b: self.result(b, spec)

    def result(self, backend: Backend, spec: SimulatedDevice) -> ProbeResult:
        if spec.mode == "hangs":
            self.release.wait()  # until the simulation ends; the probe's time limit fires first
            raise TimeoutError("simulated hang released")
        readings = simulated_readings(spec, self.packages)
        return replace(interpret(backend, readings), simulated=True)


def _packs_of(flags: frozenset[str] | None) -> frozenset[str] | None:
    """What a simulated CPU with these flags packs: bf16 too where it has native bf16 (every such CPU
    also has AVX-512BW/VL/DQ, which torch's oneDNN bf16 check asks for)."""
    if flags is None:
        return None
    return frozenset({"float32", "bfloat16"} if flags & BF16_CPU_FLAGS else {"float32"})


def _absent(backend: Backend) -> ProbeResult:
    return not_installed(backend, simulated_absent_reason(backend), simulated=True)


def _check_packages(packages: Mapping[str, str | None] | None) -> dict[str, str | None]:
    if packages is None:
        return {}
    if not isinstance(packages, Mapping) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in packages.items()
    ):
        raise DeviceError(
            f"simulate(packages={packages!r}): give a dict of distribution name -> version string, "
            "or None for not installed, e.g. {'accelerate': '1.4.0', 'kernels': None}"
        )
    return dict(packages)


# Seconds simulate() waits for another thread's simulations to end before it gives up.
WAIT_S = 30.0
_holder = threading.Condition()
# The thread whose simulations are on, and how many of them (nested).
_held: list[tuple[threading.Thread, int]] = []


def _hold() -> None:
    me = threading.current_thread()
    with _holder:
        if not _holder.wait_for(lambda: not _held or _held[0][0] is me, timeout=WAIT_S):
            raise DeviceError(
                f"simulate(): thread {_held[0][0].name!r} has a simulation on, and a simulation is per "
                f"process (every thread sees it); it did not end within {WAIT_S:g} s. Run simulations "
                "one thread at a time, or in separate processes (pytest-xdist)"
            )
        depth = _held[0][1] if _held else 0
        _held[:] = [(me, depth + 1)]


def _release() -> None:
    with _holder:
        if _held:
            thread, depth = _held[0]
            _held[:] = [(thread, depth - 1)] if depth > 1 else []
        _holder.notify_all()


class simulate(contextlib.ContextDecorator):  # noqa: N801 - reads as a verb at the call site
    """Pretend this machine has the hardware in ``specs``; usable as ``with``, decorator or fixture.

    ``others="absent"`` (default) reports every backend no spec names as not present (the CPU is
    probed for real); ``others="real"`` probes them for real. ``packages`` maps distribution names
    to the versions ``whichdevice.core.packages.package_version`` reports (None: not installed). Nests;
    restores everything on exit, including variables the env-setup hooks set while it was on.

    ``report`` (a ``whichdevice --json`` file's path, or its parsed dict) replays the machine that
    wrote it instead of specs: its probe results, the steering variables it had set (the others are
    unset for the duration) and the package versions it reported; ``packages`` still wins.
    """

    def __init__(
        self,
        *specs: str,
        others: str = "absent",
        packages: Mapping[str, str | None] | None = None,
        report: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    ) -> None:
        if others not in ("absent", "real"):
            raise DeviceError(f"simulate(others={others!r}): use 'absent' or 'real'")
        if report is not None and specs:
            raise DeviceError(
                "simulate: give specs or report=, not both (a report already describes every backend of its machine)"
            )
        self.recorded = load_report(report) if report is not None else None
        parsed: dict[str, SimulatedDevice] = {}
        for spec in specs:
            for piece in _split_specs(spec):
                sim = parse_spec(piece)
                if sim.backend in parsed:
                    raise DeviceError(f"simulate: {sim.backend!r} is given twice; give each backend once")
                parsed[sim.backend] = sim
        self.specs = parsed
        self.others = others
        self.packages = _check_packages(packages)
        self._frames: list[tuple[_SimulatedStore, dict[str, str | None], contextlib.ExitStack]] = []

    def __enter__(self) -> simulate:
        _hold()
        release = threading.Event()
        store = _SimulatedStore(self.specs, self.others, self.packages, release, self.recorded)
        stack = contextlib.ExitStack()
        packages = dict(self.packages)
        try:
            if self.recorded is not None:
                stack.enter_context(replay_environment(self.recorded.environ))
                packages = {**self.recorded.packages, **packages}
            env_before = {
                d.name: os.environ.get(d.name) for name in backend_names() for d in get_backend(name).env_defaults
            }
            if packages:
                stack.enter_context(simulated_packages(packages))
        except BaseException:
            stack.close()
            _release()
            raise
        self._frames.append((store, env_before, stack))
        _probe._simulations.append(store)
        return self

    def __exit__(self, *exc: object) -> None:
        store, env_before, stack = self._frames.pop()
        store.release.set()
        if store in _probe._simulations:
            _probe._simulations.remove(store)
        try:
            for name, old in env_before.items():
                if os.environ.get(name) != old:
                    if old is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = old
                    _forget(name)
            stack.close()  # after the hooks' variables: a replay's environment was set before them
        finally:
            _release()

    @property
    def description(self) -> str:
        if self.recorded is not None:
            return f"report {self.recorded.source}"
        return ", ".join(f"{s.backend}:{s.count}" + (f" ({s.mode})" if s.mode else "") for s in self.specs.values())


def _split_specs(spec: str) -> list[str]:
    # "npu:8;cuda:2" or a list of separate strings both work; ';' separates machines' parts.
    if not isinstance(spec, str):
        raise DeviceError(f"simulate: a spec is a string like 'cuda:4', not {type(spec).__name__}")
    return [p for p in spec.split(";") if p.strip()] or [spec]


def active() -> bool:
    """True while a simulation is on (the command prints SIMULATED then)."""
    return bool(_probe._simulations)
