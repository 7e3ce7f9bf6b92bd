"""Risky imports tried first in a child process, and the imports this process must not wait on.

A vendor package (torch_npu, habana_frameworks, a ``torch.backends`` plugin that ``import torch``
autoloads) can hang in its driver or abort the whole process (SIGABRT, SIGSEGV). Before such a
package is imported here, :func:`trial_imports` imports it in a fresh interpreter with the probe
time limit: a step that hangs is killed, a step that kills its process becomes a one-line reason
naming the package and the signal, and this process never imports it. Packages that pass are
imported here as before. Nothing of this runs when no such package is installed.

A module that hung or crashed (in the trial, or in a probe thread that was given up) is remembered
(:func:`bad_imports`); :mod:`whichdevice.hardware.probes.outcomes` turns that into reasons and errors.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from whichdevice.core.entry_points import AUTOLOAD_VARIABLE, TORCH_GROUP
from whichdevice.core.frozen import frozen_record
from whichdevice.core.records import Backend
from whichdevice.hardware.probes.verdicts import (
    HUNG,
    bad_imports,
    forget_bad_imports,
    half_imported,
    passed,
    refused,
    remember_bad_import,
    top_module,
    tried,
    vendor_modules,
)

# The verdicts (HUNG, bad_imports, ...) live in probes/verdicts.py, which every probe asks; they are
# named here as before.
__all__ = [
    "AUTOLOAD_VARIABLE",
    "HUNG",
    "Step",
    "bad_imports",
    "forget_bad_imports",
    "half_imported",
    "remember_bad_import",
    "risky_modules",
    "top_module",
    "trial_imports",
]

# torch imports every entry point of this group on ``import torch`` unless AUTOLOAD_VARIABLE is not "1".
TORCH_PLUGIN_GROUP = TORCH_GROUP
# ``import torch`` itself (its plugins switched off) is not the vendor part the limit is for: a cold
# disk takes seconds. It still has a bound, so that a trial always ends.
TORCH_IMPORT_ALLOWANCE_S = 120.0


@frozen_record
class Step:
    """One import to try: ``module`` (a dotted name) or an entry point ``group``/``name``."""

    label: str  # the module to import ("habana_frameworks.torch"), or what a plugin is called
    module: str  # the top-level module it imports (what a later import would wait on)
    entry_point: tuple[str, str] | None = None


# The module a reader imports where it is not the registry row's own (the row names the package).
_READER_IMPORTS = {"habana_frameworks": "habana_frameworks.torch"}

_CHILD = r"""
import importlib, json, os, sys
if sys.platform.startswith("linux"):
    # Die with the parent (PR_SET_PDEATHSIG = 1): a parent ended by SIGTERM while a vendor import
    # hangs here must not leave this child running, and it leads its own session, out of reach.
    try:
        import ctypes, signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass
    if os.getppid() != int(sys.argv[1]):  # the parent died before the call above
        os._exit(1)
spec = json.loads(sys.stdin.readline())
sys.path[:] = spec["path"]
proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr
def say(**kw):
    proto.write(json.dumps(kw) + "\n")
    proto.flush()
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
say(start="torch")
try:
    import torch
except BaseException as exc:
    say(error="torch", text=f"{type(exc).__name__}: {exc}")
say(done="torch")
del os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"]
for label, module, ep in spec["steps"]:
    say(start=label)
    try:
        if ep is None:
            importlib.import_module(label)
        else:
            from importlib.metadata import entry_points
            for found in entry_points(group=ep[0]):
                if found.name == ep[1]:
                    loaded = found.load()
                    if ep[0] == "torch.backends":
                        loaded()
    except BaseException as exc:
        say(error=label, text=f"{type(exc).__name__}: {exc}")
    say(done=label)
