"""Replaying a report: ``simulate(report="machine.json")`` answers as the machine that wrote it.

``whichdevice --json`` carries, per registry row, every field of the probe's
:class:`~whichdevice.core.records.ProbeResult`; its ``replay`` section adds the steering environment
variables that were set and every package version whichdevice asked for. A replay hands those
results to the probe machinery (cache, time limit, one run per backend), sets those variables and
answers those versions for its duration, and runs the env hooks and the whole resolver for real.

It replays probe *results*, not raw readings, because the report is what users paste: every
report whichdevice ever wrote holds the results and none holds readings; a third-party backend has
a probe but no readings type; and the readers are free to change what they read (a child process,
a new driver field) without making old reports unreadable. Decoding follows the dataclass fields
(:func:`decode`), so a field added to ``ProbeResult`` or ``DeviceInfo`` replays without an edit here.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import MISSING, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from whichdevice.core.errors import DeviceError, shown
from whichdevice.core.frozen import frozen_record
from whichdevice.core.packages import pip_install
from whichdevice.core.records import Backend, ProbeResult, Visibility
from whichdevice.core.untrusted import read_untrusted
from whichdevice.hardware import probes
from whichdevice.hardware import store as store_module
from whichdevice.hardware.envhooks import _forget, apply_env_defaults
from whichdevice.hardware.registry import backend_names, get_backend
from whichdevice.hardware.store import current_store
from whichdevice.resolve.memo import memo_variables
from whichdevice.testing.replay_checks import check_row

__all__ = [
    "RecordedMachine",
    "comparable",
    "decode",
    "differences",
    "first_difference",
    "load_report",
    "recorded_environment",
    "replay_environment",
    "replaying",
    "steering_variables",
]

# The major schema version this whichdevice reads (see report/gather.py's SCHEMA_VERSION).
READABLE_MAJOR = "1"

# A report is tens of kilobytes (a machine with 64 devices a few hundred); past this it is not one.
_MAX_REPORT = 50_000_000
# Keys ``to_dict`` writes under another name than the dataclass field.
_RENAMED: dict[tuple[type, str], str] = {
    (ProbeResult, "visible"): "visible_devices",
    (Visibility, "raw"): "value",
    (Visibility, "ids"): "physical_ids",
}
# A report row names its backend "name"; the result's own "backend" key is dropped from it.
_ROW_KEYS: dict[str, str] = {"backend": "name"}

# Fields that differ between a machine and its replay by nature: timings, and the marks that say
# "simulated" (a replay is, by definition, not this machine).
VOLATILE_KEYS = frozenset({"seconds", "simulated", "simulation"})


def replaying() -> RecordedMachine | None:
    """The machine the innermost simulation replays from a report (None: not a replay)."""
    store = current_store() if store_module._simulations else None
    return getattr(store, "recorded", None)


def steering_variables() -> tuple[str, ...]:
    """Every environment variable that steers a resolution or a probe, each once."""
    return tuple(dict.fromkeys([*memo_variables(), *probes.ENV_VARIABLES]))


def recorded_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The steering variables set in ``env``: what a report records for its replay."""
    return {name: env[name] for name in steering_variables() if name in env}


@frozen_record
class RecordedMachine:
    """A parsed report: the probe results, steering variables and versions of the machine that wrote it."""

    source: str
    results: Mapping[str, ProbeResult]
    environ: Mapping[str, str]
    packages: Mapping[str, str | None]
    platform: Mapping[str, str]
    # The CPU calibration the report's resolutions used: figures as simulate's calib= takes them
    # (None: none were used) and why; a report from before the calibration has neither.
    calibration: str | None = None
    calibration_why: str = "the report has no CPU calibration figures"

    def probe_function(self, backend: Backend) -> Callable[[Backend], ProbeResult] | None:
        """What the probe of ``backend`` answers in the replay (None: the report has no such row)."""
        result = self.results.get(backend.name)
        if result is None:
            return None
        recorded = replace(result, simulated=True)

        def replayed(b: Backend) -> ProbeResult:
            # The hooks the real probe ran set their variables before the import; run them again
            # so the environment is as the resolver found it there. The result keeps what they did then.
            if any(action.action == "set" for action in recorded.env_set):
                apply_env_defaults(b, "import")
            return recorded

        return replayed


