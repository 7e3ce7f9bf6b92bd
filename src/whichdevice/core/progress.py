"""Progress on long work: each slow step logged at INFO, and shown on the command's terminal after a second.

A slow step (probing a backend, timing the CPU, reading a model) runs inside ``working(what)``. When
it ends, the ``whichdevice`` logger says so at INFO with its duration, so a program sees it with
``logging.basicConfig(level=logging.INFO)``. A sink installed with ``showing(sink)`` (the command's
terminal, the smoke test's progress line) is told ``what`` once the step has run for ``SHOW_AFTER_S``
seconds, and told ``None`` when it ends, so fast steps never show. Nothing else runs here: no sink,
no timer thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

__all__ = ["LOGGER", "SHOW_AFTER_S", "Sink", "showing", "terminal_sink", "working"]

# The logger every whichdevice message goes through (children: "whichdevice.<folder>").
LOGGER = logging.getLogger("whichdevice")

# A step shorter than this never shows: a line that flashes and vanishes helps nobody.
SHOW_AFTER_S = 1.0

# Told what is running (a short phrase) once it has run for SHOW_AFTER_S, and None when it ended.
Sink = Callable[[str | None], None]


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sink: Sink | None = None
        self.active: list[_Step] = []  # innermost last; only steps begun while a sink was installed
        self.shown: _Step | None = None


class _Step:
    def __init__(self, what: str, state: _State, after: float) -> None:
        self.what = what
        self.pid = os.getpid()
        self.due = False  # ran past ``after`` seconds
        self.timer = threading.Timer(after, _due, (state, self))
        self.timer.daemon = True  # a step left running by an abandoned thread must not hold the exit


_state = _State()


def _after_fork_in_child() -> None:
    # The parent's lock may be held by a thread that does not exist here, and its steps are not ours.
    global _state
    sink = _state.sink
    _state = _State()
    _state.sink = sink


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def working(what: str, *, at_once: bool = False) -> Iterator[None]:
    """The block is a step that may be slow: logged at INFO when done, shown on a sink after a second,
    or at once for a step known to take seconds (importing torch or transformers: most of a first
    call's time, before anything else could be shown)."""
    start = time.perf_counter()
    state = _state
    step = _begin(state, what, 0.0 if at_once else SHOW_AFTER_S) if state.sink is not None else None
    try:
        yield
    finally:
        if step is not None:
            _end(state, step)
        LOGGER.info("%s: done in %.2f s", what, time.perf_counter() - start)


def _begin(state: _State, what: str, after: float) -> _Step:
    step = _Step(what, state, after)
    with state.lock:
        state.active.append(step)
    step.timer.start()
    return step


def _due(state: _State, step: _Step) -> None:
    with state.lock:
        if step not in state.active:
            return
        step.due = True
        _redraw(state)


def _end(state: _State, step: _Step) -> None:
    if step.pid != os.getpid():
        return  # begun before a fork: the child has a fresh state, and that timer lives in the parent
    step.timer.cancel()
    with state.lock:
        if step in state.active:
            state.active.remove(step)
        _redraw(state)
    step.timer.join()  # cancelled: it ends at once, and no thread outlives the step


def _redraw(state: _State) -> None:
    """Show the innermost step that ran past its second (or nothing); called under the lock."""
    due = next((s for s in reversed(state.active) if s.due), None)
    if due is state.shown or state.sink is None:
        return
    state.shown = due
    with contextlib.suppress(Exception):  # a sink that fails (a closed terminal) costs the line only
        state.sink(due.what if due is not None else None)


@contextlib.contextmanager
def showing(sink: Sink | None) -> Iterator[None]:
    """Steps that run past ``SHOW_AFTER_S`` inside the block are shown on ``sink`` (None: nowhere)."""
    state = _state
    with state.lock:
        before, state.sink = state.sink, sink
        shown, state.shown = state.shown, None
    try:
        yield
    finally:
        with state.lock:
            if state.shown is not None and state.sink is not None:
                with contextlib.suppress(Exception):
                    state.sink(None)
            state.sink, state.shown = before, shown


def terminal_sink(stream: TextIO, prefix: str = "whichdevice") -> Sink:
    """A sink that writes ``prefix: what ...`` on one terminal line and clears it when the step ends."""
    from whichdevice.core.errors import printable

    def sink(what: str | None) -> None:
        # What is shown may quote a model's path or a plugin's name: escaped, one line.
        text = "\r\x1b[K" if what is None else f"\r\x1b[K{prefix}: {printable(what)} ..."
        stream.write(text)
        stream.flush()

    return sink
