"""What a trial or a given-up probe leaves to say: the reason, the error for later calls, the
environment a vendor changed.

A module that hung or crashed is remembered (:func:`whichdevice.hardware.probes.verdicts.bad_imports`):
:func:`raise_if_import_hung` turns a later call that would import it (transformers and accelerate
import every vendor package they find) into a :class:`~whichdevice.core.errors.DeviceError` naming the
package, instead of a process waiting forever on the abandoned import's lock.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from whichdevice.core.errors import DeviceError
from whichdevice.core.records import Backend, ProbeResult
from whichdevice.hardware.envhooks import applied_env
from whichdevice.hardware.probes.verdicts import HUNG, bad_imports

__all__ = [
    "changes_since",
    "environment_changes",
    "environment_snapshot",
    "gave_up_reason",
    "raise_if_import_hung",
    "with_notes",
]

# os.environ's backing dict of bytes: copying it costs a thousandth of dict(os.environ), which
# decodes every entry (a snapshot is taken around every probe).
_RAW_ENV: Any = getattr(os.environ, "_data", None) if os.name == "posix" else None


def environment_snapshot() -> dict[Any, Any]:
    """The environment now, cheaply (compare it later with :func:`changes_since`)."""
    return dict(_RAW_ENV) if _RAW_ENV is not None else dict(os.environ)


def changes_since(before: Mapping[Any, Any], ignore: Iterable[str] = ()) -> list[str]:
    """:func:`environment_changes` from an :func:`environment_snapshot` to now."""
    after = environment_snapshot()
    if after == before:
        return []
    if _RAW_ENV is not None:
        before = {os.fsdecode(k): v for k, v in before.items()}
        after = {os.fsdecode(k): v for k, v in after.items()}
    return environment_changes(before, after, ignore)


def _still_blocking(module: str) -> bool:
    loaded = sys.modules.get(module)
    if loaded is None:
        return True  # never imported here: the next import would hang or crash as the trial did
    spec = getattr(loaded, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def raise_if_import_hung(what: str) -> None:
    """Raise a DeviceError when ``what`` (a call that imports transformers) would hang on a bad import."""
    blocking = {m: r for m, r in bad_imports().items() if _still_blocking(m)}
    if not blocking:
        return
    module, reason = next(iter(blocking.items()))
    slow = ", or raise WHICHDEVICE_PROBE_TIMEOUT if its import is just slow" if HUNG in reason else ""
    fate = "wait forever" if HUNG in reason else "fail the same way"
    raise DeviceError(
        f"{what} cannot run in this process: {reason}. transformers and accelerate import {module} "
        f"whenever it is installed, so this would {fate}. Fix or uninstall the package "
        f"(pip uninstall {module.replace('_', '-')}){slow}"
    )


def environment_changes(before: Mapping[str, Any], after: Mapping[str, Any], ignore: Iterable[str] = ()) -> list[str]:
    """``set X``, ``changed X``, ``unset X`` for each variable that differs (values are not shown:
    they can hold secrets)."""
    skip = set(ignore)
    out = []
    for name in sorted(set(before) | set(after)):
        if name in skip or before.get(name) == after.get(name):
            continue
        verb = "set" if name not in before else "unset" if name not in after else "changed"
        out.append(f"{verb} {name}")
    return out


def gave_up_reason(backend: Backend, why: str) -> str:
    """A probe's reason for a package whose trial hung or crashed: what happened, then the fix."""
    fix = (
        f"fix the {backend.hardware} driver/runtime or reinstall {backend.package} "
        f"({backend.install_command}), or uninstall it"
    )
    if HUNG in why:
        fix = f"Raise WHICHDEVICE_PROBE_TIMEOUT=<seconds> if the import is just slow; otherwise {fix}"
    return f"the {backend.name} probe gave up: {why}. {fix[0].upper()}{fix[1:]}"


def with_notes(result: ProbeResult, notes: list[str], before: Mapping[Any, Any]) -> ProbeResult:
    """``result`` with ``notes`` and what changed in the environment since ``before`` as warnings."""
    # A vendor package that edits os.environ on import keeps its edits (its runtime may need them);
    # what it changed is said, names only (values can be secrets). whichdevice's own hooks are
    # reported as env_set already.
    ours = {a.name for a in result.env_set} | set(applied_env())
    changed = changes_since(before, ignore=ours)
    if changed:
        notes = [*notes, f"probing {result.backend} changed the environment: {', '.join(changed)}"]
    if not notes:
        return result
    return replace(result, warnings=tuple(dict.fromkeys([*result.warnings, *notes])))
