"""Shared fixtures: no test may leak environment variables, and every test starts from real probes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from whichdevice import probing, registry

pytest_plugins = ["pytester"]  # test_testing.py runs the simulated_hardware fixture in a session

# pytest rewrites PYTEST_CURRENT_TEST around every test phase; torch's inductor exports its cache
# directory the first time a model module asks for it. Neither is whichdevice's doing.
_IGNORED = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


@pytest.fixture(autouse=True)
def _no_environment_leaks() -> Iterator[None]:
    """Fail a test that leaves os.environ changed (use monkeypatch.setenv/delenv instead)."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = sorted(
        f"{name}: {before.get(name)!r} -> {after.get(name)!r}"
        for name in (before.keys() | after.keys()) - _IGNORED
        if before.get(name) != after.get(name)
    )
    if changed:
        pytest.fail("the test left os.environ changed:\n  " + "\n  ".join(changed), pytrace=False)


@pytest.fixture(autouse=True)
def _fresh_probes_and_registry() -> Iterator[None]:
    """Probe for real from scratch in each test; undo registry and timeout changes afterwards."""
    probing.clear_cache()
    yield
    probing.set_probe_timeout(None)
    registry._reset()
