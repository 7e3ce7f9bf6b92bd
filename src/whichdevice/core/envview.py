"""The environment a resolution reads: ``os.environ``, or the snapshot its memo key was taken from.

resolve_device() reads the variables of its memo key once, builds the key from them, and pins that
one reading for the thread while it resolves: every reader on the resolve path asks :func:`environ`,
so another thread that changes ``WHICHDEVICE_DEVICE`` halfway through cannot give an answer that
belongs to one environment under the key of another.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping

__all__ = ["ENV_VARIABLES", "environ", "pinned"]

# Reads no variable of its own: it hands over the readings of the modules that declare them.
ENV_VARIABLES: tuple[str, ...] = ()

_local = threading.local()


def environ() -> Mapping[str, str]:
    """The pinned snapshot while this thread resolves, else ``os.environ``."""
    env: Mapping[str, str] | None = getattr(_local, "env", None)
    return os.environ if env is None else env


@contextlib.contextmanager
def pinned(env: Mapping[str, str]) -> Iterator[None]:
    """Readers in this thread see ``env`` (and only it) until the block ends."""
    before = getattr(_local, "env", None)
    _local.env = env
    try:
        yield
    finally:
        _local.env = before
