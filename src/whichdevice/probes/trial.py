"""Risky imports tried first in a child process, and the imports this process must not wait on.

A vendor package (torch_npu, habana_frameworks, a ``torch.backends`` plugin that ``import torch``
autoloads) can hang in its driver or abort the whole process (SIGABRT, SIGSEGV). Before such a
package is imported here, :func:`trial_imports` imports it in a fresh interpreter with the probe
time limit: a step that hangs is killed, a step that kills its process becomes a one-line reason
naming the package and the signal, and this process never imports it. Packages that pass are
imported here as before. Nothing of this runs when no such package is installed.

A module that hung or crashed (in the trial, or in a probe thread that was given up) is remembered:
:func:`raise_if_import_hung` turns a later call that would import it (transformers and accelerate
import every vendor package they find) into a :class:`~whichdevice.errors.DeviceError` naming the
backend, instead of a process waiting forever on the abandoned import's lock.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from whichdevice.envhooks import scoped_env
from whichdevice.errors import DeviceError
from whichdevice.records import Backend
from whichdevice.registry import ENTRY_POINT_GROUP

__all__ = [
    "TORCH_PLUGIN_GROUP",
    "Step",
    "bad_imports",
    "environment_changes",
    "forget_bad_imports",
    "import_torch",
    "load_plugin",
    "raise_if_import_hung",
    "remember_bad_import",
    "risky_modules",
    "trial_imports",
]

# torch imports every entry point of this group on ``import torch`` (unless this variable is "0").
TORCH_PLUGIN_GROUP = "torch.backends"
AUTOLOAD_VARIABLE = "TORCH_DEVICE_BACKEND_AUTOLOAD"
# ``import torch`` itself (its plugins switched off) is not the vendor part the limit is for: a cold
# disk takes seconds. It still has a bound, so that a trial always ends.
TORCH_IMPORT_ALLOWANCE_S = 120.0


@dataclass(frozen=True)
class Step:
    """One import to try: ``module`` (a dotted name) or an entry point ``group``/``name``."""

    label: str  # what the reason calls it: "torch_npu", "torch.backends plugin 'npu'"
    module: str  # the top-level module it imports (what a later import would wait on)
    entry_point: tuple[str, str] | None = None


# The module a reader imports where it is not the registry row's own (the row names the package).
_READER_IMPORTS = {"habana_frameworks": "habana_frameworks.torch"}

# The words of every reason for an import that hung (as opposed to one that crashed).
_HUNG = "did not finish"

# Top-level module -> the reason it must not be imported here (it hung or crashed).
_bad: dict[str, str] = {}
# Top-level module -> the verdict of its trial ("" when it imported fine), for this process.
_tried: dict[str, str] = {}
_lock = threading.Lock()

_CHILD = r"""
import importlib, json, os, sys
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
            importlib.import_module(module)
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
    with _lock:
        todo = [s for s in steps if s.module not in _tried]
    while todo:
        stopped_at, reason = _run_child(todo, timeout)
        with _lock:
            for step in todo[: stopped_at if stopped_at is not None else len(todo)]:
                _tried.setdefault(step.module, "")
            if stopped_at is None:
                break
            step = todo[stopped_at]
            _tried[step.module] = reason
            _bad.setdefault(step.module, reason)
        todo = todo[stopped_at + 1 :]
    with _lock:
        return {s.module: _bad[s.module] for s in steps if s.module in _bad}


