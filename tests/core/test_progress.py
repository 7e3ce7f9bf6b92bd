"""Progress on long work: slow steps logged at INFO and shown on a sink after a second, fast ones never shown."""

from __future__ import annotations

import io
import logging
import os
import threading
import time

import pytest

from whichdevice.core import progress
from whichdevice.core.progress import showing, terminal_sink, working


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> float:
    """A shorter wait before a step shows, so the tests do not sleep for seconds."""
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.05)
    return 0.05


def test_a_fast_step_is_logged_and_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    told: list[str | None] = []
    threads = threading.active_count()
    with caplog.at_level(logging.INFO, logger="whichdevice"), showing(told.append), working("reading a file"):
        pass
    assert told == []
    assert threading.active_count() == threads  # the timer of a step that ended does not linger
    [record] = [r for r in caplog.records if r.name == "whichdevice"]
    assert record.levelno == logging.INFO and record.getMessage().startswith("reading a file: done in ")


def test_a_slow_step_shows_after_the_wait_and_is_cleared(quick: float) -> None:
    told: list[str | None] = []
    threads = threading.active_count()
    with showing(told.append), working("probing cuda"):
        time.sleep(quick * 6)
        assert told == ["probing cuda"]
    assert told == ["probing cuda", None]
    assert threading.active_count() == threads


def test_nested_steps_show_the_innermost_then_the_outer_again(quick: float) -> None:
    told: list[str | None] = []
    with showing(told.append), working("resolving"):
        time.sleep(quick * 4)
        with working("importing torch"):
            time.sleep(quick * 4)
        assert told == ["resolving", "importing torch", "resolving"]
    assert told[-1] is None


def test_without_a_sink_no_thread_starts(quick: float) -> None:
    threads = threading.active_count()
    with working("probing cpu"):
        assert threading.active_count() == threads


def test_a_sink_that_fails_costs_only_the_line(quick: float) -> None:
    def broken(what: str | None) -> None:
        raise OSError("the terminal went away")

    with showing(broken), working("probing cpu"):
        time.sleep(quick * 4)


def test_the_terminal_line_is_escaped_and_cleared() -> None:
    stream = io.StringIO()
    sink = terminal_sink(stream)
    sink("reading /models/\x1b[2Jevil")
    sink(None)
    text = stream.getvalue()
    assert text.startswith("\r\x1b[Kwhichdevice: reading /models/")
    assert "\x1b[2J" not in text and text.endswith("\r\x1b[K")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_inside_a_step_runs_its_own_steps(quick: float) -> None:
    told: list[str | None] = []
    with showing(told.append), working("outer"):
        pid = os.fork()
        if pid == 0:  # the child: the parent's lock and steps are not its own
            try:
                with working("in the child"):
                    pass
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_api_logs_probing_and_calibration_at_info(caplog: pytest.LogCaptureFixture) -> None:
    from whichdevice.hardware import probing
    from whichdevice.measure.calibration import run_calibration

    probing.clear_cache()
    with caplog.at_level(logging.INFO, logger="whichdevice"):
        probing.probe("cpu")
        run_calibration(budget_s=0.2)
    said = [r.getMessage() for r in caplog.records if r.name == "whichdevice" and r.levelno == logging.INFO]
    assert any(m.startswith("probing cpu: done in ") for m in said), said
    assert any(m.startswith("timing the CPU's dtype speeds: done in ") for m in said), said


def test_a_step_known_to_be_slow_shows_at_once() -> None:
    """Issue 46: importing torch is most of a first call's seconds; it shows from its start, not after
    SHOW_AFTER_S, so the terminal is never silent while it runs."""
    told: list[str | None] = []
    with showing(told.append), working("importing torch", at_once=True):
        deadline = time.monotonic() + progress.SHOW_AFTER_S / 2
        while not told and time.monotonic() < deadline:
            time.sleep(0.01)
        assert told == ["importing torch"]
    assert told == ["importing torch", None]