def load_report(report: str | os.PathLike[str] | Mapping[str, Any]) -> RecordedMachine:
    """Read a ``whichdevice --json`` report (a path, or the parsed dict) for replay.

    A file that is not such a report, one from a whichdevice with another major schema version, or
    one damaged on the way raises :class:`DeviceError` naming what is wrong.
    """
    source, data = _read(report)
    _check_kind(source, data)
    unknown = [row.get("name") for row in data["backends"] if row.get("name") not in backend_names()]
    if unknown:
        raise DeviceError(
            f"{source}: the report has backend(s) {', '.join(map(shown, unknown))} that this whichdevice does "
            "not know; install the plugin that registers them (or register_backend(...)) and replay again"
        )
    results = {
        row["name"]: decode(ProbeResult, row, f"{source}: backend {shown(row['name'])}") for row in data["backends"]
    }
    for name, result in results.items():  # by meaning, now that each field has its type
        check_row(source, get_backend(name), result)
    section = data.get("replay")
    if section is None:
        # A 1.0 report has no replay section: its ENVIRONMENT entries and versions are what it recorded.
        entries = data.get("environment")
        entries = entries if isinstance(entries, list) else []
        recorded = {e.get("name"): e.get("value") for e in entries if isinstance(e, Mapping) and e.get("set")}
        environ = _environ(source, recorded, "environment")
        packages = decode(dict[str, str | None], data["versions"], f"{source}: versions")
        packages.pop("python", None)
    elif not isinstance(section, Mapping):
        raise DeviceError(f"{source}: the report's 'replay' section is damaged; give the unchanged report")
    else:
        environ = _environ(source, section.get("environ", {}), "replay.environ")
        packages = decode(dict[str, str | None], section.get("packages", {}), f"{source}: replay.packages")
    platform = decode(dict[str, str], data["platform"], f"{source}: platform")
    spec, why = _calibration(source, data.get("calibration"))
    return RecordedMachine(source, results, environ, packages, platform, spec, why)


def _environ(source: str, raw: Any, where: str) -> dict[str, str]:
    """The recorded variables that this whichdevice reads, checked; a report sets nothing else.

    A name this whichdevice does not declare (``LD_PRELOAD``, ``A=B``) steers nothing here, so it
    is left out rather than set; a value that no environment can hold (a NUL) means damage.
    """
    environ = decode(dict[str, str], raw, f"{source}: {where}")
    steering = set(steering_variables())
    for name, value in environ.items():
        if name in steering and "\0" in value:
            raise DeviceError(
                f"{source}: {where}.{name} holds a NUL character, which no environment variable can; "
                "the report is damaged, give the unchanged one"
            )
    return {name: value for name, value in environ.items() if name in steering}


def _calibration(source: str, entry: Any) -> tuple[str | None, str]:
    if entry is None:
        return None, RecordedMachine.calibration_why
    damaged = DeviceError(f"{source}: the report's 'calibration' section is damaged; give the unchanged report")
    if not isinstance(entry, Mapping) or not isinstance(entry.get("why", ""), str):
        raise damaged
    # The recorded why is kept word for word, so the replayed trace is the recorded one.
    spec, why = entry.get("spec"), entry.get("why") or RecordedMachine.calibration_why
    if spec is None:
        return None, why
    from whichdevice.measure.calibration import parse_figures

    if not isinstance(spec, str):
        raise damaged
    try:
        parse_figures(spec)
    except ValueError:
        raise damaged from None
    return spec, why


