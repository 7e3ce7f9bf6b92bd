"""Loading ``whichdevice.backends`` plugins, and what went wrong, said with the package and the fix.

A plugin that does not load (it raises, calls ``sys.exit``, gives something that is not a
:class:`~whichdevice.core.records.Backend`, or a record with a name no device string can reach) must
not break detection, and must not vanish either: its problem is kept here, named by the
distribution that installed the entry point, and the report lists it under WARNINGS. The registry
also remembers which distribution registered each plugin backend, so a probe of it that returns
nonsense names the package to upgrade or remove instead of "a bug".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from whichdevice.core.errors import printable
from whichdevice.core.packages import pip_install

__all__ = [
    "distribution_of",
    "forget",
    "load",
    "plugin_problems",
    "record",
    "registered_by",
    "remember_source",
    "set_plugin_loader",
]

_lock = threading.Lock()
_problems: dict[str, str] = {}
_sources: dict[str, str] = {}


def _load_plugin(ep: Any) -> Any:
    return ep.load()


# How a plugin's entry point is loaded: the probe layer swaps in one bounded by the probe time limit
# (a plugin whose import hangs must not block every other backend).
_plugin_loader: list[Callable[[Any], Any]] = [_load_plugin]


def set_plugin_loader(loader: Callable[[Any], Any]) -> None:
    """Load ``whichdevice.backends`` entry points with ``loader(ep)`` (the probe layer's, time-limited)."""
    _plugin_loader[0] = loader


def load(ep: Any) -> Any:
    """What entry point ``ep`` names, loaded by the current loader."""
    return _plugin_loader[0](ep)


def distribution_of(ep: Any) -> str | None:
    """The distribution (pip name) that installed entry point ``ep``; None when it cannot be told."""
    dist = getattr(ep, "dist", None)
    name = getattr(getattr(dist, "metadata", None), "get", lambda _key: None)("Name") if dist is not None else None
    if isinstance(name, str) and name:
        return name
    from importlib.metadata import packages_distributions

    top = str(getattr(ep, "value", "")).split(":", 1)[0].split(".", 1)[0]
    names = packages_distributions().get(top) or []
    return names[0] if names else None


def fix_for(distribution: str | None, what: str) -> str:
    """What to do about a plugin of ``distribution`` that misbehaved: upgrade it, or uninstall it."""
    if distribution is None:
        return f"find the package that installs {what} (pip show -f) and upgrade or uninstall it"
    import shlex  # a misbehaving plugin's message only

    return (
        f"upgrade it ({pip_install('--upgrade', distribution)}) or report it to its authors; "
        f"until then uninstall it ({shlex.join(['pip', 'uninstall', distribution])}) "
        "and whichdevice detects without it"
    )


def record(ep: Any, error: BaseException) -> str:
    """Keep (and return) the problem of entry point ``ep``, which failed to load with ``error``."""
    what = f"the whichdevice plugin {ep.name!r} ({ep.value})"
    distribution = distribution_of(ep)
    source = f" from the package {distribution!r}" if distribution else ""
    if isinstance(error, SystemExit):
        happened = f"called sys.exit({error.code!r}) while loading"
    else:
        happened = f"failed to load ({type(error).__name__}: {error})"
    message = printable(f"{what}{source} {happened}; it is left out: {fix_for(distribution, what)}")
    with _lock:
        _problems[str(ep.name)] = message
    return message


def remember_source(backend: str, ep: Any) -> None:
    """Backend ``backend`` was registered by entry point ``ep``."""
    distribution = distribution_of(ep)
    if distribution:
        with _lock:
            _sources[backend] = distribution


def registered_by(backend: str) -> str | None:
    """The distribution whose entry point registered ``backend`` (None: built in, or register_backend())."""
    with _lock:
        return _sources.get(backend)


def plugin_problems() -> dict[str, str]:
    """Every plugin that did not load: entry-point name -> what happened and what to do."""
    with _lock:
        return dict(_problems)


def forget() -> None:
    """Forget every problem and source (the registry's reset)."""
    with _lock:
        _problems.clear()
        _sources.clear()
