"""Environment set-up hooks and scoped variables: set only what is unset, record it, restore the rest."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from whichdevice.core.records import Backend, EnvAction

__all__ = ["EnvAction", "applied_env", "apply_env_defaults", "release_scopes", "scoped_env"]


_lock = threading.Lock()
# Variables whichdevice itself set in this process, so a resolution can list them and an
# idempotent second call can tell "ours" from "the user's".
_applied: dict[str, str] = {}
# Variables inside an open scoped_env: name -> (value before the first scope, open scopes).
_scoped: dict[str, tuple[str | None, int]] = {}
# Each open scoped_env block: token -> (the thread that opened it, its names).
_open: dict[object, tuple[int | None, tuple[str, ...]]] = {}


def _after_fork_in_child() -> None:
    # A fork taken while another thread held the lock would leave the child waiting forever.
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def applied_env() -> dict[str, str]:
    """Every variable whichdevice's hooks set in this process, name -> value."""
    with _lock:
        return dict(_applied)


def _forget(name: str) -> None:
    with _lock:
        _applied.pop(name, None)


def apply_env_defaults(backend: Backend, stage: str) -> tuple[EnvAction, ...]:
    """Run ``backend``'s hooks for ``stage`` ("import" or "select"); never overwrite a user's value."""
    actions: list[EnvAction] = []
    for default in backend.env_defaults:
        if default.stage != stage:
            continue
        with _lock:
            current = os.environ.get(default.name)
            if current is None:
                os.environ[default.name] = default.value
                _applied[default.name] = default.value
                actions.append(
                    EnvAction(
                        default.name,
                        default.value,
                        "set",
                        f"set {default.name}={default.value} ({default.why})",
                    )
                )
            elif _applied.get(default.name) == current:
                actions.append(
                    EnvAction(
                        default.name,
                        current,
                        "set",
                        f"set {default.name}={current} ({default.why})",
                    )
                )
            elif current != default.value:
                actions.append(
                    EnvAction(
                        default.name,
                        current,
                        "kept",
                        f"kept your {default.name}={current}; {backend.name} wants "
                        f"{default.name}={default.value} because {default.why}",
                    )
                )
    return tuple(actions)


@contextmanager
def scoped_env(**values: str) -> Iterator[None]:
    """Set variables for the duration of a block, then restore each old value, "unset" included.

    Used around calls like ``torch.cuda.device_count()`` that read a switch from the environment
    (``PYTORCH_NVML_BASED_CUDA_CHECK``); clobbering the user's own value was accelerate PR #2524.
    A block in a thread that is given up on (a probe past its time limit) is closed early by
    :func:`release_scopes`, so a hung call does not leave the switch set.
    """
    # Scopes can overlap across threads (a timed-out probe still runs while a refresh starts a new
    # one), so the value from before the first open scope is kept and restored when the last closes.
    token = object()
    with _lock:
        for name, value in values.items():
            before, depth = _scoped.get(name, (os.environ.get(name), 0))
            _scoped[name] = (before, depth + 1)
            os.environ[name] = value
        _open[token] = (threading.get_ident(), tuple(values))
    try:
        yield
    finally:
        with _lock:
            if _open.pop(token, None) is not None:
                _close(tuple(values))


def _close(names: tuple[str, ...]) -> None:
    for name in names:
        before, depth = _scoped[name]
        if depth > 1:
            _scoped[name] = (before, depth - 1)
            continue
        del _scoped[name]
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def release_scopes(thread: threading.Thread) -> list[str]:
    """Close every scoped_env block ``thread`` has open (it was given up on); the names restored."""
    restored: list[str] = []
    with _lock:
        for token, (ident, names) in list(_open.items()):
            if ident == thread.ident:
                del _open[token]
                _close(names)
                restored.extend(names)
    return restored
