"""The imports this process must not wait on: what hung or crashed here, remembered for the process.

A vendor package whose import hung (in a probe thread that was given up) or that killed its trial
child (:mod:`whichdevice.hardware.probes.trial`) is remembered here by its top-level module, with the
reason; :mod:`whichdevice.hardware.probes.outcomes` turns that into reasons and errors. Every probe asks
here first, so this is kept apart from the trial's child-process machinery, which a machine without a
vendor package or a torch plugin never imports.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from whichdevice.hardware.probes.locks import ForkSafeLock

# typing costs several ms to import; mypy and ruff treat a module-level TYPE_CHECKING = False the same.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from whichdevice.core.records import Backend

__all__ = [
    "HUNG",
    "bad_imports",
    "forget_bad_imports",
    "half_imported",
    "passed",
    "refused",
    "remember_bad_import",
    "top_module",
    "tried",
    "vendor_modules",
]

# The words of every reason for an import that hung (as opposed to one that crashed).
HUNG = "did not finish"

# Top-level module -> the reason it must not be imported here (it hung or crashed).
_bad: dict[str, str] = {}
# Top-level module -> the verdict of its trial ("" when it imported fine), for this process.
_tried: dict[str, str] = {}
_lock = ForkSafeLock()


def tried(module: str) -> bool:
    """Whether ``module`` had its trial in this process (it is not tried again)."""
    with _lock:
        return module in _tried


def passed(modules: Iterable[str]) -> None:
    """``modules`` imported fine in a trial."""
    with _lock:
        for module in modules:
            _tried.setdefault(module, "")


def refused(module: str, reason: str) -> None:
    """``module`` hung or crashed its trial: it is not imported here, for ``reason``."""
    with _lock:
        _tried[module] = reason
        _bad.setdefault(module, reason)


def remember_bad_import(modules: Iterable[str], reason: str) -> None:
    """Remember that importing ``modules`` was given up (a probe thread still holds their lock)."""
    with _lock:
        for module in modules:
            _bad.setdefault(module.split(".")[0], reason)


def half_imported() -> list[str]:
    """Modules whose import started and has not finished (a given-up probe thread holds their lock)."""
    return [
        name
        for name, module in list(sys.modules.items())
        if getattr(getattr(module, "__spec__", None), "_initializing", False) and not name.startswith("whichdevice")
    ]


def bad_imports() -> dict[str, str]:
    """Top-level module -> why this process does not import it (it hung or crashed)."""
    with _lock:
        return dict(_bad)


def forget_bad_imports() -> None:
    """Forget every verdict (tests; a process that fixed its installation and wants to retry)."""
    with _lock:
        _bad.clear()
        _tried.clear()


def top_module(value: str) -> str:
    """The top-level module of an entry point's value ("pkg.mod:attr" -> "pkg")."""
    return value.split(":")[0].split(".")[0]


def vendor_modules(rows: Iterable[Backend]) -> list[str]:
    """The top-level module of each row whose vendor package (not torch itself) is installed and not
    imported yet: what a trial must try before this process imports it."""
    from importlib.util import find_spec

    found: list[str] = []
    for row in rows:
        top = row.module.split(".")[0]
        if top == "torch" or top in sys.modules or top in found:
            continue
        try:
            if find_spec(top) is None:
                continue
        except (ImportError, ValueError):
            continue
        found.append(top)
    return found
