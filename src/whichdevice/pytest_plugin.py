"""pytest plugin: the ``simulated_hardware`` fixture (loaded through the ``pytest11`` entry point)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import pytest

from whichdevice.testing import simulate


@pytest.fixture
def simulated_hardware() -> Iterator[Callable[..., simulate]]:
    """Call it with spec strings (``simulated_hardware("hpu:8")``); undone when the test ends.

    It takes ``simulate``'s keywords too: ``simulated_hardware("hpu:8", packages={"accelerate": "1.4.0"})``.
    """
    active: list[simulate] = []

    def start(*specs: str, others: str = "absent", packages: Mapping[str, str | None] | None = None) -> simulate:
        sim = simulate(*specs, others=others, packages=packages)
        sim.__enter__()
        active.append(sim)
        return sim

    yield start
    for sim in reversed(active):
        sim.__exit__(None, None, None)
