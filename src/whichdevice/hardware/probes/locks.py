"""A module-level lock that survives fork: the probes' per-process state is read from threads."""

from __future__ import annotations

import os
import threading


class ForkSafeLock:
    """A module's lock that a forked child gets fresh: a fork taken while another thread held it
    would otherwise leave the child waiting forever (the calibration cache, the trial verdicts)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._renew)

    def _renew(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> ForkSafeLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