def _run_child(steps: Sequence[Step], timeout: float) -> tuple[int | None, str]:
    """Run one child over ``steps``: (index of the step that hung or crashed, its reason), or (None, "")."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if k != AUTOLOAD_VARIABLE},
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    spec = {"path": sys.path, "steps": [(s.label, s.module, s.entry_point) for s in steps]}
    try:
        proc.stdin.write((json.dumps(spec) + "\n").encode())
        proc.stdin.close()
    except OSError:
        pass
    labels = ["torch", *(s.label for s in steps)]
    current = -1  # index into labels of the step that started last (-1: none yet)
    finished = -1
    err_tail = b""
    buffer = b""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + max(timeout, TORCH_IMPORT_ALLOWANCE_S)
    open_streams = 2
    try:
        while open_streams:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(None if math.isinf(left) else left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                if key.fileobj is proc.stderr:
                    err_tail = (err_tail + chunk)[-4000:]
                    continue
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    message = json.loads(line)
                    if "start" in message:
                        current = labels.index(message["start"])
                        budget = TORCH_IMPORT_ALLOWANCE_S if current == 0 else timeout
                        deadline = time.monotonic() + budget
                    elif "done" in message:
                        finished = labels.index(message["done"])
                        deadline = time.monotonic() + max(timeout, 10.0)  # to start the next step
            if finished == len(labels) - 1:
                break  # every step imported; the child's own exit is not waited for
        if finished == len(labels) - 1:
            _kill(proc)
            return None, ""
        if open_streams:
            # Past the deadline: the step that started last is the one that hangs.
            _kill(proc)
            step_index = max(current, finished + 1)
            limit = TORCH_IMPORT_ALLOWANCE_S if step_index == 0 else timeout
            what = labels[step_index] if step_index < len(labels) else labels[-1]
            return _blame(steps, step_index, f"importing {what} did not finish within {_limit_text(limit)}")
        code = proc.wait()
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    if finished >= len(labels) - 1:
        return None, ""
    step_index = max(current, finished + 1)
    what = labels[min(step_index, len(labels) - 1)]
    how = f"killed the process with {_signal_name(code)}" if code < 0 else f"ended the process (exit code {code})"
    last = err_tail.decode(errors="replace").strip().splitlines()
    said = f" after printing {last[-1][:160]!r}" if last else ""
    return _blame(steps, step_index, f"importing {what} {how}{said}")


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


def remember_bad_import(modules: Iterable[str], reason: str) -> None:
    """Remember that importing ``modules`` was given up (a probe thread still holds their lock)."""
    with _lock:
        for module in modules:
            _bad.setdefault(module.split(".")[0], reason)


def bad_imports() -> dict[str, str]:
    """Top-level module -> why this process does not import it (it hung or crashed)."""
    with _lock:
        return dict(_bad)


def forget_bad_imports() -> None:
    """Forget every verdict (tests; a process that fixed its installation and wants to retry)."""
    with _lock:
        _bad.clear()
        _tried.clear()


def _still_blocking(module: str) -> bool:
    loaded = sys.modules.get(module)
    if loaded is None:
        return True  # never imported here: the next import would hang or crash as the trial did
    spec = getattr(loaded, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def raise_if_import_hung(what: str) -> None:
    """Raise a DeviceError when ``what`` (a call that imports transformers) would hang on a bad import."""
    with _lock:
        blocking = {m: r for m, r in _bad.items() if _still_blocking(m)}
    if not blocking:
        return
    module, reason = next(iter(blocking.items()))
    slow = ", or raise WHICHDEVICE_PROBE_TIMEOUT if its import is just slow" if _HUNG in reason else ""
    fate = "wait forever" if _HUNG in reason else "fail the same way"
    raise DeviceError(
        f"{what} cannot run in this process: {reason}. transformers and accelerate import {module} "
        f"whenever it is installed, so this would {fate}. Fix or uninstall the package "
        f"(pip uninstall {module.replace('_', '-')}){slow}"
    )


def environment_changes(before: Mapping[str, str], after: Mapping[str, str], ignore: Iterable[str] = ()) -> list[str]:
    """``set X``, ``changed X``, ``unset X`` for each variable that differs (values are not shown:
    they can hold secrets)."""
    skip = set(ignore)
    out = []
    for name in sorted(set(before) | set(after)):
        if name in skip or before.get(name) == after.get(name):
            continue
        verb = "set" if name not in before else "unset" if name not in after else "changed"
        out.append(f"{verb} {name}")
    return out


def _top(value: str) -> str:
    """The top-level module of an entry point's value ("pkg.mod:attr" -> "pkg")."""
    return value.split(":")[0].split(".")[0]


