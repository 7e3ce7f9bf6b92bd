"""A pytest plugin that records every simulated resolution the test suite makes, to compare two versions of the code.

    PYTHONPATH=scripts WHICHDEVICE_RECORD=before.jsonl python -m pytest -p resolution_recorder
    PYTHONPATH=scripts WHICHDEVICE_RECORD=after.jsonl python -m pytest -p resolution_recorder
    python scripts/resolution_recorder.py before.jsonl after.jsonl     # what changed, scenario by scenario

Each ``resolve_device()`` call made under ``simulate()`` is written as one line: the test's node id, the
call's number within the test, and ``Resolution.to_dict()`` (or the error it raised, by class and text).
Temporary folders are written as ``<tmp>`` so that two runs compare. A refactor that must not change any
answer (issue 55) runs the suite before and after and compares the two files.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from typing import Any

_TMP = re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/")
_lines: list[str] = []
_current: dict[str, Any] = {"test": "", "count": 0}


def _normal(value: Any) -> Any:
    text = json.dumps(value, sort_keys=True, default=str)
    return json.loads(_TMP.sub("<tmp>/", text))


def pytest_configure(config: Any) -> None:
    if not os.environ.get("WHICHDEVICE_RECORD"):
        return
    import whichdevice
    from whichdevice.resolve import resolver

    original = resolver.resolve_device

    @functools.wraps(original)  # the signature as before: tests read it
    def recorded(*args: Any, **kwargs: Any) -> Any:
        _current["count"] += 1
        entry = {"test": _current["test"], "call": _current["count"]}
        try:
            res = original(*args, **kwargs)
        except Exception as exc:
            from whichdevice.hardware import store

            if store._simulations:
                _lines.append(json.dumps({**entry, "error": _normal(f"{type(exc).__name__}: {exc}")}))
            raise
        if res.simulated:
            _lines.append(json.dumps({**entry, "answer": _normal(res.to_dict())}))
        return res

    resolver.resolve_device = recorded
    whichdevice.resolve_device = recorded


def pytest_runtest_setup(item: Any) -> None:
    _current["test"] = item.nodeid
    _current["count"] = 0


def pytest_unconfigure(config: Any) -> None:
    path = os.environ.get("WHICHDEVICE_RECORD")
    if path:
        with open(path, "w", encoding="utf-8") as out:
            out.write("\n".join(_lines) + "\n")


def compare(before: str, after: str) -> int:
    """Print the scenarios whose answer changed between two recordings; the number of them."""

    def read(path: str) -> dict[tuple[str, int], Any]:
        found = {}
        with open(path, encoding="utf-8") as rows:
            lines = list(rows)
        for line in lines:
            if line.strip():
                row = json.loads(line)
                found[(row["test"], row["call"])] = row.get("answer", row.get("error"))
        return found

    old, new = read(before), read(after)
    changed = [key for key in old if key in new and old[key] != new[key]]
    for key in changed:
        print(f"{key[0]} call {key[1]}")
    print(f"{len(old)} scenarios before, {len(new)} after, {len(set(old) & set(new))} in both, {len(changed)} changed")
    return len(changed)


if __name__ == "__main__":
    sys.exit(1 if compare(sys.argv[1], sys.argv[2]) else 0)
