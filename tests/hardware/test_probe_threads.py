"""Probe threads: reused while their calls finish, given up on (never reused) when one hangs, and
fresh in a forked child."""

from __future__ import annotations

import os
import threading

import pytest

from whichdevice.hardware import probe_threads
from whichdevice.hardware.probe_threads import run_bounded


def _where(seen: list[threading.Thread]) -> None:
    seen.append(threading.current_thread())


def test_a_finished_call_gives_its_thread_back_for_the_next():
    seen: list[threading.Thread] = []
    assert run_bounded(lambda: _where(seen), "first", 5.0) is None
    assert run_bounded(lambda: _where(seen), "second", 5.0) is None
    assert seen[0] is seen[1] and seen[0] is not threading.current_thread()
    assert seen[0].daemon and seen[0].name == "whichdevice-probe"


def test_a_hung_call_is_given_up_on_and_its_thread_never_reused():
    release, finished = threading.Event(), threading.Event()
    names: list[str] = []

    def hang() -> None:
        names.append(threading.current_thread().name)
        release.wait(10)
        finished.set()

    hung = run_bounded(hang, "musa", 0.05)
    try:
        assert hung is not None and hung.is_alive() and names == ["whichdevice-probe-musa"]
        seen: list[threading.Thread] = []
        assert run_bounded(lambda: _where(seen), "cpu", 5.0) is None
        assert seen[0] is not hung
        assert all(worker.thread is not hung for worker in probe_threads._idle)
    finally:
        release.set()
    assert hung is not None
    hung.join(10)  # a given-up thread ends once its call returns
    assert finished.is_set() and not hung.is_alive()
    assert all(worker.thread is not hung for worker in probe_threads._idle)


def test_a_call_that_raises_does_not_kill_the_thread():
    def boom() -> None:
        raise SystemExit(3)

    assert run_bounded(boom, "boom", 5.0) is None
    seen: list[threading.Thread] = []
    assert run_bounded(lambda: _where(seen), "after", 5.0) is None
    assert seen and seen[0].is_alive()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_thread():
    assert run_bounded(lambda: None, "parent", 5.0) is None
    assert probe_threads._idle  # the parent keeps an idle thread the child does not have
    pid = os.fork()
    if pid == 0:  # the child: the parent's idle thread does not exist here
        ok = run_bounded(lambda: None, "child", 5.0) is None
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