"""


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _limit_text(seconds: float) -> str:
    return f"{seconds:g} s"


def trial_imports(steps: Sequence[Step], timeout: float) -> dict[str, str]:
    """Import ``steps`` in child processes, in order; module -> reason for each that hung or crashed.

    A step that hangs past ``timeout`` seconds (``math.inf``: no limit) or kills its process is
    recorded (:func:`bad_imports`) and the steps after it are tried in a fresh child. Steps tried
    before in this process are not tried again.
    """
    todo = [s for s in steps if not tried(s.module)]
    while todo:
        stopped_at, reason = _run_child(todo, timeout)
        passed(step.module for step in todo[: stopped_at if stopped_at is not None else len(todo)])
        if stopped_at is None:
            break
        refused(todo[stopped_at].module, reason)
        todo = todo[stopped_at + 1 :]
    bad = bad_imports()
    return {s.module: bad[s.module] for s in steps if s.module in bad}


@dataclass
class _Watch:
    """What the parent saw of one child: the step started last, the last one done, its stderr."""

    labels: list[str]
    current: int = -1  # index into labels (0 is torch itself); -1: none started yet
    finished: int = -1
    err_tail: bytes = b""
    buffer: bytes = b""

    def all_done(self) -> bool:
        return self.finished == len(self.labels) - 1

    def step_index(self) -> int:
        return min(max(self.current, self.finished + 1), len(self.labels) - 1)

    def read(self, message: dict[str, Any], timeout: float) -> float | None:
        """Note a protocol message; the new deadline it sets, if any."""
        if "start" in message:
            self.current = self.labels.index(message["start"])
            return time.monotonic() + (TORCH_IMPORT_ALLOWANCE_S if self.current == 0 else timeout)
        if "done" in message:
            self.finished = self.labels.index(message["done"])
            return time.monotonic() + max(timeout, 10.0)  # to start the next step
        return None


def _start_child(steps: Sequence[Step]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != AUTOLOAD_VARIABLE},
        start_new_session=True,
    )
    spec = {"path": sys.path, "steps": [(s.label, s.module, s.entry_point) for s in steps]}
    assert proc.stdin is not None
    try:
        proc.stdin.write((json.dumps(spec) + "\n").encode())
        proc.stdin.close()
    except OSError:
        pass  # the child died at once: its exit status says how
    return proc


def _watch(proc: subprocess.Popen[bytes], watch: _Watch, timeout: float) -> bool:
    """Follow the child until every step is done, it exits, or a step overruns; True when it overran."""
    assert proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + max(timeout, TORCH_IMPORT_ALLOWANCE_S)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        open_streams = 2
        while open_streams and not watch.all_done():
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            for key, _ in sel.select(None if math.isinf(left) else left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                elif key.fileobj is proc.stderr:
                    watch.err_tail = (watch.err_tail + chunk)[-4000:]
                else:
                    watch.buffer += chunk
                    while b"\n" in watch.buffer:
                        line, watch.buffer = watch.buffer.split(b"\n", 1)
                        deadline = watch.read(json.loads(line), timeout) or deadline
    return False


def _run_child(steps: Sequence[Step], timeout: float) -> tuple[int | None, str]:
    """Run one child over ``steps``: (index of the step that hung or crashed, its reason), or (None, "")."""
    proc = _start_child(steps)
    watch = _Watch(["torch", *(s.label for s in steps)])
    try:
        overran = _watch(proc, watch, timeout)
        if watch.all_done() or overran:
            _kill(proc)  # done: the child's own exit is not waited for; overran: it hangs
        code = proc.wait()
    finally:
        if proc.poll() is None:
            _kill(proc)  # interrupted (Ctrl-C): the child leads its own session, so it goes too
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    if watch.all_done():
        return None, ""
    index = watch.step_index()
    what = watch.labels[index]
    if overran:
        limit = TORCH_IMPORT_ALLOWANCE_S if index == 0 else timeout
        return _blame(steps, index, f"importing {what} {HUNG} within {_limit_text(limit)}")
    how = f"killed the process with {_signal_name(code)}" if code < 0 else f"ended the process (exit code {code})"
    last = watch.err_tail.decode(errors="replace").strip().splitlines()
    said = f" after printing {last[-1][:160]!r}" if last else ""
    return _blame(steps, index, f"importing {what} {how}{said}")


def _blame(steps: Sequence[Step], step_index: int, what: str) -> tuple[int | None, str]:
    if step_index == 0:
        # torch itself (plugins off) failed in the child: nothing vendor-specific to blame; the
        # in-process import says what is wrong, as before.
        return None, ""
    index = min(step_index, len(steps)) - 1
    return index, f"{what} (tried in a child process first; whichdevice did not import it here)"


def _kill(proc: subprocess.Popen[bytes]) -> None:
    # The child leads its own session: a vendor import that forked helpers goes with it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    proc.wait()


def risky_modules(rows: Iterable[Backend]) -> list[Step]:
    """One step per backend whose vendor package (not torch itself) is installed and not imported."""
    return [Step(_READER_IMPORTS.get(top, top), top) for top in vendor_modules(rows)]
