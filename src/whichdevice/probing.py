"""The probe layer: what is really here, asked once per process, bounded in time, never raising.

``probe(name)`` returns a frozen :class:`ProbeResult`. The per-backend functions that do the asking
live in :mod:`whichdevice.probes`; this module runs them: one run per backend even when many threads
ask at once, a time limit for a probe that hangs, an exception turned into a reason, and a cache
that ``refresh=True`` bypasses. ``whichdevice.testing.simulate`` swaps the functions and the cache,
nothing else, so simulated hardware goes through the same machinery.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from typing import Any

from whichdevice import packages
from whichdevice.errors import DeviceError
from whichdevice.probes.common import torch_import_reason
from whichdevice.records import Backend, DeviceInfo, ProbeFunction, ProbeResult
from whichdevice.registry import backends, get_backend, on_change

__all__ = [
    "DeviceInfo",
    "ProbeResult",
    "clear_cache",
    "forget_backend",
    "probe",
    "probe_all",
    "probe_counts",
    "probe_timeout",
]

DEFAULT_TIMEOUT_S = 10.0


class _Store:
    """Results, in-flight markers and run counts: one for real hardware, one per simulation."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.results: dict[str, ProbeResult] = {}
        self.inflight: dict[str, threading.Event] = {}
        self.counts: dict[str, int] = {}
        # Finished resolutions keyed by their arguments and the variables they read (see
        # memo.memo_key); they derive from the results above, so they are cleared with them.
        self.resolutions: dict[Any, Any] = {}

    def function(self, backend: Backend) -> ProbeFunction:
        return backend.probe


_real_store = _Store()
# The simulation stack (whichdevice.testing pushes and pops); the innermost one answers.
_simulations: list[_Store] = []
_timeout_override: float | None = None


def current_store() -> _Store:
    """The store that answers now: the innermost simulation's, or the real one."""
    return _store()


def _store() -> _Store:
    return _simulations[-1] if _simulations else _real_store


def _after_fork_in_child() -> None:
    # A fork taken while another thread held a lock or ran a probe would leave the child waiting
    # forever; results stay valid (same machine), the bookkeeping starts fresh.
    for store in (_real_store, *_simulations):
        store.lock = threading.Lock()
        store.inflight.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def probe_timeout() -> float:
    """Seconds a probe may take before it is reported as hung (``WHICHDEVICE_PROBE_TIMEOUT``)."""
    if _timeout_override is not None:
        return _timeout_override
    raw = os.environ.get("WHICHDEVICE_PROBE_TIMEOUT")
    if raw:
        try:
            value = float(raw)
            if value > 0:
                return value
        except ValueError:
            pass
    return DEFAULT_TIMEOUT_S


def set_probe_timeout(seconds: float | None) -> None:
    """Set the probe time limit for this process (None: back to the default)."""
    global _timeout_override
    if seconds is not None and seconds <= 0:
        raise ValueError(f"a probe timeout is a positive number of seconds, not {seconds!r}")
    _timeout_override = seconds


def probe(name: str, refresh: bool = False, *, timeout: float | None = None) -> ProbeResult:
    """Probe backend ``name`` (cached per process; ``refresh=True`` probes again)."""
    backend = get_backend(name)
    store = _store()
    while True:
        with store.lock:
            if not refresh and name in store.results:
                return store.results[name]
            event = store.inflight.get(name)
            owner = event is None
            if owner:
                event = threading.Event()
                store.inflight[name] = event
        assert event is not None
        if not owner:
            # Someone else is probing this backend now: their answer is ours too.
            event.wait()
            refresh = False
            continue
        result: ProbeResult | None = None
        try:
            result = _run(backend, store.function(backend), timeout or probe_timeout())
        finally:
            with store.lock:
                if result is not None:
                    store.results[name] = result
                    store.counts[name] = store.counts.get(name, 0) + 1
                store.inflight.pop(name, None)
            event.set()
        return result


