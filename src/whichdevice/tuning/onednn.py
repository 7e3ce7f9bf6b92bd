"""torch's global oneDNN switch while one-row forwards run: one owner for the process, a count under a lock.

``torch.backends.mkldnn.enabled`` is a single, process-wide switch. The single-row tuning turns it
off for forward passes of one token row, and several models, threads and nested forwards may do so
at once. Saving and restoring it per forward left it off for good when two threads interleaved (the
second put back the "off" the first had set) and when Ctrl-C skipped the restore. So the first
holder turns it off and keeps the user's setting, later holders only count, and the last to let go
puts the user's setting back, on any exit (``finally``: exceptions, KeyboardInterrupt, SystemExit).
A switch the user turned off is never held: it stays off. If the switch is found on when the last
holder lets go, the user turned it on meanwhile, and theirs stays.

A forked child has only the thread that forked: the holders it inherits from other threads never let
go there, and a lock another thread held stays held for good. So a child starts afresh: no holders,
a new lock, and the switch as the user had it (on, since only an "on" is ever held). A hold the
forking thread itself was in ends in the child without counting (its ``epoch`` is the parent's).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["holders", "onednn_off"]

_lock = threading.Lock()  # a forked child gets a new one (_afresh_in_child)
_holders = [0]
# Which process's count a hold belongs to: a forked child starts a new one.
_epoch = [0]


def _switch() -> Any:
    import torch

    # torch types the attribute as the descriptor it is; reached through Any to set it.
    switch: Any = torch.backends.mkldnn
    return switch


def holders() -> int:
    """How many one-row forwards hold oneDNN off now (0: the switch is the user's)."""
    return _holders[0]


@contextmanager
def onednn_off() -> Iterator[bool]:
    """oneDNN off for the block; yields whether this block holds it (False: the user had it off)."""
    switch = _switch()
    held, epoch = False, -1
    try:
        with _lock:
            epoch = _epoch[0]
            if _holders[0] == 0:
                if switch.enabled:  # held only from "on": the user's "off" is theirs
                    switch.enabled = False
                    _holders[0], held = 1, True
            else:
                _holders[0], held = _holders[0] + 1, True
        yield held
    finally:
        if held:
            with _lock:
                # A hold from before a fork, ending in the child: the child's count started afresh.
                if epoch == _epoch[0]:
                    _holders[0] -= 1
                    if _holders[0] == 0 and not switch.enabled:
                        switch.enabled = True


def _afresh_in_child() -> None:
    global _lock  # the one lock of the process, renewed where a fork may have left it held
    _lock = threading.Lock()
    if _holders[0]:
        _holders[0] = 0
        _switch().enabled = True  # only an "on" is held: the user's setting
    _epoch[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_afresh_in_child)
