"""The threads probes run on: kept between probes, so a probe costs no thread start, and given up when one hangs.

A probe runs in a thread of its own so that a hung driver or vendor import can be given up on after
its time limit. Starting a thread is not free: measured on a 2-vCPU VM, ``Thread.start`` + ``join``
of an empty function took 0.1-4.1 ms (often 3.7 ms: waking the other vCPU for a new thread), and
ten probes spent about 20 of their 30 ms there, a third of what ``resolve_device()`` took after
``import torch`` (64-71 ms). Handing a call to a thread that already runs took 0.02-0.04 ms.

So an idle thread is reused: ``run_bounded`` hands the call to one (starting one only when none is
idle), waits up to the limit, and puts the thread back only when the call finished. A thread whose
call is still running is left to it, never reused, and ends when (if ever) the call returns; the
next probe gets another. Each thread is named after the backend it runs
(``whichdevice-probe-<name>``) while it runs it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable

__all__ = ["run_bounded"]

_idle: list[_ProbeThread] = []
_lock = threading.Lock()


class _ProbeThread:
    """A daemon thread that runs the calls handed to it one after another, forever."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.given_up = False
        self.thread = threading.Thread(target=self._loop, name="whichdevice-probe", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            call = self.calls.get()
            # The calls catch their own exceptions; this thread must outlive a stray one all the same.
            with contextlib.suppress(BaseException):
                call()
            with _lock:
                if self.given_up:  # its caller stopped waiting: nobody hands it another call
                    return


def run_bounded(call: Callable[[], None], name: str, limit: float | None) -> threading.Thread | None:
    """Run ``call`` (which must not raise) on a probe thread named ``whichdevice-probe-<name>``,
    waiting at most ``limit`` seconds (None: no limit). Returns None when it finished, or the
    thread still running it, which is given up on (for ``release_scopes`` and the caller's message)."""
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = _ProbeThread()
    done = threading.Event()

    def job() -> None:
        worker.thread.name = f"whichdevice-probe-{name}"
        try:
            call()
        finally:
            done.set()

    worker.calls.put(job)
    finished = done.wait(limit)
    with _lock:
        # Decided under the lock the thread checks after each call: either it is given up on and
        # ends when (if ever) the call returns, or the call finished and the thread is idle again.
        if not finished and not done.is_set():
            worker.given_up = True
            return worker.thread
        worker.thread.name = "whichdevice-probe"
        _idle.append(worker)
    return None


def _after_fork_in_child() -> None:
    # The child has none of the parent's threads: an idle one handed a call would never run it.
    global _lock
    _lock = threading.Lock()
    _idle.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