def probe_all(refresh: bool = False) -> tuple[ProbeResult, ...]:
    """Probe every registered backend, in detection order."""
    return tuple(probe(b.name, refresh=refresh) for b in backends())


def probe_counts() -> dict[str, int]:
    """How many times each backend's probe really ran in this process (or this simulation)."""
    store = _store()
    with store.lock:
        return dict(store.counts)


def clear_cache(name: str | None = None) -> None:
    """Forget cached results (one backend, or all) so the next ``probe`` asks again."""
    # A package installed since (pip in a notebook, say) shows up on the next probe.
    packages.cache_clear()
    store = _store()
    with store.lock:
        store.resolutions.clear()
        if name is None:
            store.results.clear()
            store.counts.clear()
        else:
            store.results.pop(name, None)
            store.counts.pop(name, None)


def forget_backend(name: str) -> None:
    """Drop what every store (the real one and each simulation's) knows of backend ``name``, and
    every memoised resolution: the registry is one per process, so a backend registered, replaced
    or removed inside a simulation has changed the answers outside it too."""
    for store in (_real_store, *_simulations):
        with store.lock:
            store.results.pop(name, None)
            store.counts.pop(name, None)
            store.resolutions.clear()


on_change(forget_backend)


def _ensure_torch_imported(backend: Backend) -> None:
    # ``import torch`` takes seconds on a cold disk and a probe whose package is installed imports
    # it anyway, so it happens before the clock starts: the time limit is for the vendor part that
    # can hang. The CPU probe and probes of absent packages need no torch at all.
    from importlib.util import find_spec

    if backend.name == "cpu":
        return
    if find_spec(backend.module.split(".")[0]) is not None and find_spec("torch") is not None:
        import torch  # noqa: F401


def _run(backend: Backend, function: ProbeFunction, timeout: float) -> ProbeResult:
    try:
        _ensure_torch_imported(backend)
    except Exception as exc:
        return ProbeResult(
            backend.name,
            installed=False,
            available=False,
            reason=torch_import_reason(exc),
        )
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = function(backend)
        except BaseException as exc:
            box["error"] = exc

    start = time.perf_counter()
    thread = threading.Thread(target=target, name=f"whichdevice-probe-{backend.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    elapsed = time.perf_counter() - start
    if thread.is_alive():
        why = (
            f"the {backend.name} probe did not finish within {timeout:g} s (a hung driver or "
            f"package import?); whichdevice gave up on it. Raise the limit with "
            f"WHICHDEVICE_PROBE_TIMEOUT=<seconds> if the import is just slow"
        )
        return _failed(backend, why, elapsed)
    if "error" in box:
        return _failed(backend, _error_reason(backend, box["error"]), elapsed)
    result = box["result"]
    if not isinstance(result, ProbeResult):
        why = (
            f"the {backend.name} probe returned {type(result).__name__}, not a ProbeResult; "
            f"this is a bug in the probe of {backend.package!r}"
        )
        return _failed(backend, why, elapsed)
    return replace(result, seconds=elapsed)


def _failed(backend: Backend, reason: str, elapsed: float) -> ProbeResult:
    # installed: something answered (or hung), so the package is there
    return ProbeResult(backend.name, installed=True, available=False, reason=reason, seconds=elapsed)


def _error_reason(backend: Backend, error: BaseException) -> str:
    if isinstance(error, DeviceError):
        # A setting the user can fix (a malformed visible-devices variable, ...), not a broken
        # package: its message already says what to do.
        return f"{backend.name}: {error}"
    what = (
        f"called sys.exit({error.code!r})"
        if isinstance(error, SystemExit)
        else f"raised {type(error).__name__}: {error}"
    )
    return (
        f"the {backend.name} probe {what}. The package {backend.package!r} is installed "
        f"but broken: reinstall it ({backend.install_command}) or uninstall it"
    )