def risky_modules(rows: Iterable[Backend]) -> list[Step]:
    """One step per backend whose vendor package (not torch itself) is installed and not imported."""
    from importlib.util import find_spec

    steps: list[Step] = []
    for row in rows:
        top = row.module.split(".")[0]
        if top == "torch" or top in sys.modules or any(s.module == top for s in steps):
            continue
        try:
            if find_spec(top) is None:
                continue
        except (ImportError, ValueError):
            continue
        steps.append(Step(top, top) if top not in _READER_IMPORTS else Step(_READER_IMPORTS[top], top))
    return steps


def torch_plugins() -> list[Step]:
    """The ``torch.backends`` entry points ``import torch`` would load (none when autoload is off)."""
    if os.environ.get(AUTOLOAD_VARIABLE, "1") != "1":
        return []
    from importlib.metadata import entry_points

    return [
        Step(f"{TORCH_PLUGIN_GROUP} plugin {ep.name!r} ({ep.value})", _top(ep.value), (TORCH_PLUGIN_GROUP, ep.name))
        for ep in entry_points(group=TORCH_PLUGIN_GROUP)
    ]


def import_torch(timeout: float) -> list[str]:
    """``import torch`` with its autoloaded plugins each bounded by ``timeout``; warnings to report.

    Without plugins this is a plain ``import torch``. With them, each plugin is tried in a child
    while torch is imported here with autoload off; plugins that passed are then loaded here as
    torch would have, each in a thread with the limit.
    """
    if "torch" in sys.modules:
        return []
    plugins = torch_plugins()
    if not plugins:
        import torch

        return []
    tried = threading.Thread(target=trial_imports, args=(plugins, timeout), daemon=True)
    tried.start()
    before = dict(os.environ)
    with scoped_env(**{AUTOLOAD_VARIABLE: "0"}):
        import torch  # noqa: F401
    tried.join()
    warnings = []
    for step in plugins:
        if step.module in bad_imports():
            warnings.append(f"torch's {step.label}: {bad_imports()[step.module]}")
            continue
        problem = _load_in_thread(step, timeout)
        if problem:
            warnings.append(f"torch's {step.label} {problem}")
    changed = environment_changes(before, dict(os.environ))
    if changed:
        warnings.append(f"importing torch and its plugins changed the environment: {', '.join(changed)}")
    return warnings


def _load_in_thread(step: Step, timeout: float) -> str:
    from importlib.metadata import entry_points

    box: dict[str, BaseException] = {}

    def load() -> None:
        try:
            for ep in entry_points(group=TORCH_PLUGIN_GROUP):
                if (TORCH_PLUGIN_GROUP, ep.name) == step.entry_point:
                    ep.load()()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=load, name=f"whichdevice-plugin-{step.module}", daemon=True)
    thread.start()
    thread.join(None if math.isinf(timeout) else timeout)
    if thread.is_alive():
        reason = f"importing {step.label} did not finish within {_limit_text(timeout)}"
        remember_bad_import([step.module], reason)
        return f"did not finish loading within {_limit_text(timeout)}; whichdevice gave up on it"
    if "error" in box:
        exc = box["error"]
        return f"failed to load ({type(exc).__name__}: {exc}); torch itself would refuse to import"
    return ""


def load_plugin(ep: Any, timeout: float) -> Any:
    """Load a ``whichdevice.backends`` entry point, once every plugin has been tried in a child."""
    from importlib.metadata import entry_points

    steps = [
        Step(f"whichdevice plugin {e.name!r} ({e.value})", _top(e.value), (ENTRY_POINT_GROUP, e.name))
        for e in entry_points(group=ENTRY_POINT_GROUP)
    ]
    bad = trial_imports(steps, timeout)
    top = _top(ep.value)
    if top in bad:
        raise RuntimeError(bad[top])
    return ep.load()
