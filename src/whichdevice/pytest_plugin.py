"""pytest plugin: the ``simulated_hardware`` fixture (loaded through the ``pytest11`` entry point)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from whichdevice.testing import simulate


@pytest.fixture
def simulated_hardware() -> Iterator[Callable[..., simulate]]:
    """Call it with spec strings (``simulated_hardware("hpu:8")``); undone when the test ends."""
    active: list[simulate] = []

    def start(*specs: str, others: str = "absent") -> simulate:
        sim = simulate(*specs, others=others)
        sim.__enter__()
        active.append(sim)
        return sim

    yield start
    for sim in reversed(active):
        sim.__exit__(None, None, None)
