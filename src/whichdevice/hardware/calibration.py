"""The CPU's calibration: its measured dtype speeds, cached on disk per machine, or pinned by a simulation.

``calibration()`` answers with the figures and a sentence saying where they came from. The
figures are measured by :mod:`whichdevice.hardware.probes.cpu_timing` (about 0.3 s) the first time a
resolution needs them, then read from ``$XDG_CACHE_HOME/whichdevice/`` (``~/.cache/whichdevice``),
one file per machine: CPU model, bf16 flags, cores, torch threads, torch version and oneDNN's ISA
cap, which is all the timing depends on. Nothing here runs on ``import whichdevice``; a damaged
or unreadable cache file is measured over, never raised. ``WHICHDEVICE_CALIBRATION=off`` turns
calibration off (the CPU flags decide, as without it); any other value is the folder of the cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from whichdevice.core import envview, progress
from whichdevice.core.dtypes import NAMES, short_name
from whichdevice.hardware.owned_files import NotOwnedError, not_owned, read_owned
from whichdevice.hardware.probes.cpu_facts import ONEDNN_ISA_VARIABLE, cpu_facts
from whichdevice.hardware.probes.locks import ForkSafeLock
from whichdevice.hardware.store import current_store

__all__ = [
    "ENV_CALIBRATION",
    "ENV_VARIABLES",
    "Calibration",
    "cache_path",
    "calibration",
    "calibration_enabled",
    "parse_figures",
    "pin",
    "render_calibration",
    "run_calibration",
]

ENV_CALIBRATION = "WHICHDEVICE_CALIBRATION"
ENV_VARIABLES = (ENV_CALIBRATION, "XDG_CACHE_HOME", ONEDNN_ISA_VARIABLE)
_OFF = frozenset({"0", "off", "no", "false", "none"})
_FORMAT = 1
# A calibration that a busy machine kept from being steady is measured again after this long.
RETRY_S = 6 * 3600


@dataclass(frozen=True)
class Calibration:
    """``speeds``: "bf16.b1" (a decode step at batch 1), "bf16.b2", "bf16.b4", "bf16.b8",
    "bf16.prompt" (a prompt-sized matmul), each bf16's speed over fp32's (above 1: faster), the
    same for fp16, and "bf16.attention"/"fp16.attention": a one-token attention by plain matmuls
    over torch's fused kernel. ``fp32``: seconds of an fp32 decode step per batch ("b1".."b8") and
    of one prompt row ("prompt"), which weigh prompt against decode."""

    speeds: Mapping[str, float]
    fp32: Mapping[str, float] = field(default_factory=dict)
    threads: int | None = None
    seconds: float | None = None  # what measuring took
    source: str = "measured"
    unsteady: tuple[str, ...] = ()  # figures other work on the machine kept moving: not to be relied on
    measured_at: float | None = None  # time.time() of the measurement

    def speed(self, dtype: str, shape: str) -> float | None:
        """``dtype``'s speed over fp32 at ``shape`` ("b1".."b8", "prompt", "attention"); None: not measured."""
        return self.speeds.get(f"{(short_name(dtype) if dtype in NAMES else dtype)}.{shape}")

    def summary(self) -> str:
        """One line: each half precision's figures, e.g. "bf16 decode 1.15x/1.02x/0.72x/0.55x (batch 1/2/4/8) ..."."""
        parts = []
        for short in ("bf16", "fp16"):
            decode = [self.speeds.get(f"{short}.b{b}") for b in (1, 2, 4, 8)]
            if any(v is None for v in decode):
                continue
            text = f"{short} decode {'/'.join(f'{v:.2f}x' for v in decode)} (batch 1/2/4/8)"  # type: ignore[str-format]
            prompt = self.speeds.get(f"{short}.prompt")
            if prompt is not None:
                text += f", prompt {prompt:.2f}x"
            attention = self.speeds.get(f"{short}.attention")
            if attention is not None:
                text += f", one-token attention by matmuls {attention:.2f}x fused sdpa"
            parts.append(text)
        return "; ".join(parts) + " of fp32" if parts else "no figures"

    def spec(self) -> str:
        """The figures as ``simulate("cpu,calib=...")`` takes them, so a report replays them."""
        entries = [f"{k}:{v:.4g}" for k, v in sorted(self.speeds.items())]
        return "/".join(entries + [f"fp32.{k}:{v:.4g}" for k, v in sorted(self.fp32.items())])

    def to_dict(self) -> dict[str, Any]:
        return {
            "speeds": {k: round(v, 4) for k, v in sorted(self.speeds.items())},
            "fp32_seconds": {k: v for k, v in sorted(self.fp32.items())},
            "threads": self.threads,
            "seconds": self.seconds,
            "source": self.source,
            "unsteady": list(self.unsteady),
        }


