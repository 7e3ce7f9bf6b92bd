"""The CPU's calibration: its measured dtype speeds, cached on disk per machine, or pinned by a simulation.

``calibration()`` answers with the figures and a sentence saying where they came from. The
figures are measured by :mod:`whichdevice.measure.cpu_timing` and ``cpu_memory`` (about
0.9 s on 2 cores: shapes that run from the cache, and decode steps whose weights stream from
memory) the first time a resolution needs them, then read from ``$XDG_CACHE_HOME/whichdevice/``
(``~/.cache/whichdevice``), one file per machine: CPU model, bf16 flags, cores, torch threads,
torch version and oneDNN's ISA cap, which is all the timing depends on. Nothing here runs on
``import whichdevice``; a damaged or unreadable cache file is measured over, never raised.
``WHICHDEVICE_CALIBRATION=off`` turns calibration off (the CPU flags decide, as without it); any
other value is the folder of the cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import tempfile
import time
import weakref
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from whichdevice.core import envview, progress
from whichdevice.core.limits import limit_hit
from whichdevice.hardware.owned_files import NotOwnedError, not_owned, read_owned
from whichdevice.hardware.probes.cpu_facts import ONEDNN_ISA_VARIABLE, cpu_facts
from whichdevice.hardware.probes.locks import ForkSafeLock
from whichdevice.hardware.store import current_store
from whichdevice.measure.figures import Calibration, check_figure, parse_figures

__all__ = [
    "ENV_CALIBRATION",
    "ENV_VARIABLES",
    "UNSTEADY",
    "Calibration",
    "cache_path",
    "calibration",
    "calibration_enabled",
    "parse_figures",
    "pin",
    "run_calibration",
]

ENV_CALIBRATION = "WHICHDEVICE_CALIBRATION"
# The reason a calibration is not used at all on a busy machine (the report names it once).
UNSTEADY = "other work on this machine kept this CPU from being timed steadily"
ENV_VARIABLES = (ENV_CALIBRATION, "XDG_CACHE_HOME", ONEDNN_ISA_VARIABLE)
_OFF = frozenset({"0", "off", "no", "false", "none"})
# 3: the narrow set's figures (sn1, gn1); 4: the grouped-query attention's (gqa); 5: the packed
# prompt's (pp); 6: the prompt computed in fp32 from bf16 weights (up). A cache of another format is
# another machine's key.
_FORMAT = 6
# Measurements added at once after one with a hiccup (see run_calibration).
HICCUP_RETRIES = 2
# A calibration that a busy machine kept from being steady is measured again at the next call that
# finds the machine quieter (its 1-minute load below QUIETER times the load it was measured at, or
# below half the cores), at least RETRY_S after it: a node that stays busy pays nothing more, and
# one that quietens is measured again within minutes. After RETRY_MAX_S it is measured again anyway.
RETRY_S = 60.0
RETRY_MAX_S = 6 * 3600
QUIETER = 0.7
# Where the load average says the machine is at least half busy, a calibration whose threads ran
# less than this share of its wall time (others took the cores) is not used (see run_calibration).
BUSY_SHARE = 0.7
# Where the load average is at least the core count, only a calibration whose threads ran this
# share of its wall time or more is used: a quiet machine's measured 0.93-0.97 here.
QUIET_SHARE = 0.9


def calibration_enabled() -> tuple[bool, str]:
    value = envview.environ().get(ENV_CALIBRATION, "")
    if value.strip().lower() in _OFF:
        return False, f"{ENV_CALIBRATION}={value} turns calibration off"
    return True, ""


def _cache_dir() -> Path:
    env = envview.environ()
    value = env.get(ENV_CALIBRATION, "").strip()
    if value:
        return Path(value).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "whichdevice"


def _machine_key() -> dict[str, Any]:
    from whichdevice.core.packages import package_version
    from whichdevice.hardware.probes.plugins import import_torch
    from whichdevice.hardware.store import probe_timeout

    # The calibration may be the first to import torch (`whichdevice check cpu`): through the same
    # guarded import as a probe, so a torch.backends plugin that hangs cannot hang it.
    import_torch(probe_timeout())
    import torch

    name, flags, _ = cpu_facts()
    return {
        "format": _FORMAT,
        "cpu": name,
        "machine": platform.machine(),
        "bf16_flags": sorted(flags),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": package_version("torch") or torch.__version__,
        ONEDNN_ISA_VARIABLE: envview.environ().get(ONEDNN_ISA_VARIABLE),
    }


def cache_path(key: Mapping[str, Any] | None = None) -> Path:
    """The cache file for this machine (or for ``key``)."""
    key = _machine_key() if key is None else key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return _cache_dir() / f"cpu-calibration-{digest}.json"


def _read(path: Path, key: Mapping[str, Any]) -> tuple[Calibration | None, str]:
    """The cached calibration, or None and what was wrong with the file ("" when there is none, or
    it is another machine's): every figure is checked, as a simulation's are."""
    try:
        data = json.loads(read_owned(path).decode("utf-8"))
    except FileNotFoundError:
        return None, ""
    except NotOwnedError as error:
        return None, f"{error}: not trusted, not read"
    except (OSError, ValueError, RecursionError) as error:
        return None, f"the cache file {path} cannot be read ({type(error).__name__}): measured again"
    try:
        if data["key"] != dict(key):
            return None, ""
        speeds = {str(k): check_figure(str(k), v) for k, v in data["speeds"].items()}
        fp32 = {str(k): check_figure(f"fp32.{k}", v) for k, v in data["fp32_seconds"].items()}
        memory = {str(k): check_figure(f"mem.{k}", v) for k, v in data.get("memory", {}).items()}
        threads, seconds, at = data.get("threads"), data.get("seconds"), data["measured_unix"]
        load = data.get("load")
        unsteady = tuple(data.get("unsteady", ()))
        if not (
            all(isinstance(u, str) and re.fullmatch(r"[a-z0-9 ().,%]{1,80}", u) for u in unsteady)
            and (threads is None or (type(threads) is int and 0 < threads < 2**20))
            and (seconds is None or (type(seconds) in (int, float) and 0 <= seconds <= 3600))
            and type(at) in (int, float)
            and math.isfinite(at)
            and (load is None or (type(load) in (int, float) and 0 <= load < 1e6))
        ):
            raise ValueError("threads, seconds, unsteady, load or measured_unix out of form")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return None, f"the cache file {path} is damaged ({error}): measured again"
    source = f"cached in {path}"
    if unsteady:
        source += f"; other work on this machine kept these from being timed steadily: {', '.join(unsteady)}"
    return Calibration(speeds, fp32, memory, threads, seconds, source, unsteady, float(at), load), ""


def _write(path: Path, key: Mapping[str, Any], calib: Calibration) -> str | None:
    """Write atomically (a temporary file renamed over the old one); the error text, or None. Never
    through a link, nor into a folder or over a file of another user's."""
    problem = not_owned(path)
    if problem is not None:
        return f"not cached: {problem}, so nothing is written through it"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(calib.measured_at))
        data = {"key": dict(key), **calib.to_dict(), "measured_at": stamp, "measured_unix": calib.measured_at}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=1)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as error:
        return f"not cached ({error})"
    return None