def _read(report: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    if isinstance(report, Mapping):
        return "the report given", report
    if not isinstance(report, (str, os.PathLike)):
        raise DeviceError(
            f"simulate(report=...): give the path of a `whichdevice --json` report or its parsed dict, "
            f"not {type(report).__name__}"
        )
    path = Path(report)
    fix = "give the file `whichdevice --json > machine.json` wrote"
    try:  # untrusted: a FIFO, a device or a huge file in its place is said, not waited on
        text = read_untrusted(path, _MAX_REPORT).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DeviceError(f"cannot read the report {shown(str(path))} ({exc}); {fix}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DeviceError(
            f"{path} is not JSON ({exc.msg}: line {exc.lineno}, column {exc.colno}); damaged or cut short? {fix}"
        ) from None
    except RecursionError:
        # No report nests more than a few levels; thousands are a damaged or hostile file.
        raise DeviceError(f"{path} nests its JSON too deeply to be a whichdevice report; {fix}") from None
    if not isinstance(data, Mapping):
        raise DeviceError(f"{path} holds a JSON {type(data).__name__}, not a whichdevice report; {fix}")
    return str(path), data


def _check_kind(source: str, data: Mapping[str, Any]) -> None:
    kind = data.get("kind")
    if kind != "report":
        what = f"a {kind!r} output" if isinstance(kind, str) else "not a whichdevice report"
        raise DeviceError(
            f"{source} is {what}; replay needs the full report: whichdevice --json > machine.json "
            "(without check or smoke)"
        )
    version = data.get("schema_version")
    major = version.split(".")[0] if isinstance(version, str) else None
    if major != READABLE_MAJOR:
        writer = (data.get("versions") or {}).get("whichdevice") if isinstance(data.get("versions"), Mapping) else None
        raise DeviceError(
            f"{source} has report schema {shown(version)} (written by whichdevice "
            f"{shown(writer) if writer else 'of unknown version'}); "
            f"this whichdevice reads schema {READABLE_MAJOR}.x: replay it with "
            + (pip_install(f"whichdevice=={writer}") if isinstance(writer, str) else "the whichdevice that wrote it")
        )
    for key, kind_of in (("backends", list), ("platform", Mapping), ("versions", Mapping)):
        if not isinstance(data.get(key), kind_of):
            raise DeviceError(f"{source}: the report's {key!r} is missing or damaged; give the unchanged report")
    for i, row in enumerate(data["backends"]):
        if not isinstance(row, Mapping) or not isinstance(row.get("name"), str):
            raise DeviceError(f"{source}: backends[{i}] has no name; the report is damaged, give the unchanged one")


# ------------------------------------------------------------------------------------ decoding


def decode(kind: Any, value: Any, where: str) -> Any:
    """``value`` (as ``to_dict`` wrote it) turned back into type ``kind``, following its type hints.

    Raises :class:`DeviceError` naming the field (``where``) whose value does not fit.
    """
    origin = get_origin(kind)
    args = get_args(kind)
    if kind is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _first_fit([a for a in args if a is not type(None)], value, where)
    if isinstance(kind, type) and is_dataclass(kind):
        return _decode_dataclass(kind, value, where)
    if origin is tuple:
        return _decode_tuple(args, value, where)
    if origin in (frozenset, set):
        return frozenset(decode(args[0], v, where) for v in _sequence(value, where))
    if origin in (dict, Mapping) or (isinstance(origin, type) and issubclass(origin, Mapping)):
        if not isinstance(value, Mapping):
            raise DeviceError(f"{where}: expected an object, found {shown(value)}; the report is damaged")
        return {decode(args[0], k, where): decode(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(kind, type) and isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise DeviceError(f"{where}: {shown(value)} is not a {getattr(kind, '__name__', kind)}; the report is damaged")


def _first_fit(kinds: list[Any], value: Any, where: str) -> Any:
    error: DeviceError | None = None
    for kind in kinds:
        try:
            return decode(kind, value, where)
        except DeviceError as exc:
            error = error or exc
    assert error is not None
    raise error


def _sequence(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise DeviceError(f"{where}: expected a list, found {shown(value)}; the report is damaged")
    return list(value)


def _decode_tuple(args: tuple[Any, ...], value: Any, where: str) -> tuple[Any, ...]:
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(_sequence(value, where)))
    if isinstance(value, str):
        # A fixed-length tuple of numbers is written as "8.0" (DeviceInfo.capability).
        value = value.split(".")
        value = [int(p) if p.isdigit() else p for p in value]
    items = _sequence(value, where)
    if len(items) != len(args):
        raise DeviceError(f"{where}: expected {len(args)} parts, found {shown(value)}; the report is damaged")
    return tuple(decode(a, v, where) for a, v in zip(args, items, strict=True))


def _decode_dataclass(kind: type, value: Any, where: str) -> Any:
    if not isinstance(value, Mapping):
        raise DeviceError(f"{where}: expected an object, found {shown(value)}; the report is damaged")
    hints = get_type_hints(kind)
    out: dict[str, Any] = {}
    for f in fields(kind):
        if not f.init:
            continue
        key = _RENAMED.get((kind, f.name), _ROW_KEYS.get(f.name, f.name) if kind is ProbeResult else f.name)
        if key in value:
            out[f.name] = decode(hints[f.name], value[key], f"{where}.{key}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise DeviceError(f"{where}: {key!r} is missing; the report is damaged, give the unchanged one")
    return kind(**out)


# ----------------------------------------------------------------------------------- environment


@contextmanager
def replay_environment(environ: Mapping[str, str]) -> Iterator[None]:
    """Inside the block, the steering variables are exactly ``environ``'s (the others unset).

    Only steering variables are touched: a name in ``environ`` that whichdevice does not read is
    not set (a report is untrusted input, and ``LD_PRELOAD`` steers no device choice).
    """
    names = steering_variables()
    before = {name: os.environ.get(name) for name in names}
    try:
        for name in names:
            _put(name, environ.get(name))
        yield
    finally:
        for name, old in before.items():
            _put(name, old)


def _put(name: str, value: str | None) -> None:
    if os.environ.get(name) == value:
        return
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    _forget(name)


# ------------------------------------------------------------------------------------ comparing


def comparable(data: Any) -> Any:
    """``data`` without what differs between a machine and its replay by nature (timings, the
    SIMULATED marks), for :func:`first_difference`."""
    if isinstance(data, Mapping):
        out = {k: comparable(v) for k, v in data.items() if k not in VOLATILE_KEYS}
        if isinstance(out.get("explanation"), str):
            out["explanation"] = out["explanation"].replace(" (SIMULATED hardware)", "", 1)
        return out
    if isinstance(data, list | tuple):
        return [comparable(v) for v in data]
    return data


def first_difference(a: Any, b: Any) -> str | None:
    """The first field where ``a`` and ``b`` differ, as "path: a != b" (None: they are equal).

    Objects are walked key by key in ``a``'s order (then ``b``'s extra keys), lists item by item,
    so the answer names the field ("backends[6].devices[0].capability"), not just "different".
    """
    return next(differences(a, b), None)


def differences(a: Any, b: Any, path: str = "") -> Iterator[str]:
    """Every field where ``a`` and ``b`` differ, in the order :func:`first_difference` walks them."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in dict.fromkeys([*a, *b]):
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                yield f"{where}: only in {'the second' if key not in a else 'the first'}"
            else:
                yield from differences(a[key], b[key], where)
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            yield from differences(x, y, f"{path}[{i}]")
        if len(a) != len(b):
            yield f"{path}: {len(a)} items != {len(b)} items"
    elif a != b:
        yield f"{path or '(top)'}: {a!r} != {b!r}"
