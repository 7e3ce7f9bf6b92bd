"""The probe layer: what is really here, asked once per process, bounded in time, never raising.

``probe(name)`` returns a frozen :class:`ProbeResult`. The per-backend functions that do the asking
live in :mod:`whichdevice.hardware.probes`; this module runs them: one run per backend even when many threads
ask at once, a time limit for a probe that hangs, an exception turned into a reason, and a cache
that ``refresh=True`` bypasses. ``whichdevice.testing.simulate`` swaps the functions and the cache,
nothing else, so simulated hardware goes through the same machinery.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from whichdevice.core import packages
from whichdevice.core.errors import DeviceError
from whichdevice.core.progress import working
from whichdevice.core.records import Backend, DeviceInfo, ProbeFunction, ProbeResult
from whichdevice.hardware.envhooks import release_scopes
from whichdevice.hardware.plugin_loading import set_plugin_loader
from whichdevice.hardware.probe_threads import run_bounded
from whichdevice.hardware.probes.torch_import import torch_import_reason
from whichdevice.hardware.registry import backends, get_backend, on_change
from whichdevice.hardware.store import (  # the state and the time limit, kept below the runner
    DEFAULT_TIMEOUT_S,
    _real_store,
    _seconds,
    _simulations,
    _Store,
    _store,
    probe_timeout,
    set_probe_timeout,
)

# DEFAULT_TIMEOUT_S and the time-limit functions live in whichdevice.hardware.store, below the probes.
__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DeviceInfo",
    "ProbeResult",
    "clear_cache",
    "forget_backend",
    "gave_up",
    "probe",
    "probe_all",
    "probe_counts",
    "probe_timeout",
    "raise_if_gave_up",
    "set_probe_timeout",
]


def _join_limit(seconds: float) -> float | None:
    # Thread.join refuses (OverflowError) anything past threading.TIMEOUT_MAX: that is no limit.
    return None if seconds >= threading.TIMEOUT_MAX else seconds


def probe(name: str, refresh: bool = False, *, timeout: float | None = None) -> ProbeResult:
    """Probe backend ``name`` (cached per process; ``refresh=True`` probes again)."""
    backend = get_backend(name)
    store = _store()
    while True:
        visible = _visible_key(backend)
        with store.lock:
            if not refresh and name in store.results and store.visible.get(name) == visible:
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
            limit = probe_timeout() if timeout is None else _seconds(timeout, "probe(timeout=)")
            with working(f"probing {name}"):
                result = _run(backend, store.function(backend), limit, store)
        finally:
            with store.lock:
                if result is not None:
                    store.results[name] = result
                    store.visible[name] = visible
                    store.counts[name] = store.counts.get(name, 0) + 1
                store.inflight.pop(name, None)
            event.set()
        return result


def _visible_key(backend: Backend) -> tuple[str | None, ...]:
    """The backend's visible-devices variables as they are now.

    A notebook that edits CUDA_VISIBLE_DEVICES between calls gets an answer that follows the edit:
    a cached result read under other values is probed again. Once the runtime has started in this
    process the new probe reads what the runtime really has (the variable no longer applies) and its
    own warning says so (probes/cuda.py, ``_initialised_warnings``).
    """
    return tuple(os.environ.get(variable) for variable in backend.visible_devices_env)


def gave_up() -> dict[str, str]:
    """What was given up in this process (or simulation): a backend whose probe hung or whose
    import crashed, or a plugin that did; name -> the reason, which says what to do."""
    import whichdevice.hardware.probes.verdicts as verdicts

    store = _store()
    with store.lock:
        out = dict(store.faults)
    if store is _real_store:
        modules = {b.module.split(".")[0] for b in backends() if b.name in out}
        out.update({m: r for m, r in verdicts.bad_imports().items() if m not in modules})
    return out


def raise_if_gave_up(what: str) -> None:
    """Raise a DeviceError when ``what`` (a call into transformers/accelerate, which ask every
    installed runtime themselves) would wait on what a probe gave up on: a hung import or runtime."""
    import whichdevice.hardware.probes.outcomes as outcomes

    outcomes.raise_if_import_hung(what)
    store = _store()
    with store.lock:
        hung = {name: why for name, why in store.faults.items() if "did not finish" in why}
    if hung:
        name, why = next(iter(hung.items()))
        raise DeviceError(
            f"{what} cannot run in this process: {why}. transformers and accelerate ask the {name} "
            f"runtime themselves, so this would wait the same way; fix the {name} runtime (or uninstall "
            f"{get_backend(name).package}), or raise the limit if it is just slow"
        )


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
    import whichdevice.hardware.probes.verdicts as verdicts

    # A package installed since (pip in a notebook, say) shows up on the next probe.
    packages.cache_clear()
    store = _store()
    with store.lock:
        store.resolutions.clear()
        if name is None:
            store.results.clear()
            store.visible.clear()
            store.counts.clear()
            store.faults.clear()
            if store is _real_store:
                verdicts.forget_bad_imports()  # a package fixed since is tried again
        else:
            store.results.pop(name, None)
            store.visible.pop(name, None)
            store.counts.pop(name, None)


def forget_backend(name: str) -> None:
    """Drop what every store (the real one and each simulation's) knows of backend ``name``, and
    every memoised resolution: the registry is one per process, so a backend registered, replaced
    or removed inside a simulation has changed the answers outside it too."""
    for store in (_real_store, *_simulations):
        with store.lock:
            store.results.pop(name, None)
            store.visible.pop(name, None)
            store.counts.pop(name, None)
            store.faults.pop(name, None)
            store.resolutions.clear()


on_change(forget_backend)


# Plugins of whichdevice.backends are tried in a child with the probe limit before they load here.
def _load_plugin(ep: Any) -> Any:
    import whichdevice.hardware.probes.plugins as plugins

    return plugins.load_plugin(ep, probe_timeout())


set_plugin_loader(_load_plugin)


def _import_torch_first(backend: Backend, timeout: float) -> list[str]:
    # A probe whose package is installed imports torch anyway; it happens before the probe's clock
    # starts (a cold disk takes seconds), but the plugins torch autoloads and the vendor package are
    # tried in a child first, each with the limit (probes.trial). The CPU probe and probes of absent
    # packages need no torch at all.
    from importlib.util import find_spec

    if backend.name == "cpu" or "torch" in sys.modules:
        return []
    if find_spec(backend.module.split(".")[0]) is None or find_spec("torch") is None:
        return []
    import whichdevice.hardware.probes.plugins as plugins

    with working("importing torch", at_once=True):
        return plugins.import_torch(timeout)


def _prepare(backend: Backend, timeout: float, store: _Store) -> tuple[list[str], ProbeResult | None]:
    """Before a real probe: torch and the vendor packages, tried first (notes; or the result when
    the probe must not run here)."""
    import whichdevice.hardware.probes.outcomes as outcomes
    import whichdevice.hardware.probes.verdicts as verdicts

    store.faults.pop(backend.name, None)
    if store is not _real_store:
        return [], None
    try:
        notes = _import_torch_first(backend, timeout)
        if verdicts.vendor_modules([backend]):
            import whichdevice.hardware.probes.trial as trial

            # Every installed vendor package is tried in the same child (one torch import).
            trial.trial_imports(trial.risky_modules(backends()), timeout)
    except Exception as exc:
        return [], ProbeResult(backend.name, installed=False, available=False, reason=torch_import_reason(exc))
    bad = verdicts.bad_imports().get(backend.module.split(".")[0])
    if bad is None:
        return notes, None
    store.faults[backend.name] = outcomes.gave_up_reason(backend, bad)
    return notes, _failed(backend, store.faults[backend.name], 0.0)


def _run(backend: Backend, function: ProbeFunction, timeout: float, store: _Store) -> ProbeResult:
    import whichdevice.hardware.probes.outcomes as outcomes
    import whichdevice.hardware.probes.verdicts as verdicts

    notes, early = _prepare(backend, timeout, store)
    if early is not None:
        return early
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = function(backend)
        except BaseException as exc:
            box["error"] = exc

    before = outcomes.environment_snapshot()
    start = time.perf_counter()
    thread = run_bounded(target, backend.name, _join_limit(timeout))
    elapsed = time.perf_counter() - start
    if thread is not None:
        # Whatever whichdevice set for the probe goes back now, not when (if ever) the thread ends;
        # an import it left half done is remembered, so later calls fail fast instead of waiting.
        release_scopes(thread)
        verdicts.remember_bad_import(
            verdicts.half_imported(), f"the {backend.name} probe's import did not finish within {timeout:g} s"
        )
        why = (
            f"the {backend.name} probe did not finish within {timeout:g} s (a hung driver or "
            f"package import?); whichdevice gave up on it. Raise the limit with "
            f"WHICHDEVICE_PROBE_TIMEOUT=<seconds> if the import is just slow"
        )
        store.faults[backend.name] = why
        return outcomes.with_notes(_failed(backend, why, elapsed), notes, before)
    if "error" in box:
        return outcomes.with_notes(_failed(backend, _error_reason(backend, box["error"]), elapsed), notes, before)
    result = box["result"]
    if not isinstance(result, ProbeResult):
        why = f"the {backend.name} probe returned {type(result).__name__}, not a ProbeResult; " + _probe_fix(backend)
        return _failed(backend, why, elapsed)
    return outcomes.with_notes(replace(result, seconds=elapsed), notes, before)


def _probe_fix(backend: Backend) -> str:
    """Whose probe it is and what to do: the plugin's package, or whichdevice's own."""
    from whichdevice.hardware.plugin_loading import fix_for, registered_by

    distribution = registered_by(backend.name)
    if distribution is not None:
        return f"the probe comes from the plugin package {distribution!r}: {fix_for(distribution, 'the plugin')}"
    ref = backend.probe_ref
    where = ref if isinstance(ref, str) else f"{ref.__module__}:{getattr(ref, '__qualname__', ref)}"
    if where.startswith("whichdevice."):
        return "this is a bug in whichdevice's own probe: report it with the output of `whichdevice --debug`"
    return f"the probe is {where}, given to register_backend(): make it return a whichdevice.ProbeResult"


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
    if not isinstance(error, (ImportError, SystemExit)):
        # The packages imported (a failed import reaches here as the ImportError raise_import_error
        # raises): what failed is reading the runtime or a tool, and reinstalling would not help.
        return (
            f"the {backend.name} probe {what}, after its packages imported ({backend.package!r} among them): "
            f"not a failed install; {_probe_fix(backend)}"
        )
    return (
        f"the {backend.name} probe {what}. The package {backend.package!r} is installed "
        f"but broken: reinstall it ({backend.install_command}) or uninstall it"
    )