# fp32 step times used when a simulation gives speeds only: the shape of this machine's figures
# (2 cores, width 1024), relative to a batch-1 step. They only weigh prompt rows against steps.
DEFAULT_FP32 = {"b1": 1.0, "b2": 1.4, "b4": 1.6, "b8": 2.0, "prompt": 0.08}


# Plausible ranges of a figure read back (a cache file, a simulate() spec, a replayed report); a
# figure outside is damage or a typo, never a machine. A speed is a half precision's step time
# over fp32's: halving the bytes at most doubles a memory-bound step, and AMX or tensor-core matmuls
# run up to ~16x fp32, while bf16 emulated in software measures down to ~0.05x; 1/1000 to 1000 leaves
# two orders of magnitude beyond both. fp32 seconds of one step or prompt row are microseconds to
# seconds when measured, and relative (about 1) in a simulation: 1 ns to an hour.
SPEED_RANGE = (1e-3, 1e3)
SECONDS_RANGE = (1e-9, 3600.0)
_SHAPES = frozenset({"b1", "b2", "b4", "b8", "prompt", "attention"})


def check_figure(name: str, value: Any) -> float:
    """``value`` as the figure ``name`` ("bf16.b1", "fp32.prompt"), checked: a known name and a
    finite number within its plausible range. Raises ValueError naming the bad entry and the range.
    The one check for every figure read back: the cache, simulate()'s spec and a replayed report."""
    dtype, _, shape = name.partition(".")
    if dtype not in ("bf16", "fp16", "fp32") or shape not in _SHAPES:
        raise ValueError(
            f"{name!r}: a figure is dtype.shape with dtype bf16, fp16 or fp32 and shape one of "
            f"{', '.join(sorted(_SHAPES))}"
        )
    low, high = SECONDS_RANGE if dtype == "fp32" else SPEED_RANGE
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if number is None or not low <= number <= high:  # NaN fails every comparison, so it lands here
        what = "seconds" if dtype == "fp32" else "a speed over fp32"
        raise ValueError(f"{name}:{value!r} is not {what} from {low:g} to {high:g}")
    return float(number)


def parse_figures(text: str) -> Calibration:
    """A simulation's figures: "bf16.b1:1.15/bf16.b4:0.7/bf16.prompt:0.3" (speeds over fp32);
    "fp32.b1:..." entries give fp32 seconds. Raises ValueError naming the bad entry."""
    speeds: dict[str, float] = {}
    fp32 = dict(DEFAULT_FP32)
    form = "write dtype.shape:number, e.g. bf16.b1:1.15/bf16.prompt:0.3"
    for item in text.split("/"):
        name, sep, value = item.strip().partition(":")
        name = name.strip().lower()
        try:
            number = float(value) if sep else None
        except ValueError:
            number = None
        if number is None:
            raise ValueError(f"{item!r}: {form}, with dtype bf16, fp16 or fp32 and a positive number")
        try:
            number = check_figure(name, number)
        except ValueError as error:
            raise ValueError(f"{error}; {form}") from None
        if name.startswith("fp32."):
            fp32[name.removeprefix("fp32.")] = number
        else:
            speeds[name] = number
    return Calibration(speeds, fp32, source="simulated")


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
        threads, seconds, at = data.get("threads"), data.get("seconds"), data["measured_unix"]
        unsteady = tuple(data.get("unsteady", ()))
        if not (
            all(isinstance(u, str) and u in _SHAPES for u in unsteady)
            and (threads is None or (type(threads) is int and 0 < threads < 2**20))
            and (seconds is None or (type(seconds) in (int, float) and 0 <= seconds <= 3600))
            and type(at) in (int, float)
            and math.isfinite(at)
        ):
            raise ValueError("threads, seconds, unsteady or measured_unix out of form")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        return None, f"the cache file {path} is damaged ({error}): measured again"
    return Calibration(speeds, fp32, threads, seconds, f"cached in {path}", unsteady, float(at)), ""


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


