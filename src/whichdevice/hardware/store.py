"""Per-process probe state: the results cache, the simulation stack, and the probe time limit.

Kept apart from the probe runner (probing.py) so that what only reads the state (the calibration's
cache, a replayed report, the resolver's memo) does not import the machinery that runs probes.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any

from whichdevice.core.errors import DeviceError, shown
from whichdevice.core.records import Backend, ProbeFunction, ProbeResult

__all__ = ["DEFAULT_TIMEOUT_S", "current_store", "parse_timeout", "probe_timeout", "set_probe_timeout"]

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
        # The visible-devices variables each cached result was read under (see probing._visible_key).
        self.visible: dict[str, tuple[str | None, ...]] = {}
        # Backends whose probe was given up (it hung, or its import crashed a trial): name -> reason.
        self.faults: dict[str, str] = {}

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
    """Seconds a probe may take before it is reported as hung (``WHICHDEVICE_PROBE_TIMEOUT``).

    ``math.inf`` means no limit (``inf``, ``none``, ``off`` or ``0`` in the variable); a value that is
    not a time limit raises a :class:`DeviceError` naming the valid forms.
    """
    if _timeout_override is not None:
        return _timeout_override
    raw = os.environ.get("WHICHDEVICE_PROBE_TIMEOUT")
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    return parse_timeout(raw, "WHICHDEVICE_PROBE_TIMEOUT")


_NO_LIMIT = ("inf", "+inf", "infinity", "none", "off", "0", "0.0")


def parse_timeout(raw: str, where: str) -> float:
    """A time limit in seconds from ``raw``: a positive number, or one of the no-limit words (inf)."""
    text = raw.strip().lower()
    if text in _NO_LIMIT:
        return math.inf
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # nan, negative, garbage
        raise DeviceError(
            f"{where}={shown(raw)} is not a time limit: give seconds as a number greater than 0 "
            f"(e.g. {where}=60), or {where}=inf for no limit; unset it for the default {DEFAULT_TIMEOUT_S:g} s"
        )
    return value


def set_probe_timeout(seconds: float | None) -> None:
    """Set the probe time limit for this process (None: back to the default; ``math.inf``: no limit)."""
    global _timeout_override
    _timeout_override = None if seconds is None else _seconds(seconds, "set_probe_timeout(seconds)")


def _seconds(value: Any, where: str) -> float:
    # bool is an int, and nan compares false with everything: both are refused here.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise DeviceError(
            f"{where} takes a number of seconds greater than 0 (math.inf for no limit), not {shown(value)}"
        )
    return float(value)
