"""Hostile inputs (issue 16, classes 2-5): configuration values, damaged model files, arguments of
the wrong shape, and the memo under threads. Each table row is an input and the DeviceError whose
text names the fix; the thread tests use real threads."""

from __future__ import annotations

import os
import threading
import time

import pytest

import whichdevice as wd
from whichdevice import resolver, testing
from whichdevice.errors import DeviceError
from whichdevice.testing import simulate


@pytest.fixture(autouse=True)
def _no_device_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WHICHDEVICE_DEVICE", raising=False)


def check(error: pytest.ExceptionInfo[BaseException], kind: type[DeviceError], says: tuple[str, ...]) -> None:
    assert isinstance(error.value, kind), f"{type(error.value).__name__}: {error.value}"
    for fragment in says:
        assert fragment in str(error.value), f"{fragment!r} not in {str(error.value)!r}"


# ----------------------------------------------------------------------------- class 5: the memo


def test_a_change_made_while_resolving_is_not_stored_under_the_old_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another thread changes WHICHDEVICE_DEVICE between the key and the resolution: the answer
    # follows the reading the key was made from, and the next call sees the new value.
    real = resolver.read_request

    def changed_meanwhile(device: object) -> object:
        os.environ["WHICHDEVICE_DEVICE"] = "cuda:1"
        return real(device)

    monkeypatch.setenv("WHICHDEVICE_DEVICE", "cuda:0")
    with simulate("cuda:2"):
        monkeypatch.setattr(resolver, "read_request", changed_meanwhile)
        assert wd.resolve_device().device == "cuda:0"
        monkeypatch.setattr(resolver, "read_request", real)
        assert wd.resolve_device().device == "cuda:1"
        monkeypatch.setenv("WHICHDEVICE_DEVICE", "cuda:0")
        assert wd.resolve_device().device == "cuda:0"


def test_threads_changing_the_variable_never_poison_the_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    stop = threading.Event()
    wrong: list[str] = []

    def flip() -> None:
        while not stop.is_set():
            for value in ("cuda:0", "cuda:1", "cpu"):
                os.environ["WHICHDEVICE_DEVICE"] = value

    def ask() -> None:
        for _ in range(300):
            res = wd.resolve_device()
            if res.source == "WHICHDEVICE_DEVICE" and res.device not in ("cuda:0", "cuda:1", "cpu"):
                wrong.append(res.device)

    monkeypatch.setenv("WHICHDEVICE_DEVICE", "cpu")
    with simulate("cuda:2"):
        threads = [threading.Thread(target=flip), *(threading.Thread(target=ask) for _ in range(2))]
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join()
        stop.set()
        threads[0].join()
        assert not wrong
        # Quiet again: every value answers with its own device, whatever was stored during the storm.
        for value in ("cuda:0", "cuda:1", "cpu", "cuda:0"):
            monkeypatch.setenv("WHICHDEVICE_DEVICE", value)
            res = wd.resolve_device()
            assert res.device == value
            assert any(f"WHICHDEVICE_DEVICE={value!r}" in step.message for step in res.trace)


def test_a_simulation_is_seen_by_threads_started_inside_it() -> None:
    seen: list[str] = []
    with simulate("cuda:2"):
        t = threading.Thread(target=lambda: seen.append(wd.resolve_device().device))
        t.start()
        t.join()
    assert seen == ["cuda:0"]
    assert wd.resolve_device().backend.name != "cuda"


def test_simulations_in_two_threads_take_turns() -> None:
    # A simulation is per process: the second thread's waits for the first one's to end, so each
    # thread sees its own machine throughout.
    answers: dict[str, list[str]] = {"hpu:8": [], "cuda:4": []}
    entered = threading.Event()

    def run(spec: str) -> None:
        with simulate(spec):
            entered.set()
            for _ in range(5):
                answers[spec].append(wd.resolve_device().backend.name)
                time.sleep(0.01)

    first = threading.Thread(target=run, args=("hpu:8",))
    first.start()
    entered.wait()
    second = threading.Thread(target=run, args=("cuda:4",))
    second.start()
    first.join()
    second.join()
    assert answers == {"hpu:8": ["hpu"] * 5, "cuda:4": ["cuda"] * 5}


def test_a_simulation_held_too_long_by_another_thread_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testing, "WAIT_S", 0.2)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with simulate("hpu:1"):
                pass
        except DeviceError as exc:
            errors.append(exc)

    with simulate("cuda:1"):
        t = threading.Thread(target=other, name="second")
        t.start()
        t.join()
        assert wd.resolve_device().backend.name == "cuda"
    assert len(errors) == 1
    assert "per process" in str(errors[0]) and "one thread at a time" in str(errors[0])
    with simulate("hpu:1"):  # free again
        assert wd.resolve_device().backend.name == "hpu"


def test_nested_simulations_in_one_thread_still_nest() -> None:
    with simulate("cuda:1"):
        with simulate("hpu:2"):
            assert wd.resolve_device().backend.name == "hpu"
        assert wd.resolve_device().backend.name == "cuda"