def render_calibration(calib: Calibration) -> str:
    """``whichdevice calibrate``'s text: each dtype's speed over fp32 per shape, and where it went."""
    lines = [f"CPU calibration, {calib.threads} torch threads ({calib.source})", ""]
    shapes = ["b1", "b2", "b4", "b8", "prompt", "attention"]
    heads = ["decode b1", "decode b2", "decode b4", "decode b8", "prompt", "attention*"]
    lines.append(f"{'':6}" + "".join(f"{h:>12}" for h in heads))
    for short in ("bf16", "fp16"):
        cells = [_cell(calib.speeds.get(f"{short}.{s}")) for s in shapes]
        lines.append(f"{short:6}" + "".join(f"{c:>12}" for c in cells))
    lines += [
        "",
        "speed over fp32 at the same shape (above 1.00x: faster); decode bN: one step of a batch of N,",
        "prompt: a 128-row matmul; *attention: a one-token query by plain matmuls over torch's fused kernel",
    ]
    if calib.unsteady:
        lines.append(f"not steady: {', '.join(calib.unsteady)}; resolve_device() keeps to the CPU's flags")
    enabled, off = calibration_enabled()
    if not enabled:
        lines.append(f"{off}: resolve_device() keeps to the CPU's flags")
    return "\n".join(lines) + "\n"


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


@progress.working("timing the CPU's dtype speeds")
def run_calibration(budget_s: float | None = None, *, found: str = "") -> Calibration:
    """Measure this CPU now and rewrite its cache file (``whichdevice calibrate``); figures that
    other work kept moving are named in ``unsteady``, and such a calibration is cached only so that
    the next processes do not measure again before ``RETRY_S`` (they keep to the flags).
    ``found``: what was wrong with the cache file, said first in the source."""
    from whichdevice.hardware.probes.cpu_timing import BUDGET_S, measure

    key = _machine_key()
    path = cache_path(key)
    start = time.perf_counter()
    speeds, fp32, threads, unsteady = measure(BUDGET_S if budget_s is None else budget_s)
    seconds = round(time.perf_counter() - start, 3)
    enabled, off = calibration_enabled()
    calib = Calibration(speeds, fp32, threads, seconds, "measured now", tuple(unsteady), time.time())
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


# Per store (the real machine's, each simulation's): the answer, keyed by the variables it read.
_answers: weakref.WeakKeyDictionary[Any, tuple[Any, tuple[Calibration | None, str]]] = weakref.WeakKeyDictionary()
_pinned: weakref.WeakKeyDictionary[Any, tuple[Calibration | None, str]] = weakref.WeakKeyDictionary()
_lock = ForkSafeLock()


def pin(store: Any, calib: Calibration | None, why: str) -> None:
    """A simulation's answer: its spec's figures, or none (the simulated CPU's flags decide)."""
    _pinned[store] = (calib, why)


def _variables() -> tuple[str | None, ...]:
    # Through envview, as every reading here: while resolve_device() resolves, the one reading its
    # memo key was built from, so a thread that changes WHICHDEVICE_CALIBRATION meanwhile cannot
    # file an answer for one value under the key of another.
    env = envview.environ()
    return (env.get(ENV_CALIBRATION), env.get(ONEDNN_ISA_VARIABLE), env.get("XDG_CACHE_HOME"))


def _answer(calib: Calibration) -> tuple[Calibration | None, str]:
    if not calib.unsteady:
        return calib, calib.source
    again = "run `whichdevice calibrate` when it is quieter"
    return None, f"this CPU could not be timed steadily ({calib.source}); {again}"


def _remember(calib: Calibration) -> None:
    with _lock:
        _answers[current_store()] = (_variables(), _answer(calib))


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
    if measure and (calib is None or (calib.unsteady and time.time() - (calib.measured_at or 0) > RETRY_S)):
        calib = run_calibration(found=found)
    if calib is None:
        return None, f"{found + '; ' if found else ''}this CPU is not calibrated yet: run `whichdevice calibrate`"
    answer = _answer(calib)
    with _lock:
        _answers[store] = (_variables(), answer)
    return answer