@progress.working("timing the CPU's dtype speeds")
def run_calibration(budget_s: float | None = None, *, found: str = "") -> Calibration:
    """Measure this CPU now and rewrite its cache file (``whichdevice calibrate``); figures that
    other work kept moving are named in ``unsteady``, and such a calibration is cached only so that
    the next processes do not measure again before ``RETRY_S`` (they keep to the flags).
    ``found``: what was wrong with the cache file, said first in the source."""
    import torch  # noqa: F401 - imported before the clocks start: an import is one thread's work

    from whichdevice.measure.cpu_timing import BUDGET_S, measure

    key = _machine_key()
    path = cache_path(key)
    start, load, used = time.perf_counter(), _load(), _cpu_seconds()
    figures = measure(BUDGET_S if budget_s is None else budget_s)
    for _ in range(HICCUP_RETRIES):
        # A hiccup (one shape moved, every part finished in time): measured again at once. Measured
        # here, 3 of 10 fresh calibrations on a quiet machine had one, and 1 of 10 still had one
        # after a single retry; a machine busy enough to run a part out of time is not measured again.
        if not figures.unsteady or any("out of time" in name for name in figures.unsteady):
            break
        again = measure(BUDGET_S if budget_s is None else budget_s)
        figures = again if len(again.unsteady) <= len(figures.unsteady) else figures
    seconds = round(time.perf_counter() - start, 3)
    share = (_cpu_seconds() - used) / max(seconds * figures.threads, 1e-9)
    figures = figures._replace(unsteady=[*figures.unsteady, *_busy(load, share)])
    enabled, off = calibration_enabled()
    calib = Calibration(
        figures.speeds,
        figures.fp32,
        figures.memory,
        figures.threads,
        seconds,
        "measured now",
        tuple(figures.unsteady),
        time.time(),
        _load(),
    )
    unsteady = figures.unsteady
    if not enabled:
        source = f"measured now in {seconds:.2f} s, not cached: {off}"
    else:
        problem = _write(path, key, calib)
        source = f"measured now in {seconds:.2f} s, {problem or f'cached in {path}'}"
    if found:
        source = f"{found}; {source}"
    if unsteady:
        source += f"; other work on this machine kept these from being timed steadily: {', '.join(unsteady)}"
    calib = replace(calib, source=source)
    _remember(calib)
    return calib


def _busy(load: float | None, share: float) -> list[str]:
    """Why no figure of this run is kept as the machine's (empty: they may be), from the load
    average when it started and the share of its threads' wall time they ran."""
    cores = os.cpu_count() or 1
    ran = f", its threads ran {share:.0%} of the time"
    if load is not None and load >= cores and share < QUIET_SHARE:
        # Other work already filled every core: torch's threads then wait on each other at every
        # barrier, and whole kernels (oneDNN's bf16 ones measured 0.09x fp32 at load 3 on 2 cores)
        # read as hopeless while looking steady. Such figures are not kept as this machine's. A
        # run whose threads had the cores anyway (the load of work that ended within the minute,
        # or of work at a lower priority) is kept: measured here 0.93-0.97 of the time at a
        # trailing load of 2 on 2 cores, and 0.91-0.96 beside two busy processes at nice 19.
        return [f"all (load {load:.1f} on {cores} cores{ran})"]
    if load is not None and load >= cores / 2 and share < BUSY_SHARE:
        # The load average trails by a minute: work that started just before reads as half of it.
        # The threads' own CPU time does not trail: measured here, 0.95 of their wall time on a
        # quiet 2-core machine, 0.79-0.85 beside two busy processes at a lower priority, about half
        # at the same one; one run at load 1.93 used half-steady figures the other nine did not.
        return [f"all (load {load:.1f} on {cores} cores{ran})"]
    return []


# Per store (the real machine's, each simulation's): the answer, keyed by the variables it read.
_answers: weakref.WeakKeyDictionary[Any, tuple[Any, tuple[Calibration | None, str]]] = weakref.WeakKeyDictionary()
_pinned: weakref.WeakKeyDictionary[Any, tuple[Calibration | None, str]] = weakref.WeakKeyDictionary()
_lock = ForkSafeLock()


def pin(store: Any, calib: Calibration | None, why: str) -> None:
    """A simulation's answer: its spec's figures, or none (the simulated CPU's flags decide)."""
    _pinned[store] = (calib, why)


def unpin(store: Any) -> None:
    """Take back what :func:`pin` answered for ``store`` (the real machine's, pinned by a comparison)."""
    _pinned.pop(store, None)


def _variables() -> tuple[str | None, ...]:
    # Through envview, as every reading here: while resolve_device() resolves, the one reading its
    # memo key was built from, so a thread that changes WHICHDEVICE_CALIBRATION meanwhile cannot
    # file an answer for one value under the key of another.
    env = envview.environ()
    return (env.get(ENV_CALIBRATION), env.get(ONEDNN_ISA_VARIABLE), env.get("XDG_CACHE_HOME"))


def _answer(calib: Calibration) -> tuple[Calibration | None, str]:
    """The figures to use and why. Where only some figures moved (one shape of a quiet machine's
    run), the rest are used and the jobs that need a moved one follow the flags: measured here, 1 of
    10 fresh quiet calibrations lost one shape, and dropping every figure for it took the batch-1
    single-row switch from jobs that never read the shape that moved."""
    if not calib.unsteady:
        return calib, calib.source
    # Nothing to ask of the user (a shared node stays busy): it is measured again on its own (_retry).
    if calib.whole_unsteady():
        return None, f"{UNSTEADY}; it is measured again once the machine is quieter"
    # The source names the figures that moved (measured now or read from the cache).
    return calib.steady_part(), f"{calib.source}; those are not used, and jobs that need them follow the flags"


def _remember(calib: Calibration) -> None:
    with _lock:
        _answers[current_store()] = (_variables(), _answer(calib))


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process, all its threads."""
    times = os.times()
    return times.user + times.system


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # no load average on this system
        return None


def _retry(calib: Calibration) -> bool:
    """Whether an unsteady calibration is measured again now: the machine is quieter than it was
    (see ``QUIETER``), or it is older than ``RETRY_MAX_S``."""
    if not calib.unsteady:
        return False
    age = time.time() - (calib.measured_at or 0)
    if age > RETRY_MAX_S:
        return True
    now, cores = _load(), os.cpu_count() or 1
    if age < RETRY_S or now is None:
        return False
    return now < cores / 2 or (calib.load is not None and now < calib.load * QUIETER)


def calibration(measure: bool = True) -> tuple[Calibration | None, str]:
    """This CPU's figures and where they came from, or None and why not (calibration off, or
    ``measure=False`` with no cache). Measures and caches them when needed and allowed."""
    store = current_store()
    if store in _pinned:
        return _pinned[store]
    enabled, why = calibration_enabled()
    if not enabled:
        return None, why
    with _lock:
        known = _answers.get(store)
        if known is not None and known[0] == _variables():
            return known[1]
        key = _machine_key()
        path = cache_path(key)
        calib, found = _read(path, key)
    if measure and (calib is None or _retry(calib)):
        try:
            calib = run_calibration(found=found)
        except (MemoryError, RuntimeError, OSError) as error:
            limit = limit_hit(error)
            if limit is None:
                raise
            # A memory limit (ulimit -v) stops the timing's tensors: the flags decide, nothing is cached,
            # and the answer is remembered so that the line is said once, not measured into again.
            answer: tuple[Calibration | None, str] = (None, f"the calibration could not run: {limit}")
            with _lock:
                _answers[store] = (_variables(), answer)
            return answer
    if calib is None:
        return None, f"{found + '; ' if found else ''}this CPU is not calibrated yet: run `whichdevice calibrate`"
    answer = _answer(calib)
    with _lock:
        _answers[store] = (_variables(), answer)
    return answer
